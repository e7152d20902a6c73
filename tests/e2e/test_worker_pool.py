"""Kept workers (rlpipe.engine.execution.worker_pool): a finished run's worker processes host the next run of the
same driver and Ray session, and that run learns exactly what it learns in new processes; a failed run's workers
and a kept worker that died are not used again."""

from __future__ import annotations

import pytest

from rlpipe.engine.execution import worker_pool
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import StageError

from conftest import Recorder, quickstart_raw

pytestmark = pytest.mark.e2e


def _run(tmp_path, name: str, **trainer) -> Recorder:
    raw = quickstart_raw(data={"prompts_per_step": 4}, tracking={"enabled": False},
                         trainer={"total_steps": 3, "output_dir": str(tmp_path / name), **trainer})
    observer = Recorder()
    run_pipeline(validate_config(raw), "", observer=observer)
    return observer


def _rewards(observer: Recorder) -> list[float]:
    return [observer.metrics[step]["reward/mean"] for step in sorted(observer.metrics)]


def test_a_finished_runs_workers_host_the_next_run_which_learns_as_in_new_ones(ray_session, tmp_path):
    worker_pool.keep_idle_workers(False)  # the first run's workers are new processes
    worker_pool.keep_idle_workers()
    fresh = _run(tmp_path, "fresh")
    kept = worker_pool.kept()
    assert len(kept) == 2  # the trainer and the rollout replica, released for the next run

    again = _run(tmp_path, "again")
    assert worker_pool.kept() == kept  # it took those two and gave the same two back
    assert _rewards(again) == _rewards(fresh)  # same seeds, same thread budget: nothing of run 1 leaks into run 2
    assert [r.output_fingerprint for r in again.records] == [r.output_fingerprint for r in fresh.records]


def test_a_failed_runs_workers_are_not_kept_and_a_dead_kept_worker_is_replaced(ray_session, tmp_path):
    _run(tmp_path, "first")
    assert len(worker_pool.kept()) == 2
    with pytest.raises(StageError):  # a non-finite loss: its workers may hold an abandoned thread, or worse
        _run(tmp_path, "failing", optimizer={"lr": 1e30}, grad_clip=None)
    assert worker_pool.kept() == []

    _run(tmp_path, "second")
    dying = worker_pool.kept()
    assert len(dying) == 2
    for name in dying:  # a kept worker that died while idle (out of memory, killed by hand)
        ray_session.kill(ray_session.get_actor(name))
    observer = _run(tmp_path, "after")
    assert observer.status == "FINISHED"
    assert len(worker_pool.kept()) == 2 and not set(worker_pool.kept()) & set(dying)
