"""The engine contract, checked the same way on every engine a rollout replica can run.

Each engine is built exactly as ``RolloutState`` builds it (``build_engine`` with the generate
stage's params): ``embedded`` in-process, ``sglang`` = rlpipe's embedded engine behind SGLang's
protocol in a child process, ``vllm`` = a real vLLM server (when the vLLM environment exists;
``make setup`` makes it; the test run's shared server, tests/conftest.py, attached to). One engine
per module run: server cold starts are the slow part.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from conftest import VLLM_ARCH, VLLM_CHARS
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import export_buckets
from rlpipe.inference.contract import EngineError, GenerationRequest, RolloutEngine, SamplingParams
from rlpipe.inference.engines import EngineInputs, build_engine
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig
from rlpipe.stage import stage_registry

# the shared vLLM server's shapes (tests/conftest.py): head_dim 64, as vLLM's CPU attention needs
TOK = build_tokenizer(TokenizerConfig(chars=VLLM_CHARS))
ARCH = ArchitectureConfig(**VLLM_ARCH)
ENGINES = ["embedded", "sglang", pytest.param("vllm", marks=pytest.mark.vllm)]


def model(seed: int):
    return build_model(ModelConfig(architecture=ARCH), TOK, seed)


def requests(prefix: str, n: int = 6, max_tokens: int = 12, ignore_eos: bool = False):
    sampling = SamplingParams(temperature=1.0, seed=3, ignore_eos=ignore_eos)
    return [GenerationRequest(f"{prefix}/{i}", TOK.encode(f"{i}+{i + 1}="), max_tokens, sampling) for i in range(n)]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tmp_path_factory):
    impl = request.param
    params = stage_registry("generate").get(impl).params_model()
    if impl == "vllm":  # attach to the test run's server (skips where vLLM's venv is missing)
        server = request.getfixturevalue("vllm_server")
        params = params.model_copy(update={"server": params.server.model_copy(update={"urls": [server.url]})})
    workdir = str(tmp_path_factory.mktemp(f"engine-{impl}"))
    eng = build_engine(impl, EngineInputs(model(0), TOK, params, 0, workdir, name=f"test {impl}"))
    yield eng
    eng.close()


def forward_logprobs(m, prompt: list[int], response: np.ndarray) -> np.ndarray:
    """log p(response token | prefix) under ``m`` at temperature 1 (the trainer's computation)."""
    ids = torch.tensor([list(prompt) + response.tolist()])
    with torch.no_grad():
        logits = m.eval()(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.from_numpy(response).long()[:, None])[:, 0].numpy()


def test_generate_returns_each_request_with_logprobs_and_versions_in_order(engine: RolloutEngine):
    reqs = requests("gen")
    results = engine.generate(reqs)
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    for req, res in zip(reqs, results):
        assert 0 < len(res.response_ids) <= req.max_tokens
        assert len(res.logprobs) == len(res.versions) == len(res.response_ids)
        assert (res.versions == engine.version).all() and (res.logprobs <= 0).all()
        assert res.finish_reason in ("stop", "length")
    assert not engine.has_active()


def pacer(engine: RolloutEngine, long: int):
    """A wait that returns while requests of ``long`` tokens just submitted are mid-response.

    A vLLM server decodes by itself and its non-streaming answers come only at the end: a streaming
    probe in the same batch reports its progress (tests/inference/vllm_probe.py). An engine that
    step() drives is paced by its own speed: a fifth of one whole response (the faster of two)."""
    if type(engine).__name__ == "VLLMEngine":
        from vllm_probe import StreamingProbe

        def wait_for_probe(prompt_ids):
            probe = StreamingProbe(engine.server.url, list(prompt_ids), long)
            probe.wait_for(8)  # every request submitted before the probe is mid-response too
        return wait_for_probe
    paces = []
    for k in range(2):
        start = time.monotonic()
        engine.generate(requests(f"pace{k}", n=1, max_tokens=long, ignore_eos=True))
        paces.append(time.monotonic() - start)

    def wait_a_fifth(prompt_ids):
        deadline = time.monotonic() + min(paces) / 5
        while time.monotonic() < deadline:  # step() drives an in-process engine
            assert engine.step() == []
    return wait_a_fifth


def test_a_push_mid_generation_aborts_loads_and_resumes_with_both_versions(engine: RolloutEngine):
    # The abort must land mid-response whatever the machine's load. vLLM decodes 1000 tokens of this model for four
    # requests in ~2.5 s on an idle machine; on a loaded CI box its engine core decoded all of them before the
    # abort arrived (its HTTP front end, which streams the probe and takes the abort, was starved), and under two
    # extra busy processes even 3000 tokens ended first. So vLLM's responses may be 30000 tokens (minutes of
    # decoding); the resume then asks for only ``more`` tokens past the partial, which keeps the test short.
    long = 30000 if type(engine).__name__ == "VLLMEngine" else 120
    more = 40
    reqs = requests("push", n=4, max_tokens=long, ignore_eos=True)
    before = engine.version
    # built before the requests start: building a model while a server decodes on the same cores took up to 2.3 s
    new = model(1)
    buckets = export_buckets(new)
    wait_until_mid_response = pacer(engine, long)
    engine.submit(reqs)
    wait_until_mid_response(reqs[0].prompt_ids)
    assert engine.num_running() == len(reqs), (
        f"only {engine.num_running()} of {len(reqs)} requests still run: "
        f"{[(r.request_id, r.finish_reason, len(r.response_ids)) for r in engine.step()]}")
    with pytest.raises(EngineError, match="in flight"):
        engine.load_weights(buckets, before + 1)
    partials = {r.request_id: r for r in engine.abort_all()}
    assert set(partials) == {r.request_id for r in reqs} and not engine.has_active()
    ends = {rid: (p.finish_reason, len(p.response_ids)) for rid, p in partials.items()}
    assert all(reason == "abort" and n < long for reason, n in ends.values()), ends
    assert any(len(p.response_ids) > 0 for p in partials.values()), "no request made a token before the abort"

    timings = engine.load_weights(buckets, before + 1)
    assert engine.version == before + 1 and all(isinstance(v, float) and v >= 0 for v in timings.values())

    wanted = {r.request_id: len(partials[r.request_id].response_ids) + more for r in reqs}
    resumed = engine.generate([dataclasses.replace(partials[r.request_id].resume(r), max_tokens=wanted[r.request_id])
                               for r in reqs])
    for req, res in zip(reqs, resumed):
        k = len(partials[req.request_id].response_ids)
        assert len(res.response_ids) == k + more and res.finish_reason == "length"
        np.testing.assert_array_equal(res.response_ids[:k], partials[req.request_id].response_ids)
        assert (res.versions[:k] == before).all() and (res.versions[k:] == before + 1).all()
        # the new tokens' logprobs are the pushed model's: the weights really arrived
        np.testing.assert_allclose(res.logprobs[k:], forward_logprobs(new, req.prompt_ids, res.response_ids)[k:],
                                   atol=1e-4)


def test_sleep_wake_and_health(engine: RolloutEngine):
    engine.sleep()
    assert engine.asleep
    engine.wake()
    assert not engine.asleep
    assert engine.health()["version"] == engine.version
    assert len(engine.generate(requests("awake", n=2))) == 2
