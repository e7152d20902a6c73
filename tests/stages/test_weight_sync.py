"""weight_sync/object_store driven against in-process states: a real trainer and a real rollout engine."""

import pyarrow as pa
import pytest
import torch

from conftest import eval_logits
from rlpipe.inference.contract import EngineError, GenerationRequest, SamplingParams
from rlpipe.engine.execution.inline import LocalWorkerCalls
from rlpipe.engine.state.train_state import TrainState
from rlpipe.engine.state.roles import RolloutState
from rlpipe.schemas.config import (
    ArchitectureConfig, ModelConfig, OptimizerConfig, PipelineConfig, TokenizerConfig, TrainerConfig,
)
from rlpipe.stage import StageContext, stage_registry

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def config() -> PipelineConfig:
    arch = ArchitectureConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                              max_position_embeddings=64)
    return PipelineConfig(model=ModelConfig(architecture=arch), tokenizer=TokenizerConfig(chars="0123456789="),
                          trainer=TrainerConfig(optimizer=OptimizerConfig(lr=0.05)), stages=[])


@pytest.fixture
def roles():
    cfg = config()
    trainer, rollout = TrainState(cfg, 0, 1, None), RolloutState(cfg, 0, 1, None)
    return trainer, rollout, LocalWorkerCalls({"actor": [trainer], "rollout": [rollout]})


def push(workers, step=0):
    spec = stage_registry("weight_sync").get("object_store")
    result = spec.fn(pa.table({"uid": ["a"]}), spec.params_model(), StageContext(step=step, seed=0, workers=workers))
    assert result.columns == {} and result.table is None and result.keep is None  # orchestration only
    # the version it made current travels as a field (the engine's contexts take it), and as a metric for people
    assert result.policy_version == result.metrics["weight_sync/version"] == workers.call("actor", "get_version")[0]
    return result.metrics


def logits(model) -> torch.Tensor:
    return eval_logits(model, IDS)


def train_one_step(trainer: TrainState) -> None:
    trainer.model(input_ids=IDS).logits.logsumexp(-1).mean().backward()
    trainer.optimizer_step()


def requests(prefix: str, n: int = 4, max_tokens: int = 6):
    return [GenerationRequest(f"{prefix}{i}", [5 + i, 6, 7], max_tokens, SamplingParams(seed=1)) for i in range(n)]


def test_push_bumps_the_version_and_the_engine_serves_the_trainers_weights(roles):
    trainer, rollout, workers = roles
    train_one_step(trainer)
    assert not torch.allclose(logits(rollout.engine.model), logits(trainer.model), atol=1e-4)

    metrics = push(workers)

    assert metrics["weight_sync/version"] == 1.0
    n_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    # one process: the engine copied the trainer's tensors in, no buckets packed
    assert metrics["weight_sync/bytes"] == n_bytes and metrics["weight_sync/buckets"] == 0.0
    for boundary in ("export_s", "transport_s", "load_s", "cache_reset_s", "resume_s"):
        assert 0.0 <= metrics[f"weight_sync/{boundary}"] <= metrics["weight_sync/push_s"], boundary
    assert metrics["weight_sync/mb_per_s"] > 0
    assert trainer.get_version() == 1 and rollout.get_version() == 1 and rollout.engine.version == 1
    assert metrics["weight_sync/aborted_requests"] == 0.0
    assert torch.equal(logits(rollout.engine.model), logits(trainer.model))
    results = rollout.engine.generate(requests("a"))
    assert all(len(r.versions) == len(r.response_ids) > 0 for r in results)
    assert all((r.versions == 1).all() for r in results)


