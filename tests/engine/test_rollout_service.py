"""The continuous rollout service: complete groups, equality with the sync stage, partial rollout at a push."""

import threading
import time

import pyarrow as pa
import pytest
import torch

from rlpipe.inference.embedded import EmbeddedEngine, EngineError, GenerationRequest, SamplingParams
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import export_buckets
from rlpipe.engine.state.roles import RolloutState
from rlpipe.engine.state.rollout_service import RolloutService, RolloutServiceError
from rlpipe.errors import BatchError
from rlpipe.jagged import SequenceInputs, to_padded
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, PipelineConfig, TokenizerConfig
from rlpipe.stage import StageContext
from rlpipe.stages.generate import GenerateParams, generate, generation_seed

from conftest import prompt_table, quickstart_raw

TOK = build_tokenizer(TokenizerConfig(chars="abcdefgh 0123456789+="))
TEXTS = ("1+2=", "abc", "h 7 + 10 =", "88", "d e f")
CTX = StageContext(step=3, seed=11)
SEED = generation_seed(CTX)


def model(seed=0):
    arch = ArchitectureConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
    return build_model(ModelConfig(architecture=arch), TOK, seed)


def prompts(texts=TEXTS, prefix="p") -> pa.Table:
    return prompt_table(TOK, texts, 3, prefix)


class GatedEngine(EmbeddedEngine):
    """An engine that decodes only as many steps as the test allows (other steps return nothing)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.allowed = 0
        self.real_steps = 0

    def step(self):
        if self.allowed is not None and self.real_steps >= self.allowed:
            time.sleep(0.001)
            return []
        self.real_steps += 1
        return super().step()


@pytest.fixture
def service():
    services = []

    def make(engine=None, **kw):
        svc = RolloutService(engine or EmbeddedEngine(model(), TOK, **kw), TOK)
        services.append(svc)
        return svc

    yield make
    for svc in services:
        svc.shutdown()


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def forward_logprobs(m, table: pa.Table) -> torch.Tensor:
    seq = SequenceInputs(table.column("prompt_ids"), table.column("response_ids"), TOK.pad_token_id)
    with torch.no_grad():
        logits = m(input_ids=seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids).logits
    return seq.response_logprobs(logits)


def test_rows_equal_the_sync_generate_stage_bit_for_bit(service):
    params = GenerateParams(n=4, max_tokens=12, temperature=0.9, top_k=8)
    sync = generate(type("W", (), {"engine": EmbeddedEngine(model(), TOK, version=2), "tokenizer": TOK})(),
                    prompts(), params, CTX).table
    svc = service(version=2)
    assert svc.submit(prompts(), params.model_dump(), SEED) == 20  # params as a dict, as modes send them
    table = svc.collect(min_groups=5, timeout=20)
    assert table.schema == sync.schema
    assert table.equals(sync)  # same ids, logprobs, versions, text, statuses, order
    stats = svc.stats()
    lens = [len(x) for x in table.column("response_ids").to_pylist()]
    assert stats["tokens_generated"] == sum(lens)
    assert (stats["requests_submitted"], stats["requests_finished"], stats["groups_collected"]) == (20, 20, 5)
    assert stats["requests_aborted"] == stats["requests_resumed"] == 0
    assert stats["running_requests"] == stats["groups_in_flight"] == stats["groups_ready"] == 0
    assert stats["busy_s"] > 0
    # idle: the loop sleeps on its condition variable, it does not spin
    time.sleep(0.1)
    later = svc.stats()
    assert later["steps"] == stats["steps"] and later["busy_s"] == stats["busy_s"]
    assert later["idle_s"] >= stats["idle_s"] + 0.09


class CountingEngine(EmbeddedEngine):
    """Records the requests each step decodes (as the service counts them: running, not waiting)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decoded: list[int] = []

    def step(self):
        self.decoded.append(self.num_running() - self.num_waiting())
        return super().step()


