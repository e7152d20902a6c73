"""separate_async end to end on Ray: rollout service threads in the rollout actor, the replay buffer
actor, the staleness guard, and per-trajectory lineage in MLflow."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from conftest import quickstart_raw
from rlpipe.engine.tracking import runs
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline

pytestmark = pytest.mark.e2e


def test_separate_async_on_ray_bounds_staleness_and_records_trajectory_lineage(ray_session, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    raw = quickstart_raw(
        name="e2e-async", mode="separate_async",
        mode_params={"max_off_policy_threshold": 2, "strategy": "drop", "capacity_steps": 2},
        data={"prompts_per_step": 4}, trainer={"total_steps": 4, "output_dir": str(tmp_path / "out")},
        tracking={"uri": uri, "experiment": "rlpipe-async"},
    )
    stages = []
    for stage in raw["stages"]:
        if stage["kind"] == "generate":
            stage = {**stage, "params": {"n": 4, "max_tokens": 16, "ignore_eos": True,
                                         "length_distribution": "pareto", "min_tokens": 2}}
        if stage["kind"] == "balance":
            stages.append({"kind": "staleness_guard", "impl": "max_staleness"})
        stages.append(stage)
    raw["stages"] = stages
    result = run_pipeline(validate_config(raw), "name: e2e-async\n")

    run = MlflowClient(uri).get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlpipe.mode"] == "separate_async"
    client = MlflowClient(uri)
    staleness = client.get_metric_history(result.run_id, "staleness_guard/staleness/max")
    assert len(staleness) == 4 and all(m.value <= 2 for m in staleness)

    trajectories = runs._read_parquet_artifact(client, result.run_id, "lineage/trajectories.parquet").to_pylist()
    assert len(trajectories) == 4 * 4 * 4  # steps × prompts × samples
    for t in trajectories:
        assert t["consumed_step"] - t["prompt_step"] + 1 <= 2
        assert t["min_version"] <= t["max_version"] <= t["consumed_step"]
    nodes = {r["node"] for r in runs.lineage_table(result.run_id, uri).to_pylist()}
    assert {"generate", "reward", "staleness_guard", "update", "weight_sync"} <= nodes
