"""The ``generate`` stage: n sampled responses per prompt, impls ``embedded`` | ``vllm`` | ``sglang``.

The impl names the rollout engine each replica runs (:mod:`rlpipe.inference.engines`);
the stage function is one and the same, talking to the engine contract. An engine's
own settings go under ``params.server``.

Group sampling as in GRPO (Shao et al., 2024, "DeepSeekMath"): every prompt row
becomes ``n`` trajectory rows sharing its ``uid`` (``sample_index`` 0..n-1),
each with its response tokens, the rollout engine's sampled-token logprobs and
the policy version of every token. Runs inside each rollout worker on its shard
of prompts, through the worker's :class:`~rlpipe.inference.contract.RolloutEngine`.

Randomness: one seed per (run seed, step, dp rank), and the engine's per-request
streams are keyed by ``uid/sample_index``, so a rerun reproduces every token.

``group_requests`` and ``trajectory_table`` are the two halves of the stage
without the engine call; the async modes' rollout service
(:mod:`rlpipe.engine.state.rollout_service`) uses them, so its rows equal this stage's.

Agents: ``params.agent`` names how a trajectory is produced (registry ``agent``,
per row overridable by the prompt batch's optional ``agent`` column among ``params.agents``,
:mod:`rlpipe.agents`): ``single_turn`` (one generation, the default),
``tool_agent`` (multi-turn tool calls, settings under ``params.agent_loop``) or
``gateway`` (a black-box agent program behind an OpenAI-compatible gateway,
settings under ``params.gateway``). An agent is itself a rollout engine wrapping
the replica's engine, so this stage, the async modes and weight pushes drive it
unchanged; its rows carry their own ``response_mask``, ``generation_spans``,
``num_turns`` and ``termination``.

Left out: partial rollouts across steps (the async modes' rollout service does
them); this stage runs one synchronous generation to completion.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import ConfigDict, Field, field_validator

from rlpipe.agents.config import AgentLoopParams, GatewayAgentParams
from rlpipe.inference.contract import GenerationRequest, GenerationResult, SamplingParams
from rlpipe.inference.sglang_engine import SGLangParams
from rlpipe.inference.vllm_server import VLLMParams
from rlpipe.errors import BatchError
from rlpipe.jagged import from_flat, offsets_and_values
from rlpipe.schemas.batch import (
    AGENT,
    DATA_SOURCE,
    EXTRA_INFO,
    GENERATION_SPANS,
    GROUND_TRUTH,
    NUM_TURNS,
    PROMPT_IDS,
    PROMPT_STEP,
    RESPONSE_IDS,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    ROLLOUT_LOGPROBS,
    SAMPLE_INDEX,
    STATUS,
    STATUS_ABORTED,
    STATUS_OK,
    STATUS_TRUNCATED,
    TERMINATION,
    TOKEN_VERSIONS,
    UID,
    column_type,
)
from rlpipe.stage import StageContext, StageParams, StageResult, cols, stage

_STATUS = {"stop": STATUS_OK, "length": STATUS_TRUNCATED, "abort": STATUS_ABORTED}
_TERMINATION = {"stop": "eos", "length": "max_length", "abort": "aborted"}
PASS_THROUGH = (UID, DATA_SOURCE, GROUND_TRUTH, PROMPT_IDS, PROMPT_STEP)
"""Prompt columns every trajectory row carries over from its prompt row."""


class GenerateParams(StageParams):
    """Sampling of the rollout: how many responses per prompt and how tokens are drawn."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    n: int = Field(8, ge=1)
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: float = Field(1.0, gt=0)
    """Softmax temperature; the logprobs returned are those of the tempered distribution."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens with this much mass (1 = off)."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (0 = off)."""
    max_tokens: int = Field(32, ge=1)
    """Most response tokens per trajectory; longer ones stop with status `truncated`."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence up to the length budget (load generation for benchmarks)."""
    length_distribution: Literal["fixed", "pareto"] = "fixed"
    """Per-request length budget: `fixed` = max_tokens; `pareto` = a heavy-tailed draw (seeded per request)
    in [min_tokens, max_tokens] — with ignore_eos, the long-tail rollout latency of real agentic/reasoning RL."""
    pareto_alpha: float = Field(1.2, gt=0)
    """Tail index of the pareto length draw (smaller = heavier tail)."""
    min_tokens: int = Field(1, ge=1)
    """Smallest length budget of the pareto draw."""
    env_latency_s: float = Field(0.0, ge=0)
    """Simulated environment latency before a trajectory's first token (a sandbox starting, a tool
    answering): a heavy-tailed draw per request, Pareto(pareto_alpha) from this minimum, capped at
    env_latency_max_s, seeded per request. 0 = none. Wall time only: it takes no compute."""
    env_latency_max_s: float = Field(10.0, gt=0)
    """Cap of the environment latency draw."""
    agent: str = "single_turn"
    """How a trajectory is produced (registry `agent`): `single_turn` (one generation), `tool_agent` (multi-turn
    tool calls, see `agent_loop`) or `gateway` (an agent program behind an OpenAI-compatible gateway, see
    `gateway`). With an agent, max_tokens caps the whole response: model and observation tokens together."""
    agent_loop: AgentLoopParams = Field(default_factory=AgentLoopParams)
    """Settings of the `tool_agent`: tools, call format, turn and observation limits."""
    gateway: GatewayAgentParams = Field(default_factory=GatewayAgentParams)
    """Settings of the `gateway` agent: the agent program, session timeout and cap."""
    agents: list[str] = Field(default_factory=list)
    """More agents that rows may name in their `agent` column (the per-sample choice; a row without one uses
    `agent`). Every rollout replica serves `agent` and these, with the settings above."""

    @field_validator("agent")
    @classmethod
    def _known_agent(cls, value: str) -> str:
        from rlpipe.agents.loop import AGENTS

        if value not in AGENTS:
            raise ValueError(f"unknown agent {value!r}; known: {', '.join(AGENTS.names())}")
        return value

    @field_validator("agents")
    @classmethod
    def _known_agents(cls, value: list[str]) -> list[str]:
        from rlpipe.agents.loop import AGENTS

        unknown = sorted(set(value) - set(AGENTS.names()))
        if unknown:
            raise ValueError(f"unknown agent(s) {unknown} in agents; known: {', '.join(AGENTS.names())}")
        return value


