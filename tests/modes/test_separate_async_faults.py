"""separate_async notices a dead or hung rollout pool (issue 14 part 1): a killed rollout actor is one error
naming the replica; a feeder that stops making progress fails the run with each replica's state."""

from __future__ import annotations

import time

import pytest

from rlpipe.engine.execution import worker_pool
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import RlpipeError, StageError
from rlpipe.modes.separate_async import RolloutStalled

from conftest import Recorder, quickstart_raw, with_staleness_guard


def _raw(tmp_path, steps: int, mode_params: dict | None = None, reward: dict | None = None, **reward_node) -> dict:
    raw = quickstart_raw(mode="separate_async", data={"prompts_per_step": 2}, tracking={"enabled": False},
                         mode_params={"max_off_policy_threshold": 2, **(mode_params or {})},
                         trainer={"total_steps": steps, "output_dir": str(tmp_path)})
    stages = []
    for stage in raw["stages"]:
        if stage["kind"] == "generate":
            stage["params"] = {**stage["params"], "n": 2}
        if stage["kind"] == "reward":
            stage.update(reward_node)
            stage["params"] = reward or {}
        stages.append(stage)
    raw["stages"] = stages
    with_staleness_guard(raw)
    return raw


@pytest.mark.slow
def test_a_hung_feeder_fails_the_run_with_the_replicas_state(tmp_path, hanging_scorer):
    raw = _raw(tmp_path, steps=3, mode_params={"stall_timeout_s": 3},
               reward={"routes": {"digits": hanging_scorer}, "scorer_timeout_s": None}, timeout_s=None)
    observer = Recorder()
    start = time.monotonic()
    with pytest.raises(RolloutStalled) as caught:
        run_pipeline(validate_config(raw), "", observer=observer, inline=True)
    assert time.monotonic() - start < 90
    message = str(caught.value)
    assert "the rollout pool made no progress for" in message and "while step 0 waits for 2 groups" in message
    assert "replica 0: feeder loop last turned" in message and "mode_params.stall_timeout_s" in message
    assert observer.status == "FAILED"


def test_a_reward_stage_past_its_timeout_in_the_feeder_is_a_stage_error(tmp_path, hanging_scorer):
    raw = _raw(tmp_path, steps=2, reward={"routes": {"digits": hanging_scorer}, "scorer_timeout_s": None},
               timeout_s=1.0)
    with pytest.raises(StageError) as caught:
        run_pipeline(validate_config(raw), "", observer=Recorder(), inline=True)
    err = caught.value
    assert (err.kind, err.impl, err.step) == ("reward", "rule", 0)
    assert "node 'reward' timed out" in str(err) and "rollout-feeder-0 (the rollout replica's feeder)" in str(err)


@pytest.mark.e2e
def test_a_killed_rollout_actor_is_one_error_naming_the_replica(ray_session, tmp_path, caplog):
    killed_at: list[float] = []

    def kill_rollout_after_step_0(step, metrics):
        if step == 0:
            killed_at.append(time.monotonic())
            kept = set(worker_pool.kept())  # idle ones kept from finished runs (ray_session keeps them)
            names = [n for n in ray_session.util.list_named_actors() if n.startswith("rlpipe:rollout:0:")
                     and n not in kept]
            assert len(names) == 1, names
            ray_session.kill(ray_session.get_actor(names[0]))

    raw = _raw(tmp_path, steps=50)
    with pytest.raises(RlpipeError) as caught:  # WorkerDied, or the deferred push that met the dead replica
        run_pipeline(validate_config(raw), "", observer=Recorder(), on_step=kill_rollout_after_step_0)
    assert killed_at and time.monotonic() - killed_at[0] < 60
    message = str(caught.value)
    assert "worker rollout[0] (pid " in message and " died: " in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no chained tracebacks
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]
