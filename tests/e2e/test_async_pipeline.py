"""separate_async end to end on Ray: rollout service threads in the rollout actor, the replay buffer
actor, the staleness guard, and per-trajectory lineage in MLflow."""

from __future__ import annotations

from contextlib import redirect_stdout
from io import StringIO

import pytest
from mlflow.tracking import MlflowClient

from conftest import quickstart_raw, with_staleness_guard
from rlpipe.cli import main
from rlpipe.engine.tracking import runs, traces
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
        stages.append(stage)
    raw["stages"] = stages
    with_staleness_guard(raw)
    # evaluation beside training: the eval prompts share the replica's service on a lane of their own
    raw["eval"] = {"data": {"source": "digits", "params": {"task": "reverse", "num_digits": 2, "size": 8},
                            "prompts_per_step": 8}, "every": 2, "before_training": True,
                   "params": {"generate": {"n": 2, "temperature": 0.6}}}
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
    lineage = runs.lineage_table(result.run_id, uri).to_pylist()
    assert {"generate", "reward", "staleness_guard", "update", "weight_sync"} <= {r["node"] for r in lineage}
    # three evaluations (before training, after steps 1 and 3), logged at the step whose push they evaluate
    assert {r["node"] for r in lineage if r["node"].startswith("eval.")} == {"eval.generate", "eval.reward"}
    assert [m.step for m in client.get_metric_history(result.run_id, "eval_start/prompts")] == [0]
    evals = {m.step: m.value for m in client.get_metric_history(result.run_id, "eval/policy_version")}
    assert sorted(evals) == [1, 3] and evals[1] >= 2 and evals[3] == 4.0
    # the deferred push ran in the trainer's call after the update; the driver settled it before the next prompts
    pushes = [r for r in lineage if r["node"] == "weight_sync"]
    assert len(pushes) == 4 and all(r["worker"].startswith("driver in actor×1@") for r in pushes), pushes
    # one trace per step; the replica's generation shows in them as spans of its own worker, beside the update
    step_traces = traces.step_traces(run.info.experiment_id, result.run_id, uri)
    assert sorted(step_traces) == [0, 1, 2, 3]
    spans = [s for t in step_traces.values() for s in t.data.spans if s.parent_id]
    assert any(s.attributes["rlpipe.kind"] == "generate" and s.attributes["rlpipe.worker"].startswith("rollout[0]")
               for s in spans)
    assert sum(s.attributes["rlpipe.kind"] == "update" for s in spans) == 4
    # the replicas pulled their prompts themselves (feeders): the lineage still names the one that generated each
    assert {t["replica"] for t in trajectories} == {0}

    # `rlpipe lineage --trajectory` on a trajectory consumed after the step that drew it (stale, async)
    stale = [t for t in trajectories if t["consumed_step"] > t["prompt_step"]] or trajectories
    t = stale[-1]
    out = StringIO()
    with redirect_stdout(out), pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "250")
        assert main(["lineage", result.run_id, "--tracking-uri", uri, "--trajectory", t["uid"]]) == 0
    text = out.getvalue()
    samples = [s for s in trajectories if s["uid"] == t["uid"]]
    step = t["consumed_step"]
    lo, hi = min(s["min_version"] for s in samples), max(s["max_version"] for s in samples)
    assert (f"trajectory {t['uid']}: {len(samples)} sample(s); prompt drawn at step {t['prompt_step']}, "
            f"generated by rollout replica 0, consumed by step {step}") in text, text
    assert f"its tokens came from weights v{lo}..v{hi}" in text, text
    # consumed at step S: the update trains the weights of version S (one push per step) and pushes S + 1
    assert f"it fed update 'update' (ppo) of step {step}, which trained weights v{step}" in text, text
    assert f"→ weight version v{step + 1} pushed by 'weight_sync'" in text, text