def generation_seed(ctx: StageContext) -> int:
    """The sampling seed of one execution: a function of run seed, step and dp rank."""
    digest = hashlib.blake2b(f"generate\x00{ctx.seed}\x00{ctx.step}\x00{ctx.dp_rank}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def generate(worker: Any, batch: pa.Table, params: GenerateParams, ctx: StageContext) -> StageResult:
    """Sample ``params.n`` responses for every prompt row of ``batch``; with ``ctx.extras.sleep_after_generate``
    (sync mode: training comes next) the replica's engine goes to sleep once they are done."""
    rows, sample_index, requests = group_requests(batch, params, generation_seed(ctx))
    engine, own = rollout_engine(worker, params)
    start = time.perf_counter()
    try:
        results = engine.generate(requests)
    finally:
        if own:
            engine.close_agent()
    elapsed = time.perf_counter() - start
    if ctx.extras.sleep_after_generate:
        worker.sleep()
    table = trajectory_table(batch.take(pa.array(rows)), sample_index, results, worker.tokenizer)
    return StageResult(table=table, metrics=_metrics(results, elapsed))


_READS = cols(UID, DATA_SOURCE, GROUND_TRUTH, PROMPT_IDS, PROMPT_STEP)
_ORDER = (UID, SAMPLE_INDEX, DATA_SOURCE, GROUND_TRUTH, PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, RESPONSE_TEXT,
          ROLLOUT_LOGPROBS, TOKEN_VERSIONS, STATUS, PROMPT_STEP, GENERATION_SPANS, NUM_TURNS, TERMINATION)
_WRITES = cols(*_ORDER)


class SGLangGenerateParams(GenerateParams):
    """Sampling of the rollout, generated by an SGLang-protocol server (one per rollout replica)."""

    server: SGLangParams = Field(default_factory=SGLangParams)
    """The server: real SGLang (`server: sglang`) or rlpipe's embedded engine behind SGLang's protocol
    (`server: embedded`, the default here), launched on the replica's initial weights unless `url` is set."""


class VLLMGenerateParams(GenerateParams):
    """Sampling of the rollout, generated by a vLLM server rlpipe starts for each rollout replica."""

    server: VLLMParams = Field(default_factory=VLLMParams)
    """The vLLM server: timeouts, KV-cache size, threads, the interpreter of vLLM's venv, extra flags."""


for _impl, _params in (("embedded", GenerateParams), ("sglang", SGLangGenerateParams),
                       ("vllm", VLLMGenerateParams)):
    # one function for every engine: the replica's engine (rlpipe.inference.engines) is the only difference
    stage("generate", _impl, placement="worker", role="rollout", creates_rows=True, reads=_READS, writes=_WRITES,
          params=_params)(generate)


def rollout_engine(worker: Any, params: GenerateParams) -> tuple[Any, bool]:
    """The engine this stage drives and whether it was built for this call: the worker's engine when it already
    runs ``params.agent`` (rollout replicas wrap theirs at start), else the agent wrapped around it."""
    from rlpipe.agents.loop import AgentEngine, build_agent

    engine = worker.engine
    if (params.agent == "single_turn" and not getattr(params, "agents", ())) or isinstance(engine, AgentEngine):
        return engine, False
    return build_agent(engine, worker.tokenizer, params), True


def request_id(uid: str, sample_index: int) -> str:
    """The engine request id of one trajectory; it keys the trajectory's random stream."""
    return f"{uid}/{sample_index}"


def length_budgets(params, ids: list[str], seed: int) -> np.ndarray:
    """Each request's max_tokens: fixed, or a Pareto draw keyed by (seed, request id) so it is reproducible."""
    if getattr(params, "length_distribution", "fixed") == "fixed":
        return np.full(len(ids), params.max_tokens)
    draw = params.min_tokens * _uniforms(ids, seed, "") ** (-1.0 / params.pareto_alpha)  # Pareto(alpha, min) inverse CDF
    return np.clip(np.floor(draw), params.min_tokens, params.max_tokens).astype(np.int64)


def env_latencies(params: GenerateParams, ids: list[str], seed: int) -> np.ndarray:
    """Seconds each request waits for its (simulated) environment before its first token."""
    if not getattr(params, "env_latency_s", 0.0):
        return np.zeros(len(ids))
    draw = params.env_latency_s * _uniforms(ids, seed, "env") ** (-1.0 / params.pareto_alpha)
    return np.minimum(draw, params.env_latency_max_s)


def _uniforms(ids: list[str], seed: int, stream: str) -> np.ndarray:
    """One uniform in (0, 1) per request id: a hash of (seed, id, stream), independent of the batch."""
    tag = f"\x00{stream}" if stream else ""  # "" keeps the length draws of earlier versions
    keys = [int.from_bytes(hashlib.blake2b(f"{seed}\x00{rid}{tag}".encode(), digest_size=8).digest(), "little")
            for rid in ids]
    return (np.array(keys, dtype=np.float64) + 0.5) / 2.0**64


def group_requests(
    batch: pa.Table, params: GenerateParams, seed: int
) -> tuple[np.ndarray, np.ndarray, list[GenerationRequest]]:
    """``(prompt row, sample index, request)`` of every trajectory: ``params.n`` per prompt row, row-major.

    ``params`` may be any object with GenerateParams' fields. Raises BatchError if a uid repeats.
    """
    uids = batch.column(UID)
    if pc.count_distinct(uids).as_py() != batch.num_rows:
        raise BatchError("generate needs one row per prompt: the batch repeats a uid; give every prompt its own uid")
    rows = np.repeat(np.arange(batch.num_rows), params.n)
    sample_index = np.tile(np.arange(params.n, dtype=np.int32), batch.num_rows)
    offsets, values = offsets_and_values(batch.column(PROMPT_IDS))
    prompts = [values[offsets[i] : offsets[i + 1]] for i in range(batch.num_rows)]  # views, no copies
    uid_list = uids.to_pylist()
    sampling = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed,
                              ignore_eos=getattr(params, "ignore_eos", False))
    ids = [request_id(uid_list[row], j) for row, j in zip(rows.tolist(), sample_index.tolist())]
    budgets = length_budgets(params, ids, seed)
    ready_at = time.monotonic() + env_latencies(params, ids, seed)
    requests = [
        GenerationRequest(rid, prompts[row], max_tokens=int(budget), sampling=sampling, ready_at=float(ready))
        for rid, row, budget, ready in zip(ids, rows.tolist(), budgets, ready_at)
    ]
    agents = row_agents(batch, params)
    if agents is not None:  # the per-sample choice travels with each request
        from rlpipe.agents.loop import AgentRequest

        requests = [AgentRequest(**{f: getattr(r, f) for f in r.__dataclass_fields__}, agent=agents[row])
                    for r, row in zip(requests, rows.tolist())]
    return rows, sample_index, requests


