"""The tracking process: calls applied in order in a child process, bounded, logs forwarded, a dead trainer's run KILLED."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pyarrow as pa
import pytest

from rlpipe.engine.tracking.process_observer import ProcessObserver


class FileRecorder:
    """An observer in the child process that appends each call to a JSON-lines file (the test reads it back)."""

    def __init__(self, path: str, delay_s: float = 0.0, fail_start: bool = False, hang_start: bool = False):
        self.path, self.delay_s, self.fail_start, self.hang_start = path, delay_s, fail_start, hang_start
        self.failures: list[str] = []

    def _write(self, *entry) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def on_run_start(self, config, pipeline_yaml, plan_summary):
        if self.fail_start:
            raise ValueError("no store here")
        if self.hang_start:  # a store that never answers
            time.sleep(3600)
        self._write("start", os.getpid())
        return "run-1"

    def on_node_end(self, record):
        time.sleep(self.delay_s)
        if record == "warn":
            logging.getLogger("rlpipe.test_child").warning("a warning from the tracking process")
        self._write("node", record)

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None):
        self._write("step", step, metrics, trajectories.to_pylist() if trajectories is not None else None)

    def on_artifact(self, local_path, artifact_path=None):
        self._write("artifact", local_path)

    def on_run_end(self, status, error=None):
        self._write("end", status)


def _calls(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_calls_are_applied_in_order_in_another_process_and_drained_by_run_end(tmp_path):
    out = tmp_path / "calls.jsonl"
    obs = ProcessObserver(partial(FileRecorder, str(out)), drain_timeout_s=60)
    assert obs.on_run_start({}, "", {}) == "run-1"
    for i in range(5):
        obs.on_node_end(f"n{i}")
    table = pa.table({"uid": ["a", "b"], "ids": pa.array([[1, 2], [3]], pa.list_(pa.int32()))})
    metrics = {"reward/mean": 0.5}
    obs.on_step_end(0, metrics, table)
    metrics["reward/mean"] = 9.0  # the caller may reuse its dict
    obs.on_artifact("/models/final")
    obs.on_run_end("FINISHED")
    calls = _calls(out)
    assert calls[0][0] == "start" and calls[0][1] != os.getpid()
    assert calls[1:] == [*[["node", f"n{i}"] for i in range(5)],
                         ["step", 0, {"reward/mean": 0.5}, table.to_pylist()],
                         ["artifact", "/models/final"], ["end", "FINISHED"]]
    assert obs.spooled is None


def test_a_full_queue_makes_the_caller_wait_instead_of_growing(tmp_path):
    out = tmp_path / "calls.jsonl"
    obs = ProcessObserver(partial(FileRecorder, str(out), delay_s=0.3), drain_timeout_s=60, max_queued=1)
    obs.on_run_start({}, "", {})
    big = "x" * 200_000  # larger than the pipe's buffer: the pipe holds no whole call
    started = time.perf_counter()
    for i in range(6):
        obs.on_node_end(f"{i}{big}")
    # one call in the writer, one in its queue, one held by the relay: the rest waited for room
    assert time.perf_counter() - started >= 0.3
    obs.on_run_end("FINISHED")
    assert [c[1][0] for c in _calls(out) if c[0] == "node"] == [str(i) for i in range(6)]


def test_a_start_failure_is_raised_in_the_training_process(tmp_path):
    obs = ProcessObserver(partial(FileRecorder, str(tmp_path / "calls.jsonl"), fail_start=True), drain_timeout_s=60)
    with pytest.raises(ValueError, match="no store here"):
        obs.on_run_start({}, "", {})


def test_a_start_that_hangs_fails_the_run_at_the_start_timeout_and_stops_the_child(tmp_path):
    from rlpipe.engine.tracking.process_observer import TrackingProcessError

    obs = ProcessObserver(partial(FileRecorder, str(tmp_path / "calls.jsonl"), hang_start=True), drain_timeout_s=60,
                          start_timeout_s=2)
    began = time.monotonic()
    with pytest.raises(TrackingProcessError, match="tracking.start_timeout_s=2 s"):
        obs.on_run_start({}, "", {})
    assert time.monotonic() - began < 30  # the bound, the child's stop and the listener's join; not the hour
    assert not obs._process.is_alive()
    obs.on_node_end("after")  # ignored with a warning: the child is gone
    obs.on_run_end("FAILED")  # returns at once


def test_the_tracking_process_logs_through_this_process_loggers(tmp_path, caplog):
    obs = ProcessObserver(partial(FileRecorder, str(tmp_path / "calls.jsonl")), drain_timeout_s=60)
    obs.on_run_start({}, "", {})
    obs.on_node_end("warn")
    obs.on_run_end("FINISHED")
    assert any(r.name == "rlpipe.test_child" and "a warning from the tracking process" in r.getMessage()
               for r in caplog.records)


def test_a_training_process_that_dies_leaves_its_run_killed(tmp_path):
    out = tmp_path / "calls.jsonl"
    script = f"""
import os, sys
from functools import partial
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_process_observer import FileRecorder
from rlpipe.engine.tracking.process_observer import ProcessObserver
obs = ProcessObserver(partial(FileRecorder, {str(out)!r}), drain_timeout_s=60)
obs.on_run_start({{}}, "", {{}})
obs.on_node_end("n0")
os._exit(1)  # no run end: a crash
"""
    subprocess.run([sys.executable, "-c", script], check=False, timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(c[0] == "end" for c in _calls(out)):
        time.sleep(0.2)
    calls = _calls(out)
    assert calls[1:] == [["node", "n0"], ["end", "KILLED"]]
