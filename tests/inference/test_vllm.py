"""The vLLM rollout engine against a real vLLM 0.32 server.

The tests attach to the test run's shared server (``vllm_server`` in tests/conftest.py, started once;
its cold start is 40-60 s on 2 cores): the module's engine pushes its own weights on attach. A server killed under
a run (rlpipe's own start of it, the error naming its log, no process left behind) is
tests/e2e/test_vllm_owned_server.py.
"""

import dataclasses
import time

import numpy as np
import pytest
import torch

from conftest import VLLM_ARCH, VLLM_CHARS
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import export_buckets
from rlpipe.inference.contract import EngineError, GenerationRequest, SamplingParams
from rlpipe.inference.vllm_build import build_vllm_engine
from rlpipe.inference.vllm_server import VLLMParams, vllm_python
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig


def _no_vllm() -> str | None:
    try:
        vllm_python(VLLMParams())
    except EngineError as exc:
        return str(exc)
    return None


pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_no_vllm() is not None, reason=str(_no_vllm()))]

TRAINER = {}  # "model": the HF model whose weights the server holds now
TOK = build_tokenizer(TokenizerConfig(chars=VLLM_CHARS))
PROMPTS = ["1+2=", "abc de", "9", "h 77 + 1 ="]
ARCH = ArchitectureConfig(**VLLM_ARCH)
LONGEST = 20000  # the abort test's responses: minutes of decoding, so an abort always lands mid-response (it goes
# out at once; on an idle box it lands within tokens); the shared server's max_model_len is 32768


def model(seed):
    return build_model(ModelConfig(architecture=ARCH), TOK, seed).eval()


@pytest.fixture(scope="module")
def engine(vllm_server, tmp_path_factory):
    # a call the server never answers fails in 2 minutes, not the default 10 (the tests' calls take seconds)
    eng = build_vllm_engine(model(0), TOK, VLLMParams(urls=[vllm_server.url], request_timeout_s=120), rank=0,
                            workdir=tmp_path_factory.mktemp("vllm"))
    TRAINER["model"] = model(0)  # the weights the server holds, for forward recomputation
    yield eng
    eng.close()


def test_attach_pushes_the_attaching_models_weights_and_close_leaves_the_server(vllm_server, tmp_path):
    """An attached engine serves its own model's weights (not the server's initial ones) as version 0, and
    closing it leaves the server running for the next client."""
    mine = model(11)
    eng = build_vllm_engine(mine, TOK, VLLMParams(urls=[vllm_server.url]), rank=0, workdir=tmp_path)
    req = GenerationRequest("att", TOK.encode("1+2="), 8, SamplingParams(seed=3, ignore_eos=True))
    [res] = eng.generate([req])
    assert eng.version == 0 and (res.versions == 0).all()
    np.testing.assert_allclose(res.logprobs, forward_logprobs(mine, req, res), atol=1e-4)
    eng.close()
    vllm_server.check_alive()
    assert vllm_server.request("GET", "/health", timeout=10) is None
    with pytest.raises(EngineError, match="no server.*urls"):
        build_vllm_engine(mine, TOK, VLLMParams(urls=[vllm_server.url]), rank=1, workdir=tmp_path)
    other = build_model(ModelConfig(architecture=ARCH.model_copy(update={"intermediate_size": 64})), TOK, 0)
    with pytest.raises(EngineError, match="intermediate_size=128.*has 64"):
        build_vllm_engine(other, TOK, VLLMParams(urls=[vllm_server.url]), rank=0, workdir=tmp_path)


def requests(n=8, max_tokens=12, seed=7, prefix="r", **kw):
    params = SamplingParams(seed=seed, **kw)
    return [GenerationRequest(f"{prefix}{i}", TOK.encode(PROMPTS[i % len(PROMPTS)]), max_tokens, params)
            for i in range(n)]


