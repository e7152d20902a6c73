"""The background observer applies calls in order off the caller's thread and drains at run end."""

from __future__ import annotations

import threading
import time

from rlpipe.engine.tracking.background_observer import BackgroundObserver


class SlowRecorder:
    def __init__(self, fail_on: str | None = None):
        self.calls: list[tuple] = []
        self.threads: set[str] = set()
        self.fail_on = fail_on

    def on_run_start(self, config, pipeline_yaml, plan_summary):
        self.calls.append(("start",))
        return "run-1"

    def on_node_end(self, record):
        time.sleep(0.01)  # a slow tracking backend
        self.threads.add(threading.current_thread().name)
        if record == self.fail_on:
            raise ConnectionError("tracking server went away")
        self.calls.append(("node", record))

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None):
        self.calls.append(("step", step, metrics["reward/mean"]))

    def on_artifact(self, local_path, artifact_path=None):
        self.calls.append(("artifact", local_path))

    def on_run_end(self, status, error=None):
        self.calls.append(("end", status))


def test_calls_are_applied_in_order_off_thread_and_drained_by_run_end():
    inner = SlowRecorder()
    obs = BackgroundObserver(inner)
    assert obs.on_run_start({}, "", {}) == "run-1"
    started = time.perf_counter()
    for i in range(10):
        obs.on_node_end(f"n{i}")
    metrics = {"reward/mean": 0.5}
    obs.on_step_end(0, metrics, None)
    metrics["reward/mean"] = 9.0  # the caller may reuse its dict: the observer logged a copy
    obs.on_artifact("/models/final")
    assert time.perf_counter() - started < 0.05, "the caller did not wait for the slow backend"
    obs.on_run_end("FINISHED")
    assert inner.calls == [("start",), *[("node", f"n{i}") for i in range(10)], ("step", 0, 0.5),
                           ("artifact", "/models/final"), ("end", "FINISHED")]
    assert inner.threads == {"rlpipe-observer"}


def test_a_failing_call_is_logged_and_the_rest_still_applied():
    inner = SlowRecorder(fail_on="n1")
    obs = BackgroundObserver(inner)
    obs.on_run_start({}, "", {})
    for i in range(3):
        obs.on_node_end(f"n{i}")
    obs.on_run_end("FAILED", "boom")
    assert inner.calls == [("start",), ("node", "n0"), ("node", "n2"), ("end", "FAILED")]
