"""After a resume nothing recorded is lost or doubled (issue 14 part 2): metrics of steps run again replace
the earlier attempt's (step-keyed readers return one value per step, the last logged), and the trajectory
lineage of the steps before the resume is reloaded and kept, with each re-run step's rows replaced."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.engine.tracking import runs

from conftest import quickstart_raw

pytestmark = pytest.mark.slow  # whole tracked runs, resumed: make test, not test-fast

ROWS_PER_STEP = 4  # 2 prompts × n=2


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A 3-step run (steps 0-2), then resumed from its step-1 checkpoint and extended to 4 steps (1-3 again)."""
    tmp_path = tmp_path_factory.mktemp("rerun")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    raw = quickstart_raw(name="rerun", data={"prompts_per_step": 2},
                         trainer={"total_steps": 3, "checkpoint_every": 1, "keep_checkpoints": 0,
                                  "output_dir": str(tmp_path / "out")},
                         tracking={"uri": uri, "experiment": "rerun"})
    raw["stages"][0]["params"] = {**raw["stages"][0]["params"], "n": 2}
    first = run_pipeline(validate_config(raw), "name: rerun\n", inline=True)
    before = runs.trajectory_lineage_table(first.run_id, uri)
    checkpoint = next((tmp_path / "out").glob("rerun-*/checkpoints/step_1"))

    second: dict[int, float] = {}
    raw["trainer"]["total_steps"] = 4  # a finished run goes on only with --extend (rlpipe.engine.resume)
    run_pipeline(validate_config(raw), "name: rerun\n", inline=True, resume_from=str(checkpoint), extend=True,
                 on_step=lambda step, metrics: second.__setitem__(step, metrics["timing/generate_s"]))
    return uri, first, before, second


def test_rerun_steps_replace_their_metrics(resumed):
    uri, first, _, second = resumed
    assert sorted(second) == [1, 2, 3]  # steps 1 and 2 ran twice

    points = MlflowClient(uri).get_metric_history(first.run_id, "timing/generate_s")
    assert sorted(m.step for m in points) == [0, 1, 1, 2, 2, 3]  # MLflow keeps both attempts
    history = runs.metric_history(first.run_id, "timing/generate_s", uri)
    assert history["step"].tolist() == [0, 1, 2, 3]  # one value per step: the re-run's
    assert history.set_index("step")["value"].to_dict() | second == history.set_index("step")["value"].to_dict()
    assert len(runs.metric_history(first.run_id, "timing/generate_s", uri, all_attempts=True)) == 6


@pytest.mark.parametrize("read", ["step parts", "whole-run file"])
def test_trajectory_lineage_survives_the_resume(resumed, read):
    uri, first, before, _ = resumed
    assert sorted(set(before.column("consumed_step").to_pylist())) == [0, 1, 2]
    if read == "step parts":
        after = runs.trajectory_lineage_table(first.run_id, uri)
    else:  # lineage/trajectories.parquet, written at the run's end: it held only the steps since the resume
        after = runs._read_parquet_artifact(MlflowClient(uri), first.run_id, "lineage/trajectories.parquet")
    steps = after.column("consumed_step").to_pylist()
    assert {s: steps.count(s) for s in set(steps)} == {s: ROWS_PER_STEP for s in range(4)}  # kept, not doubled
    step0 = lambda t: sorted(r["uid"] for r in t.to_pylist() if r["consumed_step"] == 0)  # noqa: E731
    assert step0(after) == step0(before)  # the step before the resume is the original's