def test_an_in_process_engine_s_decode_iterations_are_summed_for_the_simulator(service):
    """The sums rlpipe simulate fits an iteration's cost on: per engine step 1, k, k², t, k·t and the loop's CPU
    time, with k the requests it decoded; a server client (steps are waits, not iterations) reports none."""
    engine = CountingEngine(model(), TOK)
    svc = service(engine)
    svc.submit(prompts(), GenerateParams(n=3, max_tokens=10, min_tokens=2, length_distribution="pareto",
                                         ignore_eos=True), SEED)
    svc.collect(min_groups=5, timeout=20)
    stats, k = svc.stats(), engine.decoded
    assert len(set(k)) > 1  # the long tail: the batch shrinks as requests finish
    assert stats["decode_steps"] == len(k) == stats["steps"]
    assert stats["decode_tokens"] == sum(k) == stats["tokens_generated"]
    assert stats["decode_tokens_sq"] == sum(x * x for x in k)
    assert 0 < stats["decode_s"] <= stats["busy_s"] + 1e-6  # the engine steps only, inside the busy phases
    assert min(k) * stats["decode_s"] <= stats["decode_token_s"] <= max(k) * stats["decode_s"]
    assert 0 < stats["decode_cpu_s"] <= stats["decode_s"] * 1.05  # the loop's own thread: at most its wall time

    class Client(EmbeddedEngine):
        decodes_in_process = False

    other = service(Client(model(), TOK))
    other.submit(prompts(), GenerateParams(n=1, max_tokens=3), SEED)
    other.collect(min_groups=5, timeout=20)
    assert not any(key.startswith("decode_") for key in other.stats())


def test_only_complete_groups_are_collected(service):
    engine = GatedEngine(model(), TOK)
    svc = service(engine)
    params = GenerateParams(n=6, max_tokens=30)
    svc.submit(prompts(), params, SEED)
    complete_seen = partial_seen = False
    for steps in range(1, 31):
        engine.allowed = steps  # every sample finishes by step 30 (max_tokens)
        wait_for(lambda: engine.real_steps == steps)
        # filed once the loop counted two more (gated, empty) steps, or once nothing is left to step
        filed = svc.stats()["steps"] + 2
        wait_for(lambda: svc.stats()["steps"] >= filed or svc.stats()["groups_in_flight"] == 0)
        s = svc.stats()
        partial_seen |= s["finished_waiting_for_group"] > 0
        table = svc.collect()
        counts = {}
        for uid in table.column("uid").to_pylist():
            counts[uid] = counts.get(uid, 0) + 1
        assert set(counts.values()) <= {6}  # whole groups only, never a partial one
        assert table.column("sample_index").to_pylist() == list(range(6)) * len(counts)
        complete_seen |= bool(counts)
        if svc.stats()["groups_in_flight"] == 0:
            break
    assert complete_seen and partial_seen
    assert svc.stats()["groups_collected"] == 5 and svc.collect().num_rows == 0


def test_pause_push_resume_switches_versions_exactly_at_the_push(service):
    old, new = model(0), model(1)
    engine = GatedEngine(model(0), TOK, version=3)
    svc = service(engine)
    params = GenerateParams(n=4, max_tokens=24)
    svc.submit(prompts(), params, SEED)
    k = 5
    engine.allowed = k
    wait_for(lambda: engine.real_steps == k)
    aborted = svc.pause()
    assert aborted > 0 and svc.stats()["aborted_requests"] == aborted and svc.stats()["running_requests"] == 0
    engine.load_weights(export_buckets(new), version=4)  # what RolloutState.load_weights does between the two
    engine.allowed = None
    assert svc.resume() == aborted
    table = svc.collect(min_groups=5, timeout=20)
    assert table.num_rows == 20

    versions = table.column("token_versions").to_pylist()
    switched = [len(v) > k for v in versions]
    assert sum(switched) == aborted
    for v, moved in zip(versions, switched):
        assert v == ([3] * k + [4] * (len(v) - k) if moved else [3] * len(v))

    # logprobs before the switch are the old weights', after it the new weights' (prefix re-prefilled)
    got = to_padded(table.column("rollout_logprobs"), 0.0, torch.float32)
    before, after = forward_logprobs(old, table), forward_logprobs(new, table)
    mask = to_padded(table.column("token_versions"), -1, torch.long)
    assert torch.allclose(got[mask == 3], before[mask == 3], atol=1e-5)
    assert torch.allclose(got[mask == 4], after[mask == 4], atol=1e-5)

    # the old part is what the old weights alone sample; the new part is what the new weights sample
    # when given that prefix (same streams: seed, id, position)
    sync = generate(type("W", (), {"engine": EmbeddedEngine(model(0), TOK), "tokenizer": TOK})(),
                    prompts(), params, CTX).table.column("response_ids").to_pylist()
    rows = table.to_pylist()
    for row, reference in zip(rows, sync):
        assert row["response_ids"][:k] == reference[:k]
    moved_rows = [r for r, m in zip(rows, switched) if m]
    sampling = SamplingParams(temperature=1.0, seed=SEED)
    resumed = [  # the aborted partials: their first k tokens, logprobs and versions
        GenerationRequest(f"{r['uid']}/{r['sample_index']}", r["prompt_ids"], 24, sampling,
                          r["response_ids"][:k], r["rollout_logprobs"][:k], r["token_versions"][:k])
        for r in moved_rows
    ]
    direct = EmbeddedEngine(model(1), TOK, version=4).generate(resumed)
    for row, d in zip(moved_rows, direct):
        assert row["response_ids"] == d.response_ids.tolist()

    s = svc.stats()
    assert (s["requests_aborted"], s["requests_resumed"], s["version"]) == (aborted, aborted, 4)
    assert s["paused_s"] > 0