def row_agents(batch: pa.Table, params) -> list[str] | None:
    """Each prompt row's agent from its `agent` column (null: ``params.agent``); None when the batch has none.
    Raises BatchError naming a row's agent that the engine does not serve."""
    if AGENT not in batch.column_names:
        return None
    default = getattr(params, "agent", "single_turn")
    served = {default, *getattr(params, "agents", ())}
    agents = [a or default for a in batch.column(AGENT).to_pylist()]
    unserved = sorted(set(agents) - served)
    if unserved:
        raise BatchError(f"rows name agent(s) {unserved} in their `agent` column, which generate does not serve "
                         f"({', '.join(sorted(served))}); add them to generate.params.agents")
    return agents


def trajectory_table(
    expanded: pa.Table, sample_index: np.ndarray, results: list[GenerationResult], tokenizer
) -> pa.Table:
    """The canonical trajectory rows: ``expanded`` holds each row's prompt columns, ``results`` its response."""
    lens = np.array([len(r.response_ids) for r in results], dtype=np.int64)
    ids = _concat([r.response_ids for r in results], np.int32)
    columns = {name: expanded.column(name).cast(column_type(name)) for name in PASS_THROUGH}
    columns[SAMPLE_INDEX] = pa.array(sample_index, type=column_type(SAMPLE_INDEX))
    columns[RESPONSE_IDS] = from_flat(ids, lens, pa.int32())
    masks = [getattr(r, "response_mask", None) for r in results]  # agents' results carry theirs
    columns[RESPONSE_MASK] = from_flat(
        _concat([np.ones(len(r.response_ids), np.int8) if m is None else m for r, m in zip(results, masks)], np.int8),
        lens, pa.int8())
    prompts = [getattr(r, "prompt_ids", None) for r in results]  # a gateway session has its own prompt
    if any(p is not None for p in prompts):
        old = columns[PROMPT_IDS].to_pylist()
        columns[PROMPT_IDS] = pa.array([o if p is None else p.tolist() for o, p in zip(old, prompts)],
                                       type=column_type(PROMPT_IDS))
    columns[RESPONSE_TEXT] = pa.array(
        tokenizer.batch_decode([r.response_ids.tolist() for r in results], skip_special_tokens=True),
        type=column_type(RESPONSE_TEXT),
    )
    columns[ROLLOUT_LOGPROBS] = from_flat(_concat([r.logprobs for r in results], np.float32), lens, pa.float32())
    columns[TOKEN_VERSIONS] = from_flat(_concat([r.versions for r in results], np.int32), lens, pa.int32())
    columns[STATUS] = pa.array([getattr(r, "status", None) or _STATUS[r.finish_reason] for r in results],
                               type=column_type(STATUS))
    spans = [np.array([[0, n]], np.int32) if getattr(r, "generation_spans", None) is None else r.generation_spans
             for r, n in zip(results, lens.tolist())]
    columns[GENERATION_SPANS] = from_flat(_concat([s.reshape(-1) for s in spans], np.int32),
                                          np.array([s.size for s in spans], np.int64), pa.int32())
    columns[NUM_TURNS] = pa.array([getattr(r, "num_turns", 1) for r in results], type=column_type(NUM_TURNS))
    columns[TERMINATION] = pa.array([getattr(r, "termination", None) or _TERMINATION[r.finish_reason]
                                     for r in results], type=column_type(TERMINATION))
    out = {name: columns[name] for name in _ORDER}
    if EXTRA_INFO in expanded.column_names:  # the dataset's details for the reward function ride along
        out[EXTRA_INFO] = expanded.column(EXTRA_INFO).cast(column_type(EXTRA_INFO))
    return pa.table(out)


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _metrics(results: list[GenerationResult], elapsed: float) -> dict[str, float]:
    if not results:
        return {}
    lens = np.array([len(r.response_ids) for r in results], dtype=np.float64)
    truncated = np.mean([r.finish_reason == "length" for r in results])
    return {
        "generate/response_length_mean": float(lens.mean()),
        "generate/response_length_max": float(lens.max()),
        "generate/truncated_fraction": float(truncated),
        "generate/tokens_per_s": float(lens.sum() / max(elapsed, 1e-9)),
        "generate/turns_mean": float(np.mean([getattr(r, "num_turns", 1) for r in results])),
    }
