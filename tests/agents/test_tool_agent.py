"""The tool agent: its state machine, token-level concatenation and masks, limits, concurrent calls,
abort/resume across a weight push, and the generate stage / rollout service running it unchanged."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

from conftest import prompt_table
from rlpipe.agents.config import AgentLoopParams
from rlpipe.agents.loop import AgentEngine, Phase, build_agent
from rlpipe.agents.tool_agent import ToolEpisode, ToolSession
from rlpipe.backends.weights import export_buckets
from rlpipe.engine.state.rollout_service import RolloutService
from rlpipe.inference.contract import GenerationRequest, GenerationResult, SamplingParams
from rlpipe.inference.embedded import EmbeddedEngine
from rlpipe.stage import StageContext
from rlpipe.stages.generate import GenerateParams, generate
from agent_fixtures import OBSERVATION, PROMPT, TURN1, TURN2, scripted_model, tok  # noqa: F401 (fixtures)

COLD = SamplingParams(temperature=0.05, seed=1)


def params(**loop) -> GenerateParams:
    return GenerateParams(n=1, max_tokens=30, temperature=0.05, agent="tool_agent",
                          agent_loop={"parser": "compact", **loop})


def turn(tok, text, eos=True, version=0, reason="stop", rid="r#turn0") -> GenerationResult:
    ids = np.array(tok.encode(text) + ([tok.eos_token_id] if eos else []), np.int32)
    return GenerationResult(rid, ids, np.full(len(ids), -0.5, np.float32), np.full(len(ids), version, np.int32),
                            reason)


def episode(tok, max_tokens=30, **loop):
    session = ToolSession(AgentLoopParams(parser="compact", **loop), tok)
    request = GenerationRequest("r", tok.encode(PROMPT), max_tokens, COLD)
    ep = ToolEpisode(request, session)
    ep.start()
    ep.take_requests()
    return ep


def settle(ep, timeout=10.0):
    deadline = time.monotonic() + timeout
    while ep.phase is Phase.PROCESSING_TOOLS and time.monotonic() < deadline:
        ep.poll()
        time.sleep(0.005)


# -- the state machine, fed turn by turn ----------------------------------------------

def test_two_turn_episode_masks_spans_versions_by_hand(tok):
    ep = episode(tok)
    ep.deliver(turn(tok, TURN1, version=3))
    assert ep.phase is Phase.PROCESSING_TOOLS
    settle(ep)
    assert ep.phase is Phase.GENERATING
    [nxt] = ep.take_requests()
    obs = tok.encode(OBSERVATION)
    first = tok.encode(TURN1) + [tok.eos_token_id]
    assert list(nxt.prompt_ids) == tok.encode(PROMPT) + first + obs  # token for token, nothing re-encoded
    assert nxt.max_tokens == 30 - len(first) - len(obs)
    ep.deliver(turn(tok, TURN2, version=4, rid=nxt.request_id))
    assert ep.phase is Phase.TERMINATED and ep.termination == "eos"
    r = ep.result()
    second = tok.encode(TURN2) + [tok.eos_token_id]
    assert r.response_ids.tolist() == first + obs + second
    assert r.response_mask.tolist() == [1] * 7 + [0] * 4 + [1] * 3
    assert r.generation_spans.tolist() == [[0, 7], [11, 14]]
    assert r.logprobs.tolist() == [-0.5] * 7 + [0.0] * 4 + [-0.5] * 3
    assert r.versions.tolist() == [3] * 7 + [3] * 4 + [4] * 3  # observation: the version of the turn it answers
    assert (r.num_turns, r.status, r.finish_reason) == (2, "ok", "stop")
    assert ep.history == [Phase.PENDING, Phase.GENERATING, Phase.PROCESSING_TOOLS, Phase.GENERATING,
                          Phase.TERMINATED]


def test_terminations_max_turns_max_length_and_tool_error(tok):
    ep = episode(tok, max_turns=1)
    ep.deliver(turn(tok, TURN1))
    assert (ep.termination, ep.status) == ("max_turns", "truncated")

    ep = episode(tok, max_tokens=7)
    ep.deliver(turn(tok, "[12*3", eos=False, reason="length"))
    assert (ep.termination, ep.status) == ("max_length", "truncated")

    ep = episode(tok, max_tokens=9)  # the observation "=36;" does not fit: cut to the budget, then max_length
    ep.deliver(turn(tok, TURN1))
    settle(ep)
    assert ep.termination == "max_length" and ep.result().response_mask.tolist() == [1] * 7 + [0] * 2

    ep = episode(tok, on_tool_error="terminate")
    ep.deliver(turn(tok, "[1-]"))
    settle(ep)
    assert (ep.termination, ep.status) == ("tool_error", "ok")

    ep = episode(tok, max_tokens=100)  # observed instead: the error text becomes the observation and the episode goes on
    ep.deliver(turn(tok, "[nosuch:1]"))
    settle(ep)
    assert ep.phase is Phase.GENERATING
    assert tok.decode(ep.ids[11:]).startswith("=error: unknown tool")


def test_observation_truncation_side(tok):
    for side, keep in (("right", "=1"), ("left", "4;")):
        ep = episode(tok, max_observation_tokens=2, observation_truncation=side)
        ep.deliver(turn(tok, "[1000+24]"))
        settle(ep)
        assert tok.decode(ep.ids[-2:]) == keep


def test_calls_of_one_turn_run_concurrently(tok):
    ep = episode(tok, max_tokens=100, tools=["latency"], tool_settings={"latency": {"min_s": 0.4, "max_s": 0.4}})
    start = time.monotonic()
    ep.deliver(turn(tok, "[latency:a][latency:b][latency:c][latency:d]"))
    settle(ep)
    elapsed = time.monotonic() - start
    assert ep.phase is Phase.GENERATING and ep.tool_calls == 4
    assert elapsed < 1.2, f"4 calls of 0.4 s took {elapsed:.2f} s: they did not run concurrently"


def test_tool_infrastructure_failure_marks_the_trajectory_failed(tok):
    ep = episode(tok, tools=["python"], tool_settings={"python": {"wall_s": 5}})
    ep.session.tools["python"].limits = None  # a broken sandbox configuration: the tool raises, not the code
    ep.deliver(turn(tok, "[python:1]"))
    settle(ep)
    assert (ep.termination, ep.status) == ("tool_error", "failed")


# -- a real model on the real engine --------------------------------------------------

def test_scripted_episode_on_the_embedded_engine(tok, scripted_model):
    agent = build_agent(EmbeddedEngine(copy.deepcopy(scripted_model), tok), tok, params())
    [r] = agent.generate([GenerationRequest("e", tok.encode(PROMPT), 30, COLD)])
    eos = tok.eos_token_id
    assert r.response_ids.tolist() == tok.encode(TURN1) + [eos] + tok.encode(OBSERVATION) + tok.encode(TURN2) + [eos]
    assert r.response_mask.tolist() == [1] * 7 + [0] * 4 + [1] * 3
    assert (r.termination, r.num_turns) == ("eos", 2)
    # decoding and re-encoding the response would lose the turn's <eos>: the ids are the engine's, not a re-encoding
    assert tok.encode(tok.decode(r.response_ids.tolist(), skip_special_tokens=True)) != r.response_ids.tolist()
    agent.close()


def test_weight_push_mid_turn_resumes_with_both_versions(tok, scripted_model):
    engine = EmbeddedEngine(copy.deepcopy(scripted_model), tok)
    agent = build_agent(engine, tok, params())
    request = GenerationRequest("e", tok.encode(PROMPT), 30, COLD)
    agent.submit([request])
    for _ in range(3):  # prefill + 2 decode steps: 3 tokens of the first turn
        assert agent.step() == []
    [partial] = agent.abort_all()
    assert partial.finish_reason == "abort" and len(partial.response_ids) == 3
    agent.load_weights(export_buckets(scripted_model), version=1)
    [r] = agent.generate([partial.resume(request)])
    assert r.versions.tolist() == [0] * 3 + [1] * 11
    assert r.response_mask.tolist() == [1] * 7 + [0] * 4 + [1] * 3  # same weights: the same episode
    assert r.termination == "eos"


def test_generate_stage_and_rollout_service_emit_the_same_agent_rows(tok, scripted_model):
    worker = type("W", (), {})()
    worker.engine, worker.tokenizer = EmbeddedEngine(copy.deepcopy(scripted_model), tok), tok
    batch = prompt_table(tok, [PROMPT, PROMPT], 0)
    table = generate(worker, batch, params(), StageContext(step=0, seed=0)).table
    assert table.column("response_mask").to_pylist() == [[1] * 7 + [0] * 4 + [1] * 3] * 2
    assert table.column("generation_spans").to_pylist() == [[0, 7, 11, 14]] * 2
    assert table.column("num_turns").to_pylist() == [2, 2]
    assert table.column("termination").to_pylist() == ["eos", "eos"]

    agent = build_agent(EmbeddedEngine(copy.deepcopy(scripted_model), tok), tok, params())
    service = RolloutService(agent, tok)
    try:
        service.submit(batch, params(), seed=0)
        service.push_weights(export_buckets(scripted_model), version=1)  # at whatever point the episodes are
        rows = service.collect(min_groups=2, timeout=60)
    finally:
        service.shutdown()
    assert rows.column("response_mask").to_pylist() == table.column("response_mask").to_pylist()
    assert rows.column("response_ids").to_pylist() == table.column("response_ids").to_pylist()
    assert all(set(v) <= {0, 1} for v in rows.column("token_versions").to_pylist())
    assert isinstance(agent, AgentEngine)


@pytest.mark.slow
def test_scripted_episode_over_the_sglang_protocol_engine(tok, scripted_model, tmp_path):
    """The agent drives any RolloutEngine through submit/step: here rlpipe's SGLang-protocol client talking to
    the embedded engine served over HTTP in a child process; the episode is token for token the same."""
    from rlpipe.inference.engines import EngineInputs, build_engine
    from rlpipe.stage import stage_registry

    impl_params = stage_registry("generate").get("sglang").params_model()
    engine = build_engine("sglang", EngineInputs(copy.deepcopy(scripted_model), tok, impl_params, 0, str(tmp_path),
                                                 name="test sglang"))
    agent = build_agent(engine, tok, params())
    cutting = build_agent(engine, tok, params(stop_at_call=True))  # stop_token_ids travel over the protocol
    try:
        [r] = agent.generate([GenerationRequest("e", tok.encode(PROMPT), 30, COLD)])
        [cut] = cutting.generate([GenerationRequest("f", tok.encode(PROMPT), 12, COLD)])
    finally:
        cutting.close_agent()
        agent.close()
    eos = tok.eos_token_id
    assert r.response_ids.tolist() == tok.encode(TURN1) + [eos] + tok.encode(OBSERVATION) + tok.encode(TURN2) + [eos]
    assert r.response_mask.tolist() == [1] * 7 + [0] * 4 + [1] * 3 and r.termination == "eos"
    assert cut.response_ids.tolist()[:10] == tok.encode(TURN1) + tok.encode(OBSERVATION)  # the turn ended at "]"


def test_stop_at_call_ends_the_turn_at_the_call(tok, scripted_model):
    """stop_at_call: the engine's stop_token_ids end the turn at the compact call's "]" (no eos needed); the
    observation follows at once, mask 0."""
    engine = EmbeddedEngine(copy.deepcopy(scripted_model), tok)
    close = tok.encode("]")
    [plain] = engine.generate([GenerationRequest("s", tok.encode(PROMPT), 30, COLD)])
    stop = SamplingParams(temperature=0.05, seed=1, stop_token_ids=tuple(close))
    [cut] = engine.generate([GenerationRequest("s", tok.encode(PROMPT), 30, stop)])
    assert plain.response_ids.tolist() == tok.encode(TURN1) + [tok.eos_token_id]
    assert cut.response_ids.tolist() == tok.encode(TURN1) and cut.finish_reason == "stop"
    assert cut.logprobs.tolist() == pytest.approx(plain.logprobs[:-1].tolist())  # the same tokens, only cut

    agent = build_agent(EmbeddedEngine(copy.deepcopy(scripted_model), tok), tok, params(stop_at_call=True))
    [r] = agent.generate([GenerationRequest("e", tok.encode(PROMPT), 12, COLD)])
    agent.close()
    first = tok.encode(TURN1)
    assert r.response_ids.tolist()[:len(first) + 4] == first + tok.encode(OBSERVATION)
    assert r.response_mask.tolist()[:len(first) + 4] == [1] * len(first) + [0] * 4
    assert r.generation_spans.tolist()[0] == [0, len(first)]

    from rlpipe.agents.tool_agent import ToolSession  # the closing character must be one token of the tokenizer

    with pytest.raises(ValueError, match="is 0 tokens for this tokenizer"):
        ToolSession(AgentLoopParams(parser="compact", stop_at_call=True), type(
            "T", (), {"encode": lambda self, text, add_special_tokens=False: []})())
