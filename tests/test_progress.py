"""Progress of `rlpipe run`: start-up phases with durations, one line per step off a terminal, the end summary."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlpipe.progress import BarReporter, LogReporter, RunEnd, reporter, step_figures

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_progress_lines_when_stderr_is_a_file(tmp_path):
    err, out = tmp_path / "stderr.log", tmp_path / "stdout.log"
    cmd = [sys.executable, "-m", "rlpipe.cli", "run", str(ROOT / "pipelines" / "quickstart.yaml"), "--inline",
           "-o", "trainer.total_steps=3", "-o", "data.prompts_per_step=4", "-o", f"trainer.output_dir={tmp_path}/out",
           "-o", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "-o", "tracking.figures_every=0"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    with open(err, "w") as e, open(out, "w") as o:
        subprocess.run(cmd, stdout=o, stderr=e, check=True, cwd=tmp_path, env=env, timeout=600)
    log = err.read_text()
    # start-up phases, each with its duration
    # the MLflow run opens while the workers are built; a wait for it after them is a phase of its own
    for phase in (r"building workers in this process \(MLflow tracking starts beside them\)",
                  "loading data and the first weight sync", r"step 0 \(the first: warm-up\)"):
        assert re.search(rf"\[quickstart\] {phase}: \d+\.\d+s", log), (phase, log)
    # one line per step with the key figures
    steps = re.findall(r"\[quickstart\] step (\d)/3  reward \d\.\d{3}  resp_len \d\.\d(  step_s \d+\.\d\d)?  "
                       r"elapsed \d+s  eta \d+s", log)
    assert [s[0] for s in steps] == ["1", "2", "3"], log
    assert all(s[1] for s in steps[1:])  # step time from the second step on
    summary = out.read_text()
    assert re.search(r"done: 3 steps in \d+\.\ds \(\d+\.\d\d steps/s\), final reward/mean \d\.\d{3}", summary)
    assert re.search(r"model: .*/out/quickstart-\w{8}/final", summary)
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in summary
    assert "MLflow run id: " in summary
    assert re.search(r"then browse: +http://127\.0\.0\.1:5000/#/experiments/\d+/runs/\w{32}\?workflowType=machine_learning",
                     summary)


def test_log_reporter_every_n_steps_and_the_last():
    stream = io.StringIO()
    rep = LogReporter("demo", 5, stream, every=2)
    for step in range(5):
        rep.step(step, {"reward/mean": 0.5, "staleness/mean": 1.25})
    lines = stream.getvalue().splitlines()
    assert [re.search(r"step (\d)/5", line).group(1) for line in lines] == ["2", "4", "5"]
    assert "staleness 1.25" in lines[0] and "reward 0.500" in lines[0]


def test_bar_on_a_terminal_and_lines_otherwise(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(reporter("x", 3, stream=io.StringIO()), LogReporter)
    bar = reporter("x", 3, stream=Tty())
    assert isinstance(bar, BarReporter)
    bar.phase("starting Ray")
    bar.step(0, {"reward/mean": 0.1})
    out = io.StringIO()
    bar.finish(RunEnd(1, 2.0, "/m", None, None, None), out=out)
    assert out.getvalue().startswith("done: 1 steps in 2.0s (0.50 steps/s)")


def test_step_figures_leave_out_what_a_step_lacks():
    assert step_figures({"reward/mean": 0.25, "generate/response_length_mean": 3.0}) == "reward 0.250  resp_len 3.0"
    assert step_figures({"reward/mean": float("nan")}) == ""
