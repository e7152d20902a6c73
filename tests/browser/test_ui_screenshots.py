"""The MLflow UI on a real recorded run, in headless Chromium: the run page, a step's trace as a timeline,
the trajectories table.

Not in the default test command (it needs Debian's `chromium` and starts an MLflow server):
run it with `make ui-check` (which installs chromium when it is missing, then runs
`pytest -m browser tests/browser`). Screenshots land in $RLPIPE_SCREENSHOTS (default: the
test's temporary folder) for a person to look at.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from chromium import Chromium
from rlpipe.engine.tracking import runs, traces

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STEP_DAG = ("generate", "reward", "balance", "old_log_prob", "advantage", "update", "weight_sync")


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


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium: `make ui-check` installs it (apt-get install chromium)")
    chrome = Chromium(CHROMIUM)
    yield chrome
    chrome.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("RLPIPE_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def has_text(*words: str) -> str:
    """A JavaScript condition: the page's text holds every one of ``words``."""
    checks = " && ".join(f"t.includes({w!r})" for w in words)
    return f"(() => {{ const t = document.body ? document.body.innerText : ''; return {checks}; }})()"


def close_assistant(browser: Chromium) -> None:
    """Close MLflow 3.17's assistant side panel, which covers a third of the page (when it is there)."""
    close = '[data-component-id="mlflow.assistant.chat_panel.close"]'
    if browser.evaluate(f"document.querySelector({close!r}) !== null"):
        click(browser, close)


def test_run_page_opens_on_the_training_run(ui, browser, inline_run, shots):
    browser.open(f"{ui}/{runs.ui_route(inline_run.run_id, inline_run.tracking_uri)}")
    browser.wait_for(has_text("inline-lineage", "Finished", "weight_sync"), "the run page")
    close_assistant(browser)
    time.sleep(1)
    browser.screenshot(shots / "run.png")
    text = browser.text()
    assert "Model training" in text and inline_run.run_id in text
    for node in STEP_DAG:  # the node runs, listed as child runs
        assert node in text, node
    assert (shots / "run.png").stat().st_size > 20_000


def click(browser: Chromium, selector: str) -> None:
    """Click the element ``selector`` finds (it must be on the page)."""
    box = browser.evaluate(f"(() => {{ const r = document.querySelector({selector!r}).getBoundingClientRect();"
                           " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
    browser.click_at(*box)


def click_text(browser: Chromium, text: str) -> None:
    """Click the element on top whose whole text is ``text`` (a span in the tree, a tab): one a person can see,
    not the same word in a table the trace view covers."""
    box = browser.evaluate(f"""(() => {{
        for (const e of [...document.querySelectorAll('body *')].reverse()) {{
            if (!e.innerText || e.innerText.trim() !== {text!r}) continue;
            const r = e.getBoundingClientRect();
            const x = r.x + r.width / 2, y = r.y + r.height / 2;
            const top = r.width && r.height && document.elementFromPoint(x, y);
            if (top && (top === e || e.contains(top) || top.contains(e))) return [x, y];
        }}
        return null;
    }})()""")
    assert box, f"nothing visible reads {text!r}"
    browser.click_at(*box)


def test_a_step_trace_shows_the_step_dag_as_a_timeline(ui, browser, inline_run, shots):
    run = runs.client(inline_run.tracking_uri).get_run(inline_run.run_id)
    trace = traces.step_traces(run.info.experiment_id, inline_run.run_id, inline_run.tracking_uri)[2]
    route = runs.ui_route(inline_run.run_id, inline_run.tracking_uri).replace("?", "/traces?")
    browser.open(f"{ui}/{route}&selectedEvaluationId={trace.info.trace_id}")
    show = '[aria-label="Show execution timeline"]'
    browser.wait_for(f"document.querySelector({show!r}) !== null && " + has_text("step 2", "weight_sync"),
                     "the trace view")
    close_assistant(browser)
    click(browser, '[aria-label="Full screen"]')
    click(browser, show)
    # the timeline: a time axis with tick labels, and the button now hides it
    browser.wait_for("document.querySelector('[aria-label=\"Hide execution timeline\"]') !== null && "
                     "(document.querySelector('[data-testid=\"time-marker-area\"]') || {childElementCount: 0})"
                     ".childElementCount > 1", "the execution timeline")
    text = browser.text()
    positions = [text.find(node) for node in STEP_DAG]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), positions  # the DAG in start order
    # the update span's rlpipe.* attributes in the details pane
    click_text(browser, "update")
    click_text(browser, "Attributes")
    browser.wait_for(has_text("rlpipe.impl", "rlpipe.output_fingerprint", "rlpipe.policy_versions"),
                     "the update span's attributes")
    time.sleep(1)
    browser.screenshot(shots / "trace.png")
    assert (shots / "trace.png").stat().st_size > 20_000


def test_trajectories_open_as_a_table(ui, browser, inline_run, shots):
    route = runs.ui_route(inline_run.run_id, inline_run.tracking_uri).replace("?", "/artifacts/tables/trajectories.json?")
    browser.open(f"{ui}/{route}")
    browser.wait_for(has_text("View as table", "sample_index", "response"), "the trajectories table")
    close_assistant(browser)
    time.sleep(1)
    browser.screenshot(shots / "trajectories_table.png")
    text = f" {browser.text()} "
    for column in ("step", "uid", "sample_index", "prompt", "response", "reward"):
        assert f" {column} " in text, column
    assert " 3-0 " in text  # a row: the uid of the last step's prompt
