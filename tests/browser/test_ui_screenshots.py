"""The MLflow UI on a real recorded run, in headless Chromium: the run page and a step's trace.

Not in the default test command (it needs Debian's `chromium` and starts an MLflow server):
run it with `make ui-check` (= `pytest -m browser tests/browser`). Screenshots land in
$RLPIPE_SCREENSHOTS (default: the test's temporary folder) for a person to look at.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlpipe.engine.tracking import runs, traces

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ui(inline_run):
    """`mlflow server` on the recorded run's store; yields its address."""
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", inline_run.tracking_uri,
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    address = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if urllib.request.urlopen(f"{address}/health", timeout=2).read() == b"OK":
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not become healthy in 90 s")
        yield address
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the CLI and the uvicorn it started
        server.wait(timeout=30)


def browse(url: str, screenshot: Path) -> str:
    """Screenshot of ``url`` and the text of its DOM once the page's scripts settled."""
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1600,1000",
              "--virtual-time-budget=25000"]
    subprocess.run([*common, f"--screenshot={screenshot}", url], check=True, capture_output=True, timeout=180)
    dom = subprocess.run([*common, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=180).stdout
    return html.unescape(" ".join(re.sub(r"<[^>]+>", " ", dom).split()))


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("RLPIPE_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_run_page_opens_on_the_training_run(ui, inline_run, shots):
    route = runs.ui_route(inline_run.run_id, inline_run.tracking_uri)
    text = browse(f"{ui}/{route}", shots / "run.png")
    assert "inline-lineage" in text and "Model training" in text and "Finished" in text
    for node in ("generate", "advantage", "update"):  # the node runs, listed as child runs
        assert node in text
    assert (shots / "run.png").stat().st_size > 20_000


def test_a_step_trace_shows_the_step_dag(ui, inline_run, shots):
    run = runs.client(inline_run.tracking_uri).get_run(inline_run.run_id)
    trace = traces.step_traces(run.info.experiment_id, inline_run.run_id, inline_run.tracking_uri)[2]
    route = runs.ui_route(inline_run.run_id, inline_run.tracking_uri).replace("?", "/traces?")
    text = browse(f"{ui}/{route}&selectedEvaluationId={trace.info.trace_id}", shots / "trace.png")
    assert "step 2" in text
    for node in ("generate", "reward", "balance", "old_log_prob", "advantage", "update", "weight_sync"):
        assert node in text, node
    assert (shots / "trace.png").stat().st_size > 20_000


def test_trajectories_open_as_a_table(ui, inline_run, shots):
    route = runs.ui_route(inline_run.run_id, inline_run.tracking_uri).replace("?", "/artifacts/tables/trajectories.json?")
    text = browse(f"{ui}/{route}", shots / "trajectories_table.png")
    assert "View as table" in text
    for column in ("step", "uid", "sample_index", "prompt", "response", "reward"):
        assert f" {column} " in f" {text} ", column