def test_pause_and_resume_without_a_push_changes_no_token(service):
    params = GenerateParams(n=3, max_tokens=20)
    engine = GatedEngine(model(), TOK)
    svc = service(engine)
    svc.submit(prompts(), params, SEED)
    engine.allowed = 4
    wait_for(lambda: engine.real_steps == 4)
    assert svc.pause() > 0 and svc.pause() == 0  # a second pause is a no-op
    engine.allowed = None
    svc.resume()
    table = svc.collect(min_groups=5, timeout=20)
    sync = generate(type("W", (), {"engine": EmbeddedEngine(model(), TOK), "tokenizer": TOK})(),
                    prompts(), params, CTX).table
    assert table.column("response_ids").equals(sync.column("response_ids"))
    got, want = (to_padded(t.column("rollout_logprobs"), 0.0, torch.float32) for t in (table, sync))
    assert torch.allclose(got, want, atol=1e-5)


def test_push_weights_is_pause_load_resume(service):
    svc = service()
    svc.submit(prompts(), GenerateParams(n=2, max_tokens=40), SEED)
    svc.push_weights(export_buckets(model(1)), version=1)
    assert not svc.paused
    svc.submit(prompts(prefix="q"), GenerateParams(n=2, max_tokens=40), SEED)
    if svc.stats()["running_requests"]:
        with pytest.raises(EngineError, match="pause\\(\\) the rollout service"):
            svc.load_weights(export_buckets(model(2)), version=2)
    table = svc.collect(min_groups=10, timeout=20)
    assert table.num_rows == 20
    for uid, v in zip(table.column("uid").to_pylist(), table.column("token_versions").to_pylist()):
        assert v == sorted(v) and set(v) <= ({0, 1} if uid.startswith("p") else {1})


def test_blocking_collect_with_timeout(service):
    svc = service()
    svc.pause()  # nothing steps: submitted groups wait
    svc.submit(prompts(), GenerateParams(n=2, max_tokens=8), SEED)
    start = time.monotonic()
    table = svc.collect(min_groups=1, timeout=0.2)
    assert table.num_rows == 0 and 0.19 <= time.monotonic() - start < 2
    assert svc.stats()["queued_requests"] == 10

    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("t", svc.collect(min_groups=5, timeout=20)))
    reader.start()
    time.sleep(0.05)
    assert reader.is_alive()  # blocked on the condition variable
    svc.resume()
    reader.join(20)
    assert got["t"].num_rows == 10
    # fewer groups than asked remain in the service: no wait
    start = time.monotonic()
    assert svc.collect(min_groups=3).num_rows == 0 and time.monotonic() - start < 1


