"""Async modes, run inline (real stages, real rollout service thread, real replay buffer; no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import Recorder, quickstart_raw, with_staleness_guard
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import ConfigError, PlanError, StageError


COMPARED = ["uid", "sample_index", "prompt_ids", "response_ids", "rollout_logprobs", "token_versions",
            "reward", "advantages", "old_logprobs"]


def _raw(mode: str, steps: int = 3, mode_params: dict | None = None, guard: bool = True, **gen) -> dict:
    raw = quickstart_raw(mode=mode, mode_params=mode_params or {}, data={"prompts_per_step": 4},
                         trainer={"total_steps": steps})
    stages = []
    for stage in raw["stages"]:
        if stage["kind"] == "generate":
            stage = {**stage, "params": {**stage["params"], "n": 4, **gen}}
        stages.append(stage)
    raw["stages"] = stages
    return with_staleness_guard(raw) if guard else raw


def _run(raw: dict, tmp_path) -> Recorder:
    raw["trainer"] = {**raw["trainer"], "output_dir": str(tmp_path)}
    raw["tracking"] = {"enabled": False, "sample_trajectories": 100000}
    rec = Recorder()
    run_pipeline(validate_config(raw), "", observer=rec, inline=True)
    return rec


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory):
    return _run(_raw("sync", guard=False), tmp_path_factory.mktemp("sync"))


@pytest.mark.parametrize("mode,params", [
    ("separate_async", {"max_off_policy_threshold": 1, "strategy": "wait"}),
    ("colocate_async", {"overlap": False}),
])
def test_zero_staleness_async_equals_sync(mode, params, sync_reference, tmp_path):
    rec = _run(_raw(mode, mode_params=params), tmp_path)
    for step, expected in sync_reference.batches.items():
        got = rec.batches[step]
        for column in COMPARED:
            assert got.column(column).equals(expected.column(column)), (step, column)
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert rec.metrics[step][key] == pytest.approx(sync_reference.metrics[step][key], rel=1e-6, abs=1e-9)


def test_colocate_overlap_keeps_versions_within_one_push(tmp_path):
    rec = _run(_raw("colocate_async", steps=4, max_tokens=8), tmp_path)
    for step, batch in rec.batches.items():
        versions = set(np.concatenate(batch.column("token_versions").to_numpy(zero_copy_only=False)).tolist())
        # generated during step-1 (version step-1) and, after its push, resumed on version step
        assert versions <= {max(step - 1, 0), step}, (step, versions)
        assert rec.metrics[step]["staleness_guard/staleness/max"] <= 2
        assert rec.metrics[step]["staleness_guard/version_lag/max"] <= 1


LONG_TAIL = {"max_tokens": 24, "ignore_eos": True, "length_distribution": "pareto", "pareto_alpha": 1.1,
             "min_tokens": 1}


def _consumed_staleness(rec: Recorder) -> list[int]:
    out = []
    for step, batch in rec.batches.items():
        out.extend((step - batch.column("prompt_step").to_numpy() + 1).tolist())
    return out


def test_drop_never_consumes_beyond_the_threshold_on_a_long_tail(tmp_path):
    params = {"max_off_policy_threshold": 2, "strategy": "drop", "capacity_steps": 3}
    rec = _run(_raw("separate_async", steps=6, mode_params=params, **LONG_TAIL), tmp_path)
    assert max(_consumed_staleness(rec)) <= 2
    for step, batch in rec.batches.items():
        lag = step - min(np.concatenate(batch.column("token_versions").to_numpy(zero_copy_only=False)))
        assert lag <= 2  # a token is never older than the prompt's submission
    # the replicas' decode iterations per step (what rlpipe simulate calibrates on): every step after the first
    decode = [m for step, m in rec.metrics.items() if step > 0]
    assert all("rollout/decode_cpu_s" in m for m in decode) and sum(m["rollout/decode_steps"] for m in decode) > 0
    assert all(m["rollout/decode_tokens"] >= m["rollout/decode_steps"] for m in decode)


def test_wait_never_drops_and_stays_within_the_threshold(tmp_path):
    params = {"max_off_policy_threshold": 2, "strategy": "wait", "capacity_steps": 3}
    rec = _run(_raw("separate_async", steps=6, mode_params=params, **LONG_TAIL), tmp_path)
    assert max(_consumed_staleness(rec)) <= 2
    assert all(m["sampler/evicted_stale_total"] == 0 for m in rec.metrics.values())


def test_drop_at_threshold_one_refills_what_it_evicts_while_the_trainer_waits(tmp_path):
    """Threshold 1 under drop: every group refilled while the trainer trains step s is stale at s + 1 and
    evicted there; the trainer's wait must refill them (it once waited for prompts nobody submitted)."""
    params = {"max_off_policy_threshold": 1, "strategy": "drop", "stall_timeout_s": 20}
    rec = _run(_raw("separate_async", steps=4, mode_params=params, **LONG_TAIL), tmp_path)
    assert sorted(rec.batches) == [0, 1, 2, 3]
    assert max(_consumed_staleness(rec)) == 1
    assert sum(m["sampler/evicted_stale_total"] for m in rec.metrics.values()) > 0


