"""`rlpipe replay`: one stage re-run on the batch a real run recorded, as recorded and changed; output checked."""

from __future__ import annotations

from contextlib import redirect_stderr, redirect_stdout
from io import StringIO

import pytest

from rlpipe.cli import main
from rlpipe.engine.replay import replay


def cli(*args: str) -> tuple[int, str, str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "250")
        out, err = StringIO(), StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(args))
    return code, out.getvalue(), " ".join(err.getvalue().split())


def test_recorded_impl_reproduces_the_recorded_output(inline_run):
    r = replay(inline_run.run_id, 2, "advantage", tracking_uri=inline_run.tracking_uri)
    assert r.reproduced is True and r.before == r.after == "advantage/grpo"
    assert r.metrics_before == pytest.approx(r.recorded_metrics)
    assert {c.name for c in r.columns} == {"advantages", "returns"}
    assert all(c.rows_changed == 0 and c.max_abs_diff == 0 for c in r.columns)


def test_another_estimator_on_the_same_rollouts(inline_run):
    code, out, _ = cli("replay", inline_run.run_id[:8], "--tracking-uri", inline_run.tracking_uri,
                       "--step", "2", "--node", "advantage", "-o", "impl=rloo")
    assert code == 0
    assert "node 'advantage': advantage/grpo → advantage/rloo on the recorded batch (32 rows)" in out
    assert "recorded impl reproduces the recorded output: yes (same fingerprint)" in out
    r = replay(inline_run.run_id, 2, "advantage", ["impl=rloo"], inline_run.tracking_uri)
    adv = next(c for c in r.columns if c.name == "advantages")
    assert adv.rows_changed > 0 and adv.max_abs_diff > 0  # RLOO's baseline is not GRPO's: the diff shows it
    row = next(line for line in out.splitlines() if line.startswith("│ advantages"))
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells == ["advantages", f"{adv.rows_changed}/32", f"{adv.mean_before:.4f}", f"{adv.mean_after:.4f}",
                     f"{adv.max_abs_diff:.4g}"]
    # the recorded metrics next to the replayed ones, before and after
    metric = next(line for line in out.splitlines() if line.startswith("│ advantage/advantages_max"))
    recorded, before, after = [c.strip() for c in metric.split("│")[2:5]]
    assert recorded == before == f"{r.recorded_metrics['advantage/advantages_max']:.4g}"
    assert after == f"{r.metrics_after['advantage/advantages_max']:.4g}"


def test_a_param_override(inline_run):
    r = replay(inline_run.run_id, 2, "advantage", ["params.norm_adv_by_std_in_grpo=false"], inline_run.tracking_uri)
    assert r.after == "advantage/grpo" and r.reproduced is True
    assert next(c for c in r.columns if c.name == "advantages").max_abs_diff > 0


def test_what_cannot_be_replayed_says_why(inline_run):
    uri = inline_run.tracking_uri
    code, _, err = cli("replay", "latest", "--tracking-uri", uri, "--step", "1", "--node", "advantage")
    assert code == 2 and "record_batches_every" in err and "Recorded steps: 0, 2." in err
    code, _, err = cli("replay", "latest", "--tracking-uri", uri, "--step", "2", "--node", "update")
    assert code == 2 and "runs on the actor" in err and "replay a task stage" in err
    code, _, err = cli("replay", "latest", "--tracking-uri", uri, "--step", "2", "--node", "advantage", "-o", "impl=nope")
    assert code == 2 and "nope" in err and "rloo" in err  # the registry lists what exists