def test_an_in_process_push_copies_the_tensors_and_a_server_engine_gets_buckets(roles):
    trainer, rollout, workers = roles
    train_one_step(trainer)
    push(workers)
    pushed = logits(trainer.model)
    train_one_step(trainer)  # the trainer moves on: the engine holds its own copy of the pushed version
    assert torch.equal(logits(rollout.engine.model), pushed)
    assert not torch.allclose(logits(trainer.model), pushed, atol=1e-6)
    rollout._loads_local = False  # as for a vLLM or SGLang replica: the tensors are packed into buckets first
    metrics = push(workers)
    assert metrics["weight_sync/buckets"] == 1.0 and torch.equal(logits(rollout.engine.model), logits(trainer.model))


def test_a_bfloat16_rollout_copy_takes_the_float32_trainers_pushes_rounded():
    cfg = config()
    cfg.model.rollout_dtype = "bfloat16"
    trainer, rollout = TrainState(cfg, 0, 1, None), RolloutState(cfg, 0, 1, None)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {p.dtype for p in rollout.engine.model.parameters()} == {torch.bfloat16}
    train_one_step(trainer)
    push(LocalWorkerCalls({"actor": [trainer], "rollout": [rollout]}))
    for p, q in zip(trainer.model.parameters(), rollout.engine.model.parameters()):
        assert torch.equal(q, p.detach().to(torch.bfloat16))
    results = rollout.engine.generate(requests("bf"))
    assert all(len(r.response_ids) == len(r.logprobs) > 0 and (r.versions == 1).all() for r in results)


def test_every_push_bumps_by_one_and_new_tokens_carry_the_new_version(roles):
    trainer, rollout, workers = roles
    for expected in (1, 2, 3):
        with torch.no_grad():  # a manual edit of the trainer's weights between pushes
            next(trainer.model.parameters()).mul_(1.1)
        metrics = push(workers, step=expected)
        assert metrics["weight_sync/version"] == float(expected)
        assert trainer.version == rollout.engine.version == expected
        assert torch.equal(logits(rollout.engine.model), logits(trainer.model))
        results = rollout.engine.generate(requests(f"v{expected}-"))
        assert {int(v) for r in results for v in r.versions} == {expected}


def test_push_during_generation_aborts_in_flight_requests_first(roles):
    trainer, rollout, workers = roles
    engine = rollout.engine
    engine.submit(requests("busy", n=5, max_tokens=30))
    engine.step()  # prefill + first token: the requests are mid-generation
    engine.submit(requests("queued", n=2))  # not even prefilled yet
    in_flight = engine.num_running()
    assert in_flight == 7
    with pytest.raises(EngineError, match="in flight"):  # without the stage's abort the load is refused
        rollout.load_weights(trainer.export_weights(), 1)
    train_one_step(trainer)

    metrics = push(workers)

    assert metrics["weight_sync/aborted_requests"] == float(in_flight)
    assert not engine.has_active() and engine.num_running() == 0
    assert engine.version == trainer.version == 1
    assert torch.equal(logits(engine.model), logits(trainer.model))
    assert all((r.versions == 1).all() for r in engine.generate(requests("after")))


def test_push_wakes_a_sleeping_engine(roles):
    trainer, rollout, workers = roles
    rollout.sleep()
    assert rollout.engine.asleep
    push(workers)
    assert not rollout.engine.asleep and rollout.engine.version == 1
    assert len(rollout.engine.generate(requests("w", n=1))) == 1


# --- weight_sync/delta: only the changed words travel, checksummed; whole at every flush ----------------


def delta_push(workers, full_every: int, step: int = 0):
    spec = stage_registry("weight_sync").get("delta")
    params = spec.params_model(full_every=full_every)
    return spec.fn(pa.table({"uid": ["a"]}), params, StageContext(step=step, seed=0, workers=workers)).metrics


def nudge(trainer: TrainState, rows: int = 2) -> None:
    """Change a few words of the trainer's weights (as a sparse or low-precision update does)."""
    with torch.no_grad():
        trainer.model.get_input_embeddings().weight[:rows, :3] += 0.25


