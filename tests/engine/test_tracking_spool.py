"""The observer's drain has a deadline (issue 14 part 1): a tracking server that goes away for good does
not keep the process alive at run end; what was not delivered goes to a spool that `rlpipe spool replay`
sends to MLflow later, so nothing is lost."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pytest
from mlflow.tracking import MlflowClient

from rlpipe.cli import main
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.engine.tracking import runs
from rlpipe.engine.tracking.background_observer import BackgroundObserver
from rlpipe.engine.tracking.spool import SPOOL_NAME, read_spool

from conftest import quickstart_raw


class HangsAfterFirstCall:
    """A tracking backend whose second call never returns (a server that stopped answering)."""

    def __init__(self):
        self.calls, self.release = [], threading.Event()
        self.failures: list[str] = []

    def on_run_start(self, config, pipeline_yaml, plan_summary):
        return "run-hung"

    def on_node_end(self, record):
        if self.calls:
            self.release.wait(60)
        self.calls.append(record)

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None):
        self.calls.append(step)

    def on_artifact(self, local_path, artifact_path=None):
        self.calls.append(local_path)

    def on_run_end(self, status, error=None):
        self.calls.append(status)


def test_run_end_stops_waiting_at_the_deadline_and_spools_what_was_not_delivered(tmp_path):
    inner = HangsAfterFirstCall()
    obs = BackgroundObserver(inner, drain_timeout_s=0.5, spool_path=lambda run_id: tmp_path / run_id / SPOOL_NAME)
    obs.on_run_start({"name": "x"}, "name: x\n", {"mode": "sync"})
    obs.on_node_end("n0")
    obs.on_node_end("n1")  # hangs
    obs.on_step_end(0, {"reward/mean": 0.5}, pa.table({"uid": ["a", "b"]}))
    start = time.monotonic()
    obs.on_run_end("FINISHED")
    # the inner observer hangs for 60 s: ending well before that is stopping at the 0.5 s deadline (a tighter
    # bound measured the loaded machine: 9 s once, in the suite's busiest minute)
    assert time.monotonic() - start < 30
    inner.release.set()
    header, calls = read_spool(tmp_path / "run-hung" / SPOOL_NAME)
    assert header["run_id"] == "run-hung" and header["pipeline_yaml"] == "name: x\n"
    assert [c[0] for c in calls] == ["on_node_end", "on_step_end", "on_run_end"]  # in flight, queued, the end
    assert calls[1][1][2].column("uid").to_pylist() == ["a", "b"]  # the Arrow table survives
    assert calls[2][1] == ["FINISHED", None]
    assert obs.spooled == tmp_path / "run-hung" / SPOOL_NAME


# --- a real `mlflow server` on loopback, killed mid-run -------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(workdir: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", "sqlite:///mlflow.db",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    _stop_server(proc)
    pytest.fail("mlflow server did not become healthy within 120 s")


def _stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the server and its uvicorn worker
    except ProcessLookupError:
        pass
    proc.wait(10)


@pytest.mark.e2e
@pytest.mark.parametrize("retries", ["0", None], ids=["calls-fail-at-once", "calls-retry-past-the-deadline"])
def test_a_vanished_tracking_server_does_not_hang_the_run_and_the_spool_replays_everything(retries, tmp_path,
                                                                                           monkeypatch, caplog):
    # "0": each call to the dead server fails at once (the spool holds the failed calls); None: the default
    # tracking.http_max_retries=2 backs off for seconds per call, so run end meets drain_timeout_s first
    if retries is None:
        monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", retries)
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    server = _start_server(tmp_path, port)
    steps = 4
    raw = quickstart_raw(name="vanishing", data={"prompts_per_step": 2},
                         trainer={"total_steps": steps, "output_dir": str(tmp_path / "out")},
                         tracking={"uri": uri, "experiment": "vanishing", "drain_timeout_s": 5,
                                   "metrics_every_s": 0})  # each step's metrics leave at its end
    raw["stages"][0]["params"] = {**raw["stages"][0]["params"], "n": 2}

    def kill_server_after_step_0(step, metrics):
        if step == 0:  # once step 0's records are on the server (the background observer sends them)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if len(runs.metric_history(runs.latest_run(uri, "vanishing").info.run_id, "step", uri)):
                        break
                except Exception:  # noqa: BLE001 - the run is not in the store yet
                    pass
                time.sleep(0.2)
            _stop_server(server)

    try:
        start = time.monotonic()
        result = run_pipeline(validate_config(raw), "name: vanishing\n", on_step=kill_server_after_step_0,
                              inline=True)
        assert time.monotonic() - start < 120, "the run hung on the dead tracking server"
        spool = Path(result.output_dir) / SPOOL_NAME
        assert spool.exists()
        deadline_met = any("within tracking.drain_timeout_s=5 s" in r.getMessage() for r in caplog.records)
        assert deadline_met == (retries is None)
        assert any(f"rlpipe spool replay {spool}" in r.getMessage() for r in caplog.records)
        _, calls = read_spool(spool)
        assert calls[-1] == ("on_run_end", ["FINISHED", None])

        server = _start_server(tmp_path, port)  # the server comes back, on the same store
        client = MlflowClient(uri)
        assert client.get_run(result.run_id).info.status == "RUNNING"  # its end is in the spool
        assert main(["spool", "replay", str(spool)]) == 0
        assert not spool.exists() and spool.with_name(SPOOL_NAME + ".replayed").exists()

        run = client.get_run(result.run_id)
        assert run.info.status == "FINISHED"
        assert "rlpipe.resumes" not in run.data.tags  # a replay is not a resume
        history = runs.metric_history(result.run_id, "reward/failed_rows", uri)
        assert sorted(history["step"]) == list(range(steps))  # one point per step: nothing lost, nothing doubled
        lineage = runs.lineage_table(result.run_id, uri).to_pylist()
        assert {r["step"] for r in lineage} == set(range(steps))
        assert [r["step"] for r in lineage].count(steps - 1) == 7  # every node of the last step
        trajectories = runs._read_parquet_artifact(client, result.run_id, "lineage/trajectories.parquet")
        assert sorted(set(trajectories.column("consumed_step").to_pylist())) == list(range(steps))
    finally:
        _stop_server(server)
