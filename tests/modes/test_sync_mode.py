"""Sync mode, run inline (same stages, no Ray): DAPO refill, batch arithmetic checks."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import Recorder, quickstart_raw
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import ConfigError, RlpipeError


def _run(raw, tmp_path) -> Recorder:
    raw["trainer"] = {**raw["trainer"], "output_dir": str(tmp_path)}
    raw["tracking"] = {"enabled": False, "sample_trajectories": 100000}
    recorder = Recorder()
    run_pipeline(validate_config(raw), "", observer=recorder, inline=True)
    return recorder


def test_dapo_refill_fills_every_step_with_informative_groups(tmp_path):
    raw = quickstart_raw(data={"prompts_per_step": 6}, trainer={"total_steps": 3})
    raw["stages"].insert(2, {"kind": "filter_groups", "impl": "dapo"})
    rec = _run(raw, tmp_path)
    for step, batch in rec.batches.items():
        uids = np.asarray(batch.column("uid").to_pylist())
        rewards = batch.column("reward").to_numpy()
        assert len(set(uids)) == 6, "exactly prompts_per_step groups are trained on"
        for uid in set(uids):
            assert rewards[uids == uid].std() > 0, "only groups with reward variance survive"
        generations = [r for r in rec.records if r.step == step and r.kind == "generate"]
        rounds = rec.metrics[step]["filter_groups/refill_rounds"]
        assert len(generations) == 1 + rounds
        # every refill round generated 2× the groups the previous round evicted
        filters = [r for r in rec.records if r.step == step and r.kind == "filter_groups"]
        for before, gen in zip(filters, generations[1:]):
            assert gen.rows_in == max(1, 2 * before.metrics["filter_groups/evicted_groups"])


def test_dapo_without_enough_rounds_fails_with_advice(tmp_path):
    raw = quickstart_raw(data={"prompts_per_step": 6}, trainer={"total_steps": 1},
                         mode_params={"max_refill_rounds": 0})
    raw["stages"].insert(2, {"kind": "filter_groups", "impl": "dapo"})
    # 6 prompts × 8 samples of an untrained model: some group has zero reward variance
    with pytest.raises(RlpipeError, match="raise mode_params.max_refill_rounds"):
        _run(raw, tmp_path)


def test_parameter_sync_step_must_match_the_mini_batches():
    raw = quickstart_raw(data={"prompts_per_step": 16}, trainer={"ppo_mini_batch_size": 4, "parameter_sync_step": 2})
    with pytest.raises(ConfigError, match="parameter_sync_step=2 must equal .* = 4"):
        build_plan(validate_config(raw))


def test_every_local_update_counts_in_the_schedule(tmp_path):
    raw = quickstart_raw(data={"prompts_per_step": 8},
                         trainer={"total_steps": 2, "ppo_mini_batch_size": 2, "parameter_sync_step": 4})
    rec = _run(raw, tmp_path)
    assert [rec.metrics[s]["actor/local_updates"] for s in (0, 1)] == [4.0, 8.0]
    # one push per global step, whatever the number of local updates
    assert [rec.metrics[s]["policy_version"] for s in (0, 1)] == [1, 2]
    assert all(rec.metrics[s]["timing/step_end_s"] > 0 for s in (0, 1))  # the driver's own records of the step


def test_a_staleness_guard_in_sync_checks_the_sync_bound(tmp_path):
    """Sync sets the guard's bound itself (staleness 1, version lag 0): one YAML runs in every mode."""
    raw = quickstart_raw(trainer={"total_steps": 3})
    raw["stages"].insert(2, {"kind": "staleness_guard", "impl": "max_staleness"})
    rec = _run(raw, tmp_path)
    for step in range(3):
        assert rec.metrics[step]["staleness_guard/staleness/max"] == 1.0
        assert rec.metrics[step]["staleness_guard/version_lag/max"] == 0.0
