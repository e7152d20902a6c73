"""The SGLang client against rlpipe's embedded engine behind SGLang's protocol: real HTTP, real torch models.

Most tests serve the engine from a thread of this process (SGLangFace); the last
ones launch it as a child process the way ``server: embedded`` does.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest
from pydantic import ValidationError

from rlpipe.backends.model import build_model, save_hf_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import export_buckets
from rlpipe.inference import json_http
from rlpipe.inference.contract import EngineError, GenerationRequest, SamplingParams
from rlpipe.inference.embedded import EmbeddedEngine
from rlpipe.inference.sglang_engine import SGLangEngine, SGLangParams
from rlpipe.inference.sglang_server import SGLangFace
from rlpipe.inference.sglang_wire import shm_dir
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig

TOK = build_tokenizer(TokenizerConfig(chars="abcdefgh 0123456789+="))
PROMPTS = ["1+2=", "abc de", "9", "h 77 + 1 ="]


def model(seed=0, positions=512, hidden=32):
    arch = ArchitectureConfig(hidden_size=hidden, num_layers=2, num_heads=4, intermediate_size=64,
                              max_position_embeddings=positions)
    return build_model(ModelConfig(architecture=arch), TOK, seed)


def requests(n=8, max_tokens=16, seed=7, prefix="r", **sampling_kw):
    params = SamplingParams(seed=seed, **sampling_kw)
    return [GenerationRequest(f"{prefix}{i}", TOK.encode(PROMPTS[i % len(PROMPTS)]), max_tokens, params)
            for i in range(n)]


def direct(reqs, seed=0):
    """The same requests on an EmbeddedEngine called in-process (the reference)."""
    return EmbeddedEngine(model(seed), TOK).generate(reqs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_hf_model(model(0), TOK, tmp_path_factory.mktemp("sglang-model") / "tiny"))


@pytest.fixture
def served(model_dir):
    """(client, face): an in-thread server of model(0) and a client connected to it."""
    face = SGLangFace(EmbeddedEngine(model(0), TOK), model_path=model_dir).start()
    client = SGLangEngine(SGLangParams(url=face.url, model_path=model_dir, control_timeout_s=10,
                                       request_timeout_s=60))
    yield client, face
    client.close()
    face.close()


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.request_id == w.request_id and g.finish_reason == w.finish_reason
        np.testing.assert_array_equal(g.response_ids, w.response_ids)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        np.testing.assert_array_equal(g.versions, w.versions)


def test_generate_over_http_equals_the_embedded_engine(served):
    client, face = served
    reqs = requests(top_k=5, top_p=0.9, temperature=0.8)
    got = client.generate(reqs)
    assert_same(got, direct(reqs))
    assert all(len(r.logprobs) == len(r.response_ids) > 0 and (r.logprobs <= 0).all() for r in got)
    info = client.health()
    assert info["weight_version"] == "0" and info["running"] == 0


@pytest.mark.parametrize("transport", ["shm", "inline", "disk"])
def test_weight_push_loads_the_new_model_and_stamps_its_version(served, transport):
    client, face = served
    client.params = client.params.model_copy(update={"weight_transport": transport})
    timings = client.load_weights(export_buckets(model(1)), version=3)
    assert set(timings) == {"transport_s", "load_s", "cache_reset_s", "bytes"} and timings["bytes"] > 0
    assert client.version == 3 and client.health()["weight_version"] == "3"
    reqs = requests(n=4)
    got = client.generate(reqs)
    want = direct(reqs, seed=1)
    for w in want:
        w.versions[:] = 3
    assert_same(got, want)
    assert not [f for f in os.listdir(shm_dir()) if f.startswith("rlpipe-weights-")], "bucket files left behind"


def test_abort_returns_partials_and_resume_continues_across_a_push(served):
    client, face = served
    reqs = requests(n=4, max_tokens=400, ignore_eos=True)
    client.submit(reqs)
    time.sleep(0.3)
    partials = {r.request_id: r for r in client.abort_all()}
    assert set(partials) == {r.request_id for r in reqs}
    assert all(p.finish_reason == "abort" and len(p.response_ids) < 400 for p in partials.values())
    assert sum(len(p.response_ids) for p in partials.values()) > 0, "abort came before any token was sampled"
    assert client.num_running() == 0 and not client.has_active()

    # same weights: the resumed trajectory is the uninterrupted one (counter-based RNG, resume offset sent)
    first = reqs[0]
    resumed = client.generate([partials[first.request_id].resume(first)])[0]
    assert_same([resumed], direct([first]))

    # a push between abort and resume: old tokens keep version 0, new ones carry 1
    client.load_weights(export_buckets(model(1)), version=1)
    rest = [partials[r.request_id].resume(r) for r in reqs[1:]]
    got = client.generate(rest)
    reference = EmbeddedEngine(model(1), TOK, version=1).generate(rest)
    assert_same(got, reference)
    for g, r in zip(got, rest):
        k = len(r.response_ids)
        assert len(g.response_ids) == 400 and g.finish_reason == "length"
        assert (g.versions[:k] == 0).all() and (g.versions[k:] == 1).all()


def test_pause_holds_requests_until_continue_and_flush_waits_for_them(served):
    client, face = served
    client.pause_generation("in_place")
    client.submit(requests(n=2))
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        assert client.step() == []
    with pytest.raises(EngineError, match=r"/flush_cache answered 400: 2 request\(s\) running"):
        client.reset_prefix_cache()
    client.continue_generation()
    got = []
    while len(got) < 2:
        got += client.step()
    assert sorted(r.request_id for r in got) == ["r0", "r1"]
    client.reset_prefix_cache()


def test_load_weights_and_sleep_are_refused_while_requests_run(served):
    client, face = served
    client.pause_generation("in_place")
    client.submit(requests(n=1))
    with pytest.raises(EngineError, match="in flight"):
        client.load_weights(export_buckets(model(1)), version=1)
    with pytest.raises(EngineError, match="before sleep"):
        client.sleep()
    client.continue_generation()
    assert [r.finish_reason for r in client.abort_all()] in (["abort"], ["length"], ["stop"])


def test_sleep_and_wake_release_and_resume_memory(served):
    client, face = served
    client.sleep()
    assert client.asleep and face.engine.asleep
    with pytest.raises(EngineError, match="asleep"):
        client.submit(requests(n=1))
    client.wake()
    assert not face.engine.asleep
    client.generate(requests(n=1))

    client.sleep(discard_weights=True)
    client.wake()
    with pytest.raises(EngineError, match=r"/generate answered 400: .*weights were discarded"):
        client.generate(requests(n=1))
    client.load_weights(export_buckets(model(0)), version=1)
    got = client.generate(requests(n=2))
    want = direct(requests(n=2))
    for w in want:
        w.versions[:] = 1
    assert_same(got, want)


def test_server_errors_surface_as_engine_errors_naming_the_endpoint(served):
    client, face = served
    with pytest.raises(EngineError, match=r"/generate answered 400: greedy decoding"):
        client.generate(requests(n=1, temperature=0.0))
    with pytest.raises(EngineError, match=r"/update_weights_from_tensor answered 400: weight .* pushed float32\[.*\]"):
        client.load_weights(export_buckets(model(0, hidden=16)), version=1)
    assert client.version == 0
    with pytest.raises(EngineError, match="already in flight"):
        client.submit(requests(n=1) + requests(n=1))
    with pytest.raises(EngineError, match=r"/generate answered 400: /generate field 'stream' is not supported"):
        json_http.call(face.url, "/generate", {"input_ids": [1, 2], "stream": True}, timeout=5)
    with pytest.raises(EngineError, match=r"/update_weights_from_tensor answered 400: load_format None is not read"):
        json_http.call(face.url, "/update_weights_from_tensor", {"serialized_named_tensors": []}, timeout=5)
    with pytest.raises(EngineError, match=r"/v1/completions answered 404: Not Found"):
        json_http.call(face.url, "/v1/completions", {}, timeout=5)
    face.close()
    with pytest.raises(EngineError, match=r"SGLang server http://127.0.0.1:\d+/health_generate did not answer .*running"):
        client.health()


def test_params_say_what_to_set():
    with pytest.raises(EngineError, match="set `url`"):
        SGLangEngine(SGLangParams())  # rlpipe's replicas fill model_path (build_sglang_engine); alone, say it
    with pytest.raises(ValidationError, match="use weight_transport: disk with server: sglang"):
        SGLangParams(server="sglang", model_path="/models/tiny")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        SGLangParams(url="http://127.0.0.1:1", timeout=3)


def test_ready_at_holds_a_request_in_the_client(served):
    client, face = served
    start = time.monotonic()
    req = requests(n=1)[0]
    late = GenerationRequest(**{**req.__dict__, "ready_at": start + 0.3})
    assert client.next_ready_in() == float("inf")
    client.submit([late])
    assert client.num_waiting() == 1 and 0 < client.next_ready_in() <= 0.3
    got = []
    while not got:
        got = client.step()
    assert time.monotonic() - start >= 0.3
    assert_same(got, direct([req]))


def test_the_rollout_service_drives_the_client_through_a_push(served):
    from conftest import prompt_table

    from rlpipe.engine.state.rollout_service import RolloutService
    from rlpipe.stages.generate import GenerateParams

    client, face = served
    svc = RolloutService(client, TOK)
    try:
        svc.submit(prompt_table(TOK, PROMPTS, 3, "p"), GenerateParams(n=2, max_tokens=200, ignore_eos=True), 11)
        deadline = time.monotonic() + 60  # the push must find all eight in flight (the service submits on its thread)
        while client.num_running() < 8:
            assert time.monotonic() < deadline, f"{client.num_running()} of 8 requests sent in 60 s"
            time.sleep(0.005)
        svc.push_weights(export_buckets(model(1)), version=1)
        table = svc.collect(min_groups=4, timeout=30)
        stats = svc.stats()
    finally:
        svc.shutdown()
    assert table.num_rows == 8 and client.version == 1
    assert stats["requests_aborted"] == stats["requests_resumed"] == 8
    for versions, ids in zip(table.column("token_versions").to_pylist(), table.column("response_ids").to_pylist()):
        assert len(versions) == len(ids) == 200 and versions == sorted(versions) and set(versions) <= {0, 1}
    assert any(0 in v and 1 in v for v in table.column("token_versions").to_pylist())


@pytest.mark.slow
def test_launched_server_generates_then_dies_loudly_and_leaves_no_process(model_dir, tmp_path):
    params = SGLangParams(model_path=model_dir, log_dir=str(tmp_path), startup_timeout_s=120,
                          control_timeout_s=5, launch_args=["--num-threads", "1"])
    client = SGLangEngine(params)
    proc = client.server_process
    try:
        reqs = requests(n=4)
        assert_same(client.generate(reqs), direct(reqs))
        client.submit(requests(n=2, max_tokens=400, ignore_eos=True, prefix="long"))
        threading.Timer(0.2, os.kill, (proc.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"/generate did not answer .*see its log"):
            while time.monotonic() - start < 30:
                client.step()
        assert time.monotonic() - start < 10
    finally:
        client.close()
        client.close()  # idempotent
    assert proc.process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


def test_a_server_that_cannot_start_names_its_log(tmp_path):
    params = SGLangParams(model_path=str(tmp_path / "missing"), log_dir=str(tmp_path), startup_timeout_s=60)
    with pytest.raises(EngineError, match=r"exited with code \d+ before answering /health; see its log .*\.log"):
        SGLangEngine(params)


def _dead(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie nobody reaped yet is dead too
    except FileNotFoundError:
        return True


def test_the_server_dies_with_the_process_that_launched_it(model_dir, tmp_path):
    import subprocess
    import sys

    launcher = (
        "import sys, time\n"
        "from rlpipe.inference import sglang_launch as L\n"
        f"p = L.ServerProcess(L.embedded_command({model_dir!r}, L.free_port(), '0'), 'http://x', {str(tmp_path / 'log')!r})\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert not _dead(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while not _dead(child):
        assert time.monotonic() < deadline, f"server {child} outlived its launcher"
        time.sleep(0.05)
