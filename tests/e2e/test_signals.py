"""SIGINT/SIGTERM during `rlpipe run` (issue 14 part 4): one line, no traceback, exit 130/143, the MLflow run
KILLED, every process the run started gone.

SIGTERM (what schedulers send) stops a run on Ray (its workers and Ray's own processes must go); SIGINT stops an
`--inline` run (the same handler, without Ray's start: its tracking process must go)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpipe.engine.tracking import runs

from conftest import ROOT

pytestmark = pytest.mark.e2e


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(("sig", "where"), [(signal.SIGINT, ["--inline"]), (signal.SIGTERM, [])],
                         ids=["SIGINT-inline", "SIGTERM-ray"])
def test_a_signal_stops_the_run_cleanly(sig, where, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("rlpipe")), "run", str(ROOT / "pipelines" / "quickstart.yaml"),
         "-o", "trainer.total_steps=100000", "-o", "data.prompts_per_step=2", "-o", "resources.num_cpus=2",
         "-o", f"trainer.output_dir={tmp_path / 'out'}", "-o", f"tracking.uri={uri}",
         "-o", "tracking.experiment=signals", *where],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        # wait for the first steps in the store (the run is signalled long before 100000 steps: at ~0.1 s a step
        # 500 steps once ended before the background observer's records of step 2 reached the store)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                run = runs.latest_run(uri, "signals")
                if len(runs.metric_history(run.info.run_id, "step", uri)) >= 2:
                    break
            except Exception:  # noqa: BLE001 - the store or the run does not exist yet
                pass
            time.sleep(1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        started = _descendants(proc.pid)
        assert started, "the run started no processes (Ray, the tracking process)?"
        os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    line = f"interrupted: stopped by {signal.Signals(sig).name}; the run is marked KILLED"
    assert stderr.count("stopped by") == 1 and line in stderr, stderr[-3000:]
    assert runs.latest_run(uri, "signals").info.status == "KILLED"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in started):
        time.sleep(0.5)
    left = [p for p in started if _alive(p)]
    assert not left, f"processes left behind: {left}"
