"""``rlpipe report`` and the end-of-run ``report.html`` on the shared inline quickstart run (4 steps, MLflow)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rlpipe.cli import main
from rlpipe.engine.tracking import runs


def test_the_run_logged_its_report(inline_run):
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(runs.client(inline_run.tracking_uri).download_artifacts(inline_run.run_id, "report.html", tmp)) \
            .read_text(encoding="utf-8")
    assert 'id="timeline"' in page and page.count('class="bar"') == 3 * 7  # steps 1..3, seven nodes each
    assert 'class="tok ver-3"' in page and 'id="mismatch-scatter"' in page
    assert "FINISHED" in page and "rlpipe report " + inline_run.run_id[:8] in page  # no prediction at the run's end
    assert "tokens are shown as [ids]" not in page  # the run's saved tokenizer decoded them


def test_cli_writes_the_report_with_the_prediction_and_logs_it(inline_run, tmp_path, capsys):
    out = tmp_path / "run.html"
    assert main(["report", inline_run.run_id[:8], "--tracking-uri", inline_run.tracking_uri, "--out", str(out),
                 "--log"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out.replace("\n", "")
    page = out.read_text(encoding="utf-8")
    assert 'id="prediction"' in page and "steps/s" in page and "verdict: <b>ok" in page
    assert page.count('<div class="traj">') == 4 * 4  # 4 sampled steps × 4 trajectories
    assert 16 <= page.count('class="tok ') <= 32  # 1 or 2 response tokens each (max_tokens: 2)
    with tempfile.TemporaryDirectory() as tmp:  # --log replaced the run's report with this one
        logged = Path(runs.client(inline_run.tracking_uri).download_artifacts(inline_run.run_id, "report.html", tmp))
        assert 'id="prediction"' in logged.read_text(encoding="utf-8")
    # a run's output folder names the run
    folder = Path(inline_run.result.output_dir)
    assert main(["report", str(folder), "--tracking-uri", inline_run.tracking_uri, "--out", str(out),
                 "--no-predict"]) == 0
    assert 'id="prediction"' not in out.read_text(encoding="utf-8")


def test_bad_run_is_one_line_and_exit_2(inline_run, tmp_path, capsys):
    assert main(["report", "no-such-run", "--tracking-uri", inline_run.tracking_uri]) == 2
    err = capsys.readouterr().err
    assert "matches no rlpipe run" in err and len(err.strip().splitlines()) == 1
    assert main(["report", str(tmp_path), "--tracking-uri", inline_run.tracking_uri]) == 2
    assert "not a run's output folder" in capsys.readouterr().err
