"""Generative judge (generative reward model): a model reads the response and writes a score.

The judge is a policy-like causal LM behind the rollout-engine contract
(:class:`~rlpipe.inference.contract.RolloutEngine`; the embedded engine by default, any
``rlpipe.inference.engines`` impl by name). Its text is parsed with ``score_pattern``
(first capture group, a number, divided by ``max_score``); text without a match — or a
call that does not finish within ``timeout_s`` — gives no score, and the reward stage
marks that trajectory ``status = "failed"`` (an infrastructure failure: DAPO and the
advantage leave it out instead of teaching it as wrong).

Two modes:

* ``pointwise`` — one prompt per trajectory (``prompt_template`` with ``{prompt}``,
  ``{response}``, ``{ground_truth}``);
* ``groupwise`` — one prompt per group (all responses of one ``uid``, numbered from 1:
  ``group_template`` with ``{prompt}``, ``{ground_truth}``, ``{responses}``); the judge
  answers a line ``<k>: <score>`` per response and optionally ``HACKED: <k>, <k>`` naming
  responses that game the checker. Those flags feed the ``grpo_gar`` advantage
  (:mod:`rlpipe.stages.gar`): MiMo's group-wise advantage redistribution.

Timeouts: every call has its own deadline; the engine is stepped until the deadline,
then its unfinished requests are aborted (the contract returns them, never hangs).
``latency_s`` adds a fixed delay before each judge request starts (the engine's
``ready_at``): a stand-in for a remote judge's latency in tests and benchmarks.

Left out: chat templates, sampling several judgments per trajectory (self-consistency),
and pairwise (A vs B) comparison prompts.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlpipe.schemas.config import ModelConfig, TokenizerConfig

POINTWISE = "Question: {prompt}\nReference: {ground_truth}\nAnswer: {response}\nSCORE:"
GROUPWISE = "Question: {prompt}\nReference: {ground_truth}\n{responses}\nScores:"


class JudgeConfig(BaseModel):
    """Which judge model grades, how it is prompted and how its answer is parsed."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    engine: str = "embedded"
    """Rollout engine serving the judge (a `generate` impl name: embedded | vllm | sglang)."""
    model: ModelConfig
    """The judge model (a local directory or an architecture, as the policy's `model`)."""
    tokenizer: TokenizerConfig | None = None
    """The judge's tokenizer; None = the policy's."""
    mode: Literal["pointwise", "groupwise"] = "pointwise"
    """One prompt per trajectory, or one prompt per group (all responses of a uid)."""
    prompt_template: str = POINTWISE
    """Pointwise prompt; fields {prompt}, {response}, {ground_truth}."""
    group_template: str = GROUPWISE
    """Groupwise prompt; fields {prompt}, {ground_truth}, {responses} (lines `Response k: ...`)."""
    score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    """Regex whose first group is the score (pointwise: first match in the judge's text)."""
    max_score: float = Field(1.0, gt=0)
    """Scores are divided by this (a 0-10 judge → max_score 10)."""
    max_tokens: int = Field(16, ge=1)
    """Most tokens the judge writes per prompt."""
    temperature: float = Field(1.0, gt=0)
    """Judge sampling temperature (the embedded engine has no greedy mode; use a small value)."""
    timeout_s: float = Field(60.0, gt=0)
    """Per-call deadline; rows of a call past it get status `failed`."""
    latency_s: float = Field(0.0, ge=0)
    """Simulated latency before each judge request starts (tests, benchmarks); 0 = none."""
    seed: int = Field(0, ge=0)
    """Judge model initialization (architecture) and sampling seed."""

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        try:
            groups = re.compile(pattern).groups
        except re.error as exc:
            raise ValueError(f"score_pattern {pattern!r} is not a regex: {exc}") from None
        if groups < 1:
            raise ValueError(f"score_pattern {pattern!r} needs a capture group around the number, e.g. r'SCORE: (\\d+)'")
        return pattern


def parse_score(text: str, pattern: str, max_score: float) -> float | None:
    """The first match's group 1 / max_score, or None (no match, not a number)."""
    match = re.search(pattern, text)
    try:
        return float(match.group(1)) / max_score if match else None
    except ValueError:
        return None


_LINE = re.compile(r"(\d+)\s*:\s*(-?\d+(?:\.\d+)?)")
_HACKED = re.compile(r"HACKED\s*:\s*([\d,\s]*)", re.IGNORECASE)