def test_max_groups_takes_the_earliest_submitted(service):
    svc = service()
    svc.submit(prompts(), GenerateParams(n=2, max_tokens=8), SEED)
    first = svc.collect(min_groups=5, timeout=20, max_groups=2)
    assert first.column("uid").to_pylist() == ["p0", "p0", "p1", "p1"]
    assert svc.collect(min_groups=3, timeout=20).column("uid").to_pylist() == ["p2", "p2", "p3", "p3", "p4", "p4"]


def test_drop_forgets_queued_and_running_groups(service):
    svc = service()
    svc.pause()
    svc.submit(prompts(), GenerateParams(n=3, max_tokens=16), SEED)
    assert svc.drop(["p1", "nope"]) == 1
    svc.resume()
    assert svc.drop(["p3"]) == 1  # in the engine: runs out, results discarded
    table = svc.collect(min_groups=3, timeout=20)
    assert sorted(set(table.column("uid").to_pylist())) == ["p0", "p2", "p4"]
    wait_for(lambda: svc.stats()["running_requests"] == 0)
    s = svc.stats()
    assert (s["groups_dropped"], s["requests_dropped"], s["groups_in_flight"]) == (2, 6, 0)
    svc.submit(prompts(["1"]), GenerateParams(n=1, max_tokens=4), SEED)  # p0 is free again
    assert svc.collect(min_groups=1, timeout=20).column("uid").to_pylist() == ["p0"]


def test_errors_say_what_to_do(service):
    svc = service()
    params = GenerateParams(n=2, max_tokens=8)
    svc.pause()
    svc.submit(prompts(), params, SEED)
    with pytest.raises(BatchError, match="still in the service"):
        svc.submit(prompts(["9"]), params, SEED)
    with pytest.raises(BatchError, match="lacks column"):
        svc.submit(prompts().drop_columns(["ground_truth"]), params, SEED)
    with pytest.raises(BatchError, match="repeats a uid"):
        svc.submit(pa.concat_tables([prompts(["1"], "x"), prompts(["2"], "x")]), params, SEED)
    svc.resume()
    with pytest.raises(EngineError, match="max_position_embeddings"):
        svc.submit(prompts(["1+2="], "long"), GenerateParams(n=1, max_tokens=600), SEED)
    assert svc.stats()["requests_submitted"] == 10  # the refused ones left no trace
    assert svc.clear() == 5 and svc.collect().num_rows == 0
    svc.shutdown()
    with pytest.raises(RolloutServiceError, match="shut down"):
        svc.submit(prompts(), params, SEED)


def test_a_failing_engine_step_surfaces_to_callers(service):
    class Broken(EmbeddedEngine):
        def step(self):
            raise RuntimeError("boom")

    svc = service(Broken(model(), TOK))
    svc.submit(prompts(), GenerateParams(n=1, max_tokens=4), SEED)
    with pytest.raises(RolloutServiceError, match="boom"):
        svc.collect(min_groups=1, timeout=10)


def test_an_abort_behind_the_services_back_is_an_error_not_a_hang(service):
    engine = GatedEngine(model(), TOK)
    svc = service(engine)
    svc.submit(prompts(), GenerateParams(n=2, max_tokens=8), SEED)
    engine.abort_all()  # what a weight_sync stage calling RolloutState.abort_all would do
    with pytest.raises(RolloutServiceError, match="vanished .* use the service's pause"):
        svc.collect(min_groups=5, timeout=10)


def test_the_rollout_worker_delegates_to_its_service():
    state = RolloutState(PipelineConfig.model_validate(quickstart_raw()), 0, 1, None)
    try:
        table = prompts(["12=", "34="]).set_column(
            3, "prompt_ids", pa.array([state.tokenizer.encode(t) for t in ("12=", "34=")], pa.list_(pa.int32())))
        assert state.service_submit(table, {"n": 2, "max_tokens": 3}, SEED) == 4
        assert state.service_collect(2, 20).num_rows == 4
        assert state.service_pause() == 0
        assert state.load_weights(export_buckets(state.engine.model), 1) == 1
        assert state.service_resume() == 0
        assert state.service_push_weights(export_buckets(state.engine.model), 2) == 0
        stats = state.service_stats()
        assert stats["version"] == 2 and stats["requests_finished"] == 4
        assert state.service_drop(["p0"]) == 0 and state.service_clear() == 0
    finally:
        state.service_shutdown()
