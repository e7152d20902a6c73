"""The run opens in the tracking store while the workers start (rlpipe.engine.tracking.run_start): the two overlap,
a store that cannot open the run fails it with the store's error and stops the workers, and workers that fail to
start leave the opened run marked FAILED."""

from __future__ import annotations

import threading

import pytest

from rlpipe.engine.execution import inline
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline

from conftest import Recorder, quickstart_raw


def _config(tmp_path):
    return validate_config(quickstart_raw(data={"prompts_per_step": 2}, tracking={"enabled": False},
                                          trainer={"total_steps": 1, "output_dir": str(tmp_path)}))


class _OpensOnceWorkersStart(Recorder):
    """A store that answers only once the workers are being built: a run start before the workers would hang."""

    def __init__(self, building: threading.Event):
        super().__init__()
        self.building, self.ended = building, []

    def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
        assert self.building.wait(60), "the workers were not built while the run was opening"
        return "opened-beside-the-workers"

    def on_run_end(self, status, error=None):
        super().on_run_end(status, error)
        self.ended.append((status, error))


def _watch_backend(monkeypatch, fail: bool = False) -> tuple[threading.Event, list[str]]:
    building, shutdowns = threading.Event(), []
    real_init, real_shutdown = inline.InlineBackend.__init__, inline.InlineBackend.shutdown

    def init(self, *args, **kwargs):
        building.set()
        if fail:
            raise RuntimeError("the trainer's model does not fit")
        real_init(self, *args, **kwargs)

    def shutdown(self, finished=False):
        shutdowns.append("shutdown")
        real_shutdown(self, finished)

    monkeypatch.setattr(inline.InlineBackend, "__init__", init)
    monkeypatch.setattr(inline.InlineBackend, "shutdown", shutdown)
    return building, shutdowns


def test_the_run_opens_while_the_workers_are_built(tmp_path, monkeypatch):
    building, shutdowns = _watch_backend(monkeypatch)
    observer = _OpensOnceWorkersStart(building)
    result = run_pipeline(_config(tmp_path), "", observer=observer, inline=True)
    assert result.run_id == "opened-beside-the-workers" and result.steps == 1
    assert observer.ended == [("FINISHED", None)] and shutdowns == ["shutdown"]


def test_a_store_that_cannot_open_the_run_fails_it_and_stops_the_workers(tmp_path, monkeypatch):
    _, shutdowns = _watch_backend(monkeypatch)

    class Unreachable(Recorder):
        ended: list = []

        def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
            raise ConnectionError("tracking.uri http://127.0.0.1:9 refused the connection")

        def on_run_end(self, status, error=None):
            self.ended.append(status)

    observer = Unreachable()
    with pytest.raises(ConnectionError, match="refused the connection"):
        run_pipeline(_config(tmp_path), "", observer=observer, inline=True)
    assert observer.ended == []  # no run was opened, so none is ended
    assert shutdowns == ["shutdown"]  # the workers built meanwhile are stopped


def test_workers_that_fail_to_start_leave_the_opened_run_failed(tmp_path, monkeypatch):
    building, _ = _watch_backend(monkeypatch, fail=True)
    observer = _OpensOnceWorkersStart(building)
    with pytest.raises(RuntimeError, match="does not fit"):
        run_pipeline(_config(tmp_path), "", observer=observer, inline=True)
    assert observer.ended == [("FAILED", "RuntimeError: the trainer's model does not fit")]
