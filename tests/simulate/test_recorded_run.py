"""``rlpipe simulate`` on a real recorded run (the shared inline quickstart run: 4 steps, MLflow lineage)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlpipe.cli import main
from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.simulate import simulate_recording


def test_calibrates_on_the_run_and_predicts_its_own_config(inline_run):
    result = simulate_recording(inline_run.run_id, steps=30, tracking_uri=inline_run.tracking_uri)
    cal, p = result.calibration, result.prediction
    assert cal.generate_source == "calls" and cal.warmup_steps == [0]
    assert set(cal.nodes) == {"reward", "balance", "old_log_prob", "advantage", "update", "weight_sync"}
    assert cal.workers["update"].startswith("actor") and len(cal.group_lengths) == 4 * 4
    assert all(len(g) == 8 for g in cal.group_lengths) and cal.length_cap == 2
    assert cal.measured.steps == 3 and cal.measured.mean_staleness == 1.0
    # the same config, simulated: its step is the recorded nodes' mean durations and gaps, as measured
    assert p.steps_per_s == pytest.approx(cal.measured.steps_per_s, rel=0.2)
    assert p.verdict == "ok" and p.mean_staleness == 1.0 and p.steps_done == 30


def test_cli_json_and_the_written_config_runs_as_simulated(inline_run, tmp_path, capsys):
    path = tmp_path / "simulated.yaml"
    code = main(["simulate", inline_run.run_id[:8], "--tracking-uri", inline_run.tracking_uri, "--json",
                 "--steps", "20", "-o", "mode=separate_async", "-o", "mode_params.max_off_policy_threshold=2",
                 "--write-config", str(path), "--log"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)  # --log keeps stdout one JSON object
    assert {"steps_per_s", "samples_per_s", "mean_staleness", "max_staleness", "busy_share", "verdict",
            "recorded"} <= set(out)
    assert out["mode"] == "separate_async" and out["max_staleness"] <= 2 and "rollout[0]" in out["busy_share"]
    assert out["samples_per_s"] == pytest.approx(out["steps_per_s"] * 4 * 8)
    config, _ = load_pipeline(path)  # what `rlpipe run` would read
    assert config.mode == "separate_async" and config.mode_params["max_off_policy_threshold"] == 2
    assert [s.kind for s in config.stages][:3] == ["generate", "reward", "staleness_guard"]
    # --log: the figure and the same JSON, next to the recorded run in MLflow
    client = MlflowClient(inline_run.tracking_uri)
    stem = "simulate/mode=separate_async,mode_params.max_off_policy_threshold=2"
    assert {f.path for f in client.list_artifacts(inline_run.run_id, "simulate")} >= {f"{stem}.png", f"{stem}.json"}
    logged = json.loads(Path(client.download_artifacts(inline_run.run_id, f"{stem}.json", str(tmp_path))).read_text())
    assert logged == out
    png = Path(client.download_artifacts(inline_run.run_id, f"{stem}.png", str(tmp_path))).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000  # a drawn figure, not an empty canvas


def test_cli_table_and_an_invalid_override(inline_run, capsys):
    assert main(["simulate", inline_run.run_id, "--tracking-uri", inline_run.tracking_uri, "--steps", "10",
                 "-o", "resources.rollout_replicas=2"]) == 0
    out = capsys.readouterr().out
    assert "steps/s" in out and "busy: rollout[1]" in out and "verdict: ok" in out
    assert main(["simulate", inline_run.run_id, "--tracking-uri", inline_run.tracking_uri,
                 "-o", "data.prompts_per_step=0"]) == 2
    assert "data.prompts_per_step" in capsys.readouterr().err