def test_delta_sends_the_changed_words_and_the_replica_matches_the_trainer_bit_for_bit(roles):
    trainer, rollout, workers = roles
    full_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    first = delta_push(workers, full_every=3)  # version 1: a flush
    assert first["weight_sync/full_push"] == 1.0 and first["weight_sync/delta_buckets"] == 0.0
    assert first["weight_sync/bytes"] >= full_bytes
    for version in (2, 3):
        nudge(trainer)
        metrics = delta_push(workers, full_every=3, step=version)
        assert metrics["weight_sync/version"] == float(version) and metrics["weight_sync/full_push"] == 0.0
        assert metrics["weight_sync/delta_buckets"] == 1.0
        assert metrics["weight_sync/bytes"] == 6 * 8  # 6 changed float32 words: a uint32 index + the word each
        for key in ("export_s", "transport_s", "load_s", "push_s", "mb_per_s"):
            assert metrics[f"weight_sync/{key}"] >= 0.0, key
        for (name, p), q in zip(trainer.model.named_parameters(), rollout.engine.model.parameters()):
            assert torch.equal(p, q), name
    train_one_step(trainer)  # a dense AdamW step changes nearly every word: the bucket goes whole
    dense = delta_push(workers, full_every=3, step=4)
    assert dense["weight_sync/full_push"] == 1.0 and dense["weight_sync/bytes"] >= full_bytes
    assert torch.equal(logits(rollout.engine.model), logits(trainer.model)) and rollout.get_version() == 4


def test_a_corrupted_delta_is_refused_naming_the_boundary_and_the_weights_stay(roles):
    from rlpipe.backends.weight_delta import DeltaPush
    from rlpipe.backends.weights import DeltaBucket

    trainer, rollout, workers = roles
    delta_push(workers, full_every=10)
    honest = trainer.export_delta_push

    def corrupt(full_every):  # one bit flipped in transit, after the sender's checksum
        push = honest(full_every)
        parts = tuple(DeltaBucket(p.base_checksum, p.indices, p.values ^ 1, p.tensors, p.checksum)
                      if isinstance(p, DeltaBucket) else p for p in push.parts)
        return DeltaPush(parts, push.version, push.full, push.full_bytes, push.export_s, push.exported_at)

    trainer.export_delta_push = corrupt
    before = [p.clone() for p in rollout.engine.model.parameters()]
    nudge(trainer)
    with pytest.raises(Exception, match=r"boundary 2 \(transport: delta checksum, rollout replica 0\).*checksum"):
        delta_push(workers, full_every=10, step=1)
    assert all(torch.equal(a, b) for a, b in zip(before, rollout.engine.model.parameters()))
    assert rollout.get_version() == 1


def test_a_restarted_replica_refuses_deltas_until_the_next_flush(roles):
    from rlpipe.backends.weight_delta import DeltaReceiver

    trainer, rollout, workers = roles
    delta_push(workers, full_every=2)
    rollout._delta_receiver = DeltaReceiver()  # as after a restart: no previous buckets
    nudge(trainer)
    with pytest.raises(Exception, match="holds no previous push"):
        delta_push(workers, full_every=2, step=1)
    nudge(trainer)
    metrics = delta_push(workers, full_every=2, step=2)  # version 3: a flush heals it
    assert metrics["weight_sync/full_push"] == 1.0
    assert torch.equal(logits(rollout.engine.model), logits(trainer.model))


def test_trainer_and_replica_must_agree_on_the_flush_count(roles):
    trainer, rollout, workers = roles
    push_ = trainer.export_delta_push(full_every=1)  # version 1 is a flush for every full_every
    nudge(trainer)
    trainer.bump_version()
    rollout.push_weights(push_, 1, full_every=5)
    second = trainer.export_delta_push(full_every=1)  # trainer: flush at version 2; replica (5): a delta
    with pytest.raises(Exception, match="disagree on the flush count"):
        rollout.push_weights(second, 2, full_every=5)