def parse_group(text: str, size: int, max_score: float) -> tuple[list[float | None], list[bool]]:
    """Per-response scores (None where the judge gave none) and hacked flags of one group answer."""
    scores: list[float | None] = [None] * size
    hacked = [False] * size
    flagged = _HACKED.search(text)
    body = text[: flagged.start()] if flagged else text
    for k, value in _LINE.findall(body):
        if 1 <= int(k) <= size and scores[int(k) - 1] is None:
            scores[int(k) - 1] = float(value) / max_score
    if flagged:
        for k in re.findall(r"\d+", flagged.group(1)):
            if 1 <= int(k) <= size:
                hacked[int(k) - 1] = True
    return scores, hacked


class Judge:
    """A judge model behind a rollout engine; ``complete(prompts)`` → texts (None: timed out)."""

    def __init__(self, cfg: JudgeConfig, policy_tokenizer, name: str = "judge", model=None):
        """``model``: an already built judge model (a transformers causal LM) instead of ``cfg.model``."""
        from rlpipe.backends.model import build_model
        from rlpipe.backends.tokenizer import build_tokenizer
        from rlpipe.inference.engines import EngineInputs, build_engine
        from rlpipe.stage import stage_registry

        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg.tokenizer) if cfg.tokenizer is not None else policy_tokenizer
        model = build_model(cfg.model, self.tokenizer, cfg.seed) if model is None else model
        model.eval()
        params = stage_registry("generate").get(cfg.engine).params_model()
        workdir = os.path.join(tempfile.gettempdir(), f"rlpipe-{name}-{os.getpid()}")
        self.engine = build_engine(cfg.engine, EngineInputs(model, self.tokenizer, params, 0, workdir, name=name))
        self._calls = 0

    def complete(self, prompts: list[str]) -> list[str | None]:
        """The judge's text for every prompt, or None for those unfinished at the call's deadline."""
        from rlpipe.inference.contract import GenerationRequest, SamplingParams

        self._calls += 1
        start = time.monotonic()
        deadline = start + self.cfg.timeout_s
        sampling = SamplingParams(temperature=self.cfg.temperature, seed=self.cfg.seed + self._calls)
        requests = [GenerationRequest(f"judge-{self._calls}-{i}", self.tokenizer.encode(p, add_special_tokens=False)
                                      or [self.tokenizer.eos_token_id], self.cfg.max_tokens, sampling,
                                      ready_at=start + self.cfg.latency_s) for i, p in enumerate(prompts)]
        self.engine.submit(requests)
        index = {r.request_id: i for i, r in enumerate(requests)}
        texts: list[str | None] = [None] * len(prompts)
        done = 0
        while done < len(prompts):
            if time.monotonic() >= deadline:
                self.engine.abort_all()  # unfinished requests come back as partials; they stay None
                break
            wait = self.engine.next_ready_in()
            if wait > 0:
                time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                continue
            for result in self.engine.step():
                if result.request_id in index and result.finish_reason != "abort":
                    texts[index[result.request_id]] = self.tokenizer.decode(result.response_ids,
                                                                            skip_special_tokens=True)
                    done += 1
        return texts

    def close(self) -> None:
        self.engine.close()


def pointwise_scores(judge: Judge, prompts: list[str], responses: list[str], truths: list[str]) -> np.ndarray:
    """float32 scores (NaN: timed out or unparsable)."""
    cfg = judge.cfg
    texts = judge.complete([cfg.prompt_template.format(prompt=p, response=r, ground_truth=g)
                            for p, r, g in zip(prompts, responses, truths)])
    return np.array([np.nan if t is None or (s := parse_score(t, cfg.score_pattern, cfg.max_score)) is None else s
                     for t in texts], dtype=np.float32)


def groupwise_scores(judge: Judge, groups: list[np.ndarray], prompts: list[str], responses: list[str],
                     truths: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(float32 scores with NaN where missing, bool hacked flags) per row; ``groups`` = row indices per group."""
    cfg = judge.cfg
    asks = []
    for rows in groups:
        listed = "\n".join(f"Response {k + 1}: {responses[i]}" for k, i in enumerate(rows))
        asks.append(cfg.group_template.format(prompt=prompts[rows[0]], ground_truth=truths[rows[0]], responses=listed))
    texts = judge.complete(asks)
    scores = np.full(len(responses), np.nan, dtype=np.float32)
    hacked = np.zeros(len(responses), dtype=bool)
    for rows, text in zip(groups, texts):
        if text is None:
            continue
        group_scores, group_hacked = parse_group(text, len(rows), cfg.max_score)
        scores[rows] = [np.nan if s is None else s for s in group_scores]
        hacked[rows] = group_hacked
    return scores, hacked