def test_async_mode_without_a_guard_is_a_plan_error():
    with pytest.raises(PlanError, match="needs a staleness_guard stage"):
        build_plan(validate_config(_raw("separate_async", guard=False)))


def test_separate_async_batch_arithmetic_says_what_to_set():
    raw = _raw("separate_async")
    raw["trainer"] = {**raw["trainer"], "parameter_sync_step": 2, "ppo_mini_batch_size": 1}
    with pytest.raises(ConfigError, match="parameter_sync_step=2 must equal|set trainer.ppo_mini_batch_size=2"):
        build_plan(validate_config(raw))


def test_colocate_releases_the_engine_for_the_update_and_resumes_partial_rollouts(tmp_path):
    # long responses (64-120 tokens) are still being generated when step k reaches its update
    raw = _raw("colocate_async", steps=3, max_tokens=120, ignore_eos=True, length_distribution="pareto",
               min_tokens=64)
    raw["model"]["architecture"]["max_position_embeddings"] = 128
    raw["data"]["max_prompt_length"] = 8  # 3-token prompts; prompt bound + max_tokens must fit the positions
    rec = _run(raw, tmp_path)
    pushes = [r for r in rec.records if r.kind == "weight_sync"]
    # aborted before the update (engine released), resumed by the push on the new version
    assert sum(r.metrics["weight_sync/aborted_requests"] for r in pushes) > 0
    spanning = 0
    for step, batch in rec.batches.items():
        for versions in batch.column("token_versions").to_pylist():
            assert versions == sorted(versions) and set(versions) <= {max(step - 1, 0), step}
            spanning += len(set(versions)) == 2
    assert spanning > 0, "some trajectory was aborted before an update and resumed on the new weights"


def _out_of_range(responses, ground_truths):
    return np.full(len(responses), 2.0)


def test_a_reward_failing_in_a_rollout_replica_fails_the_run_with_kind_impl_and_step(tmp_path):
    from rlpipe.stages.scorers import SCORERS

    if "test_async_out_of_range" not in SCORERS:
        SCORERS.add("test_async_out_of_range", _out_of_range)
    raw = _raw("separate_async", steps=2, mode_params={"max_off_policy_threshold": 2})
    for stage in raw["stages"]:
        if stage["kind"] == "reward":
            stage["params"] = {"routes": {"digits": "test_async_out_of_range"}}
    with pytest.raises(StageError) as err:  # scored in the replica's feeder, raised in the driver
        _run(raw, tmp_path)
    message = str(err.value)
    assert "reward" in message and "rule" in message and "step 0" in message and "[0, 1]" in message


def test_separate_async_scores_in_the_replicas_and_records_their_lineage(tmp_path):
    rec = _run(_raw("separate_async", steps=3, mode_params={"max_off_policy_threshold": 2}), tmp_path)
    generated = [r for r in rec.records if r.kind == "generate"]
    scored = [r for r in rec.records if r.kind == "reward"]
    assert generated and len(scored) == len(generated)
    by_output = {r.output_fingerprint for r in generated}
    assert all(r.input_fingerprint in by_output for r in scored)  # each reward ran on what a replica generated
    assert sum(r.rows_out for r in generated) >= 3 * 4 * 4  # every consumed trajectory was recorded
    assert all(0 <= m["weight_sync/deferred_aborted_requests"] for m in rec.metrics.values())
