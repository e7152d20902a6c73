"""Metrics of steps run again after a resume replace the earlier attempt's (issue 14 part 2): step-keyed
readers return one value per step, the last logged."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.engine.tracking import runs

from conftest import quickstart_raw


def test_rerun_steps_replace_their_metrics(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    raw = quickstart_raw(name="rerun", data={"prompts_per_step": 2},
                         trainer={"total_steps": 3, "checkpoint_every": 1, "keep_checkpoints": 0,
                                  "output_dir": str(tmp_path / "out")},
                         tracking={"uri": uri, "experiment": "rerun"})
    raw["stages"][0]["params"] = {**raw["stages"][0]["params"], "n": 2}
    first = run_pipeline(validate_config(raw), "name: rerun\n", inline=True)
    checkpoint = next((tmp_path / "out").glob("rerun-*/checkpoints/step_1"))

    second: dict[int, float] = {}
    raw["trainer"]["total_steps"] = 4  # a finished run goes on only with --extend (rlpipe.engine.resume)
    run_pipeline(validate_config(raw), "name: rerun\n", inline=True, resume_from=str(checkpoint), extend=True,
                 on_step=lambda step, metrics: second.__setitem__(step, metrics["timing/generate_s"]))
    assert sorted(second) == [1, 2, 3]  # steps 1 and 2 ran twice

    points = MlflowClient(uri).get_metric_history(first.run_id, "timing/generate_s")
    assert sorted(m.step for m in points) == [0, 1, 1, 2, 2, 3]  # MLflow keeps both attempts
    history = runs.metric_history(first.run_id, "timing/generate_s", uri)
    assert history["step"].tolist() == [0, 1, 2, 3]  # one value per step: the re-run's
    assert history.set_index("step")["value"].to_dict() | second == history.set_index("step")["value"].to_dict()
    assert len(runs.metric_history(first.run_id, "timing/generate_s", uri, all_attempts=True)) == 6