def forward_logprobs(m, request, result):
    """Log-softmax of ``m`` (full forward, temperature 1) at each response token of ``result``."""
    ids = torch.tensor([list(request.prompt_ids) + result.response_ids.tolist()])
    with torch.no_grad():
        logits = m(input_ids=ids).logits[0].float()
    p = len(request.prompt_ids)
    logp = torch.log_softmax(logits[p - 1 : -1], -1)
    return logp.gather(1, torch.from_numpy(result.response_ids.astype(np.int64))[:, None])[:, 0].numpy()


def push(engine, seed):
    """Push a differently seeded model of the same shape as version + 1; it becomes the trainer model."""
    new = model(seed)
    timings = engine.load_weights(export_buckets(new, bucket_bytes=256 << 10), engine.version + 1)
    TRAINER["model"] = new
    return timings


def wait_sent(engine, n, timeout=60.0):
    """Wait until ``n`` requests are in flight on the server (the rollout service submits on its own thread)."""
    deadline = time.monotonic() + timeout
    while engine.num_running() < n:
        assert time.monotonic() < deadline, f"{engine.num_running()} of {n} requests sent in {timeout} s"
        time.sleep(0.005)


def metric(engine, name):
    text = engine.server.request("GET", "/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def prefix_cache_hits(engine):
    return metric(engine, "vllm:prefix_cache_hits_total")


def test_generates_tokens_logprobs_versions_reproducibly(engine):
    reqs = requests()
    results = engine.generate(reqs)
    for req, res in zip(reqs, results):
        assert res.request_id == req.request_id
        assert len(res.response_ids) == len(res.logprobs) == len(res.versions) <= req.max_tokens
        assert res.response_ids.dtype == np.int32 and res.logprobs.dtype == np.float32
        assert (res.versions == engine.version).all()
        assert res.finish_reason in ("stop", "length")
        assert (res.logprobs <= 0).all()
        # temperature 1: the returned logprobs are the served model's, recomputed by transformers
        np.testing.assert_allclose(res.logprobs, forward_logprobs(TRAINER["model"], req, res), atol=1e-4)
    again = engine.generate(reqs)
    for a, b in zip(results, again):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
    other = engine.generate(requests(seed=8))
    assert any(not np.array_equal(a.response_ids, b.response_ids) for a, b in zip(results, other))


def test_seeded_prompts_larger_than_one_scheduler_step(engine):
    """3 prompts exceed a step's token budget (--max-num-batched-tokens): with chunked prefill, vLLM 0.32
    on CPU would rewind a seeded generator it cannot rewind and its engine core would die."""
    budget = max(ARCH.max_position_embeddings, 2048)  # the server's --max-num-batched-tokens
    size = budget // 3 + 100
    long = [GenerationRequest(f"big{i}", TOK.encode("0123456789 abcdefgh+="[i:] * (size // 20 + 1))[:size], 4,
                              SamplingParams(seed=i)) for i in range(3)]
    results = engine.generate(long)
    assert all(1 <= len(r.response_ids) <= 4 for r in results)
    engine.health()


def test_pushed_weights_reach_the_server(engine):
    before = engine.version
    timings = push(engine, seed=1)
    assert engine.version == before + 1
    assert set(timings) == {"transport_s", "load_s", "cache_reset_s", "bytes"} and timings["bytes"] > 0
    reqs = requests(max_tokens=16, ignore_eos=True, prefix="w")
    for req, res in zip(reqs, engine.generate(reqs)):
        assert len(res.response_ids) == 16 and (res.versions == engine.version).all()
        np.testing.assert_allclose(res.logprobs, forward_logprobs(TRAINER["model"], req, res), atol=1e-4)


def scheduled_on_server(engine, n, ours, timeout=60.0):
    """Wait until the server runs ``n`` requests at once; False as soon as one of our ``ours`` requests ended."""
    deadline = time.monotonic() + timeout
    while metric(engine, "vllm:num_requests_running") < n:
        if engine.num_running() < ours:
            return False
        assert time.monotonic() < deadline, f"the server ran fewer than {n} requests at once for {timeout} s"
        time.sleep(0.02)
    return True


def test_abort_then_resume_across_a_push_carries_both_versions(engine):
    # The abort must land mid-response for every request. On a loaded 2-core CI box, 2000-token requests all
    # ended first more than once: the server's API process (which serves the metrics, the streams and the abort)
    # starves while its engine core decodes on. So the requests ask for LONGEST tokens (minutes of decoding), the
    # abort goes out as soon as the server runs all four, and the resumed requests ask for 24 tokens more than
    # their partial responses (the resume itself is what is checked, not a long decode).
    longest = LONGEST
    v = engine.version
    reqs = requests(n=4, max_tokens=longest, ignore_eos=True, prefix="long-")
    sampled = metric(engine, "vllm:generation_tokens_total")
    engine.submit(reqs)
    scheduled_on_server(engine, len(reqs), len(reqs))
    deadline = time.monotonic() + 60  # and until the server has sampled tokens for them
    while metric(engine, "vllm:generation_tokens_total") <= sampled and time.monotonic() < deadline:
        time.sleep(0.02)
    partials = engine.abort_all()
    assert engine.num_running() == 0 and not engine.has_active()
    assert sorted(p.request_id for p in partials) == sorted(r.request_id for r in reqs)
    assert all(p.finish_reason == "abort" and len(p.response_ids) < longest for p in partials), \
        f"a request ended before the abort: {[(p.finish_reason, len(p.response_ids)) for p in partials]}"
    assert any(len(p.response_ids) > 0 for p in partials), "no request had sampled a token before the abort"
    push(engine, seed=2)
    by_id = {p.request_id: p for p in partials}
    more = [dataclasses.replace(r, max_tokens=len(by_id[r.request_id].response_ids) + 24) for r in reqs]
    resumed = [by_id[r.request_id].resume(r) for r in more]
    for req, partial, res in zip(resumed, (by_id[r.request_id] for r in reqs), engine.generate(resumed)):
        k = len(partial.response_ids)
        assert res.finish_reason == "length" and len(res.response_ids) == k + 24
        np.testing.assert_array_equal(res.response_ids[:k], partial.response_ids)
        np.testing.assert_array_equal(res.logprobs[:k], partial.logprobs)
        assert (res.versions[:k] == v).all() and (res.versions[k:] == v + 1).all()
        # the tokens after the push are sampled by the new weights on prompt + partial
        np.testing.assert_allclose(res.logprobs[k:], forward_logprobs(TRAINER["model"], req, res)[k:], atol=1e-4)


def test_prefix_cache_is_reset_by_a_push(engine):
    prompt = TOK.encode("abc 123 " * 24)  # 192 tokens: whole KV blocks to reuse
    req = [GenerationRequest("pc", prompt, 4, SamplingParams(seed=1))]

    def hits_during(fn):
        before = prefix_cache_hits(engine)
        fn()
        deadline = time.monotonic() + 5  # metrics are published once per engine iteration
        while prefix_cache_hits(engine) == before and time.monotonic() < deadline:
            time.sleep(0.2)
        return prefix_cache_hits(engine) - before

    engine.generate(req)
    assert hits_during(lambda: engine.generate(req)) > 0  # the same prompt again: served from the cache
    push(engine, seed=3)
    assert hits_during(lambda: engine.generate(req)) == 0  # the push dropped every cached prefix


def test_sleep_refuses_work_until_wake(engine):
    engine.sleep()
    assert engine.asleep
    with pytest.raises(EngineError, match="asleep"):
        engine.submit(requests(n=1, prefix="s"))
    engine.wake()
    assert not engine.asleep
    assert len(engine.generate(requests(n=2, prefix="s"))) == 2


def test_abort_returns_waiting_requests_untouched(engine):
    reqs = [GenerationRequest("later", TOK.encode("12"), 8, SamplingParams(seed=1), ready_at=time.monotonic() + 60)]
    engine.submit(reqs)
    assert engine.num_waiting() == 1 and engine.next_ready_in() > 50
    [res] = engine.abort_all()
    assert res.finish_reason == "abort" and len(res.response_ids) == 0


def test_the_rollout_service_drives_the_engine_across_a_push(engine):
    from conftest import prompt_table
    from rlpipe.engine.state.rollout_service import RolloutService
    from rlpipe.stages.generate import GenerateParams

    # the pushed model is built before the requests start: building it while the server decoded on the same cores
    # took seconds on a loaded CI box, and every request had ended before the push (nothing aborted)
    new = model(4)
    buckets = export_buckets(new)
    # The push must land mid-generation. Pacing it by the server's progress failed under load: the server's API
    # process (metrics, streams, the abort) starves while its engine core decodes on, and every 1500-token
    # request ended before the push arrived (a streaming probe was itself scheduled late). So once the server
    # runs all eight and has sampled tokens for them, the test freezes its scheduler (/pause, mode keep: the
    # requests stay, partial); the push aborts them there, loads and resumes. A try whose requests ended before
    # the freeze is repeated with fresh requests, at most three times.
    for _ in range(3):
        v = engine.version
        svc = RolloutService(engine, TOK)
        try:
            sampled = metric(engine, "vllm:generation_tokens_total")
            svc.submit(prompt_table(TOK, PROMPTS, 3), GenerateParams(n=2, max_tokens=1500, ignore_eos=True), seed=5)
            wait_sent(engine, 2 * len(PROMPTS))
            if scheduled_on_server(engine, 2 * len(PROMPTS), 2 * len(PROMPTS)):
                # a token for each of the 8 on average (one sampled token in all let a loaded server freeze all
                # three tries before most requests had any: every row was then all one version)
                deadline = time.monotonic() + 60
                while (metric(engine, "vllm:generation_tokens_total") < sampled + 2 * len(PROMPTS)
                       and time.monotonic() < deadline):
                    time.sleep(0.02)
                engine.server.request("POST", "/pause?mode=keep&clear_cache=false")
            aborted = svc.push_weights(buckets, v + 1)  # pause (abort_all) -> load_weights -> resume
            TRAINER["model"] = new
            table = svc.collect(min_groups=len(PROMPTS), timeout=120)
        finally:
            svc.shutdown()
        versions = table.column("token_versions").to_pylist()
        if aborted and any(0 < row.count(v) < 1500 for row in versions):
            break
    assert aborted > 0, "in three tries every request ended before the push arrived: nothing was aborted"
    assert table.num_rows == 2 * len(PROMPTS) and engine.version == v + 1
    for row in versions:
        k = row.count(v)
        assert len(row) == 1500 and row == [v] * k + [v + 1] * (1500 - k)
    assert any(0 < row.count(v) < 1500 for row in versions)


def test_stop_token_ids_end_a_response_like_eos(engine):
    """SamplingParams.stop_token_ids (the agents' stop_at_call) reach vLLM: the same seeded response is cut right
    after the first stop token, which it keeps, with finish reason stop."""
    plain = engine.generate(requests(max_tokens=12))
    victim = next(i for i, r in enumerate(plain) if len(r.response_ids) >= 4)
    stop_id = int(plain[victim].response_ids[2])
    cut = engine.generate(requests(max_tokens=12, stop_token_ids=(stop_id,)))
    for a, b in zip(plain, cut):
        ids = a.response_ids.tolist()
        end = ids.index(stop_id) + 1 if stop_id in ids else len(ids)
        assert b.response_ids.tolist() == ids[:end]
        if stop_id in ids:
            assert b.finish_reason == "stop"
    assert len(cut[victim].response_ids) <= 3


def test_a_server_that_cannot_start_names_its_log(tmp_path):
    from rlpipe.inference.vllm_server import VLLMServer

    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match=r"broken: the vLLM server .* exited .*broken-server\.log"):
        VLLMServer(tmp_path / "empty", tmp_path, VLLMParams(startup_timeout_s=300), name="broken")

