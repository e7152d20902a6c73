"""LoRA adapters pushed to a real vLLM 0.32 server (rlpipe.inference.vllm_lora): the session's shared server
(tests/conftest.py ``vllm_server``, started with ``--enable-lora`` and 2 adapter slots, as separate_async with
max_off_policy_threshold 1 asks, so that no test pays a cold start of its own for LoRA), attached to as a run
attaches (``build_vllm_engine`` with ``lora`` and ``server.urls``: the base pushed once, then adapters). That rlpipe
starts its own servers with the LoRA flags: test_vllm_lora.py (the command line, without a server).

- an adapter push changes what vLLM serves exactly as the merged weights would: its logprobs equal a transformers
  forward of the trainer's LoRA model (W0 + scale·B·A) to 1e-4 — both float32, vLLM adding x·Aᵀ·Bᵀ beside x·W0ᵀ
  where the trainer does the same sums in another order, so the gap is float32 rounding (~1e-6 seen), and 1e-4 is
  the bound the full-push vLLM tests use; the base's logprobs differ from them by far more;
- requests sent before a push finish on the adapter they started with (tokens stamped with its version, logprobs of
  that version's model) while requests sent after it run on the new one; the old adapter is unloaded once unused;
- abort → push → resume (partial rollout): the tokens before the push keep the old version, those after carry the
  new one, each with its own model's logprobs;
- a short LoRA run (sync, inline, the one-digit task) attached to the same server learns, and its pushes report
  adapter bytes next to the full model's.
The slot count `validate` asks for, the folders and the bookkeeping without a server: test_vllm_lora.py.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from rlpipe.backends.lora import apply_lora, is_adapter
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import pack_buckets
from rlpipe.inference.contract import EngineError, GenerationRequest, SamplingParams
from rlpipe.inference.vllm_build import build_vllm_engine
from rlpipe.inference.vllm_engine import VLLMParams
from rlpipe.modes.separate_async import SeparateAsyncParams
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig
from rlpipe.schemas.lora import LoRAConfig
from conftest import VLLM_ARCH, VLLM_CHARS
from vllm_runs import ONE_DIGIT, ROOT, learns

pytestmark = [pytest.mark.vllm]

# the shared server's shapes
TOK = build_tokenizer(TokenizerConfig(chars=VLLM_CHARS))
ARCH = ArchitectureConfig(**VLLM_ARCH)
LORA = LoRAConfig(rank=8, alpha=16)
PROMPTS = ["12=", "7=", "305=", "9981="]
TOLERANCE = 1e-4  # see the module docstring
LEARNING_STEPS = 15
MIN_RISE = 0.25  # reward/mean, first fifth → last fifth; the embedded engine's LoRA run rises 0.16 → 0.66 (seeds 0-3:
# ≥ 0.27 in 12 steps); a run whose adapters never reached the server stays at the base's ~0.1


def base_model():
    return build_model(ModelConfig(architecture=ARCH), TOK, 0).eval()


@pytest.fixture(scope="module")
def engine(vllm_server, tmp_path_factory):
    eng = build_vllm_engine(base_model(), TOK, VLLMParams(urls=[vllm_server.url], request_timeout_s=120), rank=0,
                            workdir=tmp_path_factory.mktemp("vllm-lora"), lora=LORA,
                            mode_params=SeparateAsyncParams(max_off_policy_threshold=1))
    yield eng
    eng.close()


def trainer_model(seed):
    """The trainer's side: the base with adapters whose B is random (not zero), so a push visibly changes things."""
    model = base_model()
    apply_lora(model, LORA, seed)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.3)
    return model


def push(engine, model, version):
    adapters = [(n, p.detach()) for n, p in model.named_parameters() if is_adapter(n)]
    return engine.load_weights(pack_buckets(adapters, bucket_bytes=16 << 10), version)


def requests(prefix, n=8, max_tokens=12, temperature=1.0):
    sampling = SamplingParams(seed=5, temperature=temperature, ignore_eos=True)
    return [GenerationRequest(f"{prefix}{i}", TOK.encode(PROMPTS[i % len(PROMPTS)]), max_tokens, sampling)
            for i in range(n)]


def collect(engine, n, timeout=120.0):
    done, deadline = {}, time.monotonic() + timeout
    while len(done) < n:
        assert time.monotonic() < deadline, f"{len(done)} of {n} requests finished in {timeout} s"
        done.update((r.request_id, r) for r in engine.step())
    return done


