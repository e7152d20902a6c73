"""Every wait is bounded (issue 14 part 1): hung stages fail the run naming stage, impl, step and worker;
a hung scorer marks its rows failed instead of stalling the run."""

from __future__ import annotations

import json
import time

import pytest

from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import StageError

from conftest import Recorder, quickstart_raw


def _raw(tmp_path, steps: int = 2, reward: dict | None = None, **reward_node) -> dict:
    raw = quickstart_raw(data={"prompts_per_step": 2}, tracking={"enabled": False},
                         trainer={"total_steps": steps, "output_dir": str(tmp_path)})
    for stage in raw["stages"]:
        if stage["kind"] == "generate":
            stage["params"] = {**stage["params"], "n": 2}
        if stage["kind"] == "reward":
            stage.update(reward_node)
            stage["params"] = reward or {}
    return raw


def test_a_hung_inline_stage_fails_the_run_naming_stage_impl_step_and_worker(tmp_path, hanging_scorer):
    raw = _raw(tmp_path, reward={"routes": {"digits": hanging_scorer}, "scorer_timeout_s": None},
               timeout_s=1.0)
    observer = Recorder()
    start = time.monotonic()
    with pytest.raises(StageError) as caught:
        run_pipeline(validate_config(raw), "", observer=observer, inline=True)
    assert time.monotonic() - start < 60
    err = caught.value
    assert (err.kind, err.impl, err.step) == ("reward", "rule", 0)
    message = str(err)
    assert "node 'reward' timed out: no result after timeout_s=1 s on the inline backend" in message
    assert "-o stages.reward.timeout_s=SECONDS" in message
    assert observer.status == "FAILED"


def test_a_hung_scorer_marks_its_rows_failed_and_the_run_goes_on(tmp_path, hanging_scorer):
    raw = _raw(tmp_path, reward={"routes": {"digits": hanging_scorer}, "scorer_timeout_s": 0.5})
    observer = Recorder()
    run_pipeline(validate_config(raw), "", observer=observer, inline=True)
    assert observer.status == "FINISHED"
    for step in (0, 1):
        metrics = observer.metrics[step]
        assert metrics["reward/failed_rows"] == 4.0  # 2 prompts × 2 samples: infrastructure failures
        assert "reward/mean" not in metrics  # nothing valid to average
        assert set(observer.batches[step].column("status").to_pylist()) == {"failed"}


def test_stage_timeout_must_be_positive_or_none():
    raw = quickstart_raw()
    raw["stages"][0]["timeout_s"] = 0
    with pytest.raises(Exception, match="timeout_s"):
        validate_config(raw)
    raw["stages"][0]["timeout_s"] = None
    assert validate_config(raw).stages[0].timeout_s is None
    assert validate_config(quickstart_raw()).stages[0].timeout_s == 3600.0


# --- on Ray: the code scorer's sandbox runs a test that sleeps (a reward service that never answers) ---

def _sleeping_code_dataset(tmp_path) -> str:
    path = tmp_path / "sleepy.jsonl"
    rows = [{"prompt": f"{i}{i}=", "ground_truth": json.dumps(["import time; time.sleep(20)"]),
             "data_source": "code"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _ray_raw(tmp_path, **reward_node) -> dict:
    raw = _raw(tmp_path, steps=2, reward={"scorer_params": {"code": {"timeout_s": 30}},
                                          **reward_node.pop("params", {})}, **reward_node)
    raw["data"] = {**raw["data"], "source": "jsonl", "params": {"path": _sleeping_code_dataset(tmp_path)}}
    return raw


@pytest.mark.e2e
@pytest.mark.parametrize("in_workers, where", [
    (False, "a Ray task (task id"),  # reward and balance: one Ray task, cancelled
    (True, "worker rollout[0] (pid"),  # run in the rollout replica's call after generate; its thread abandoned
])
def test_a_hung_task_stage_fails_the_run_at_its_deadline_naming_where_it_ran(ray_session, tmp_path, in_workers, where):
    raw = _ray_raw(tmp_path, timeout_s=3.0, params={"scorer_timeout_s": None})
    raw["resources"] = {"task_stages_in_workers": in_workers}
    # No wall-clock bound here: it would time the actors' start-up under load too. Without the deadline the
    # sandboxes' 20 s sleeps end inside their 30 s limit and the run finishes, so the error itself is the proof.
    with pytest.raises(StageError) as caught:
        run_pipeline(validate_config(raw), "", observer=Recorder())
    err = caught.value
    assert (err.kind, err.impl, err.step) == ("reward", "rule", 0)
    assert f"node 'reward' timed out: no result after timeout_s=3 s on {where}" in str(err)


@pytest.mark.e2e
def test_a_hung_scorer_in_a_ray_task_marks_rows_failed(ray_session, tmp_path):
    raw = _ray_raw(tmp_path, params={"scorer_timeout_s": 1.0})
    observer = Recorder()
    run_pipeline(validate_config(raw), "", observer=observer)
    assert observer.status == "FINISHED"
    assert all(m["reward/failed_rows"] == 4.0 and m["reward/scorer_timeouts"] == 1.0
               for m in observer.metrics.values())


@pytest.mark.e2e
@pytest.mark.parametrize("in_workers", [False, True])  # True: old_log_prob, advantage, update as one actor call
def test_a_worker_stage_past_its_timeout_kills_the_worker_and_names_it(ray_session, tmp_path, in_workers):
    raw = _raw(tmp_path, steps=1)
    raw["resources"] = {"task_stages_in_workers": in_workers}
    for stage in raw["stages"]:
        if stage["kind"] == "old_log_prob":
            stage["timeout_s"] = 0.001  # a forward pass on the actor worker cannot answer within 1 ms
    with pytest.raises(StageError) as caught:
        run_pipeline(validate_config(raw), "", observer=Recorder())
    err = caught.value
    assert (err.kind, err.impl, err.step) == ("old_log_prob", "trainer", 0)
    assert "no result after timeout_s=0.001 s on worker actor[0] (pid " in str(err) and "(killed)" in str(err)


@pytest.mark.e2e
@pytest.mark.parametrize("in_workers, where", [
    (False, "the driver (a driver stage waiting on its workers)"),
    # the push ran as the last act of the trainer's call: its abandoned thread would hold the trainer's state
    (True, "worker actor[0] (pid "),
])
def test_a_weight_push_past_its_timeout_names_where_it_ran(ray_session, tmp_path, in_workers, where):
    raw = _raw(tmp_path, steps=1)
    raw["resources"] = {"task_stages_in_workers": in_workers}
    for stage in raw["stages"]:
        if stage["kind"] == "weight_sync":
            stage["timeout_s"] = 0.001  # export, bump and the replica's load cannot answer within 1 ms
    with pytest.raises(StageError) as caught:
        run_pipeline(validate_config(raw), "", observer=Recorder())
    err = caught.value
    assert (err.kind, err.impl, err.step) == ("weight_sync", "object_store", 0)
    assert f"node 'weight_sync' timed out: no result after timeout_s=0.001 s on {where}" in str(err), str(err)
    assert ("(killed)" in str(err)) == in_workers