def forward_logprobs(model, request, response_ids):
    """Log-softmax (temperature 1) of ``model`` at each response token: the trainer's view of the policy."""
    ids = torch.tensor([list(request.prompt_ids) + [int(t) for t in response_ids]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    p = len(request.prompt_ids)
    return logp[p - 1:-1].gather(1, torch.as_tensor(np.asarray(response_ids, np.int64))[:, None])[:, 0].numpy()


def adapter_names(engine):
    """The adapters the server holds (rlpipe's are named ``rlpipe-<tag>-v<version>``)."""
    return {m["id"] for m in engine.server.request("GET", "/v1/models")["data"] if m["id"].startswith("rlpipe-")}


def test_the_server_serves_a_pushed_adapter_as_the_merged_weights_would(engine, vllm_server):
    assert "--enable-lora" in vllm_server.command() and engine.adapters.slots == 2
    trainer = trainer_model(1)
    timings = push(engine, trainer, 1)
    adapter_bytes = sum(p.numel() * 4 for n, p in trainer.named_parameters() if is_adapter(n))
    assert timings["bytes"] >= adapter_bytes and timings["cache_reset_s"] == 0.0
    reqs = requests("a")
    results = engine.generate(reqs)
    base, gap = base_model(), 0.0
    for request, result in zip(reqs, results):
        assert (result.versions == 1).all() and len(result.response_ids) == 12
        np.testing.assert_allclose(result.logprobs, forward_logprobs(trainer, request, result.response_ids),
                                   atol=TOLERANCE)
        gap = max(gap, float(np.abs(result.logprobs - forward_logprobs(base, request, result.response_ids)).max()))
    assert gap > 0.05, f"the adapter barely changed the policy (largest logprob change {gap})"
    assert adapter_names(engine) == {engine.adapters.name(1)}


def test_requests_started_before_a_push_finish_on_their_adapter(engine):
    old, new = trainer_model(2), trainer_model(3)
    push(engine, old, 2)
    before = requests("old", n=16, max_tokens=56)
    engine.submit(before)
    in_flight = engine.num_running()
    push(engine, new, 3)  # taken with requests in flight: they keep adapter 2
    assert in_flight > 0
    after = requests("new", n=4)
    engine.submit(after)
    done = collect(engine, len(before) + len(after))
    for request in before:
        result = done[request.request_id]
        assert (result.versions == 2).all(), result.versions
        np.testing.assert_allclose(result.logprobs, forward_logprobs(old, request, result.response_ids),
                                   atol=TOLERANCE)
    for request in after:
        result = done[request.request_id]
        assert (result.versions == 3).all()
        np.testing.assert_allclose(result.logprobs, forward_logprobs(new, request, result.response_ids),
                                   atol=TOLERANCE)
    # version 2's requests are over: it was unloaded (by the pool thread that finished its last one) and its folder
    assert adapter_names(engine) == {engine.adapters.name(3)}
    assert sorted(p.name for p in engine.adapters.root.iterdir()) == ["v3"]


def test_abort_push_resume_switches_versions_at_the_push(engine):
    old, new = trainer_model(4), trainer_model(5)
    push(engine, old, 4)
    reqs = requests("p", max_tokens=56)
    engine.submit(reqs)
    time.sleep(0.05)  # let some tokens come (a partial with none still resumes correctly)
    partials = {r.request_id: r for r in engine.abort_all()}
    with pytest.raises(EngineError, match="versions only grow"):
        push(engine, new, 3)
    push(engine, new, 5)
    resumed = [partials[r.request_id].resume(r) for r in reqs]
    engine.submit(resumed)
    done = collect(engine, len(reqs))
    for request in reqs:
        result, cut = done[request.request_id], len(partials[request.request_id].response_ids)
        assert len(result.response_ids) == 56
        assert (result.versions[:cut] == 4).all() and (result.versions[cut:] == 5).all()
        np.testing.assert_allclose(result.logprobs[:cut], forward_logprobs(old, request, result.response_ids)[:cut],
                                   atol=TOLERANCE)
        np.testing.assert_allclose(result.logprobs[cut:], forward_logprobs(new, request, result.response_ids)[cut:],
                                   atol=TOLERANCE)


def test_a_lora_run_attached_to_the_server_learns_and_reports_adapter_bytes(engine, tmp_path):
    from rlpipe.engine.planning.config_io import load_pipeline
    from rlpipe.engine.runtime import run_pipeline

    # temperature 0.25 and lr 5e-3 as pipelines/quickstart_lora.yaml (its header says why)
    config, text = load_pipeline(ROOT / "pipelines/quickstart_vllm.yaml", [
        *ONE_DIGIT, f"trainer.total_steps={LEARNING_STEPS}", f"trainer.output_dir={tmp_path}", "name=vllm-lora",
        "trainer.lora={rank: 8}", "trainer.optimizer.lr=5e-3", "stages.generate.params.temperature=0.25",
        f"tokenizer.chars={json.dumps(VLLM_CHARS)}",
        f"model.architecture={json.dumps({'family': 'qwen2', **VLLM_ARCH})}",
        f"stages.generate.params.server.urls=[{engine.server.url}]"])
    rewards, pushes = [], []

    def on_step(step, metrics):
        rewards.append(metrics["reward/mean"])
        pushes.append((metrics["weight_sync/bytes"], metrics["weight_sync/full_model_bytes"],
                       metrics["weight_sync/push_s"]))

    run_pipeline(config, text, inline=True, on_step=on_step)
    first, last = learns(rewards)
    assert last - first >= MIN_RISE, f"reward/mean first fifth {first:.3f}, last fifth {last:.3f}: {rewards}"
    sent, full, seconds = pushes[-1]
    assert 0 < sent < 0.5 * full and seconds > 0, pushes[-1]
    assert adapter_names(engine) == {engine.adapters.name(5)}  # the run's engine unloaded its adapters at its end
