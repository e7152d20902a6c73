"""The MLflow observer against a real local sqlite store, read back with the plain MlflowClient."""

from __future__ import annotations

import json
import os
import time

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"

import mlflow  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from rlpipe.engine.tracking import runs, traces  # noqa: E402
from rlpipe.engine.tracking.lineage import LINEAGE_SCHEMA, fingerprint, params_hash, trajectory_lineage  # noqa: E402
from rlpipe.engine.tracking.mlflow_experiment import TrackingError  # noqa: E402
from rlpipe.engine.tracking.mlflow_observer import MLflowObserver  # noqa: E402
from rlpipe.engine.tracking.observer import NodeRecord  # noqa: E402
from rlpipe.schemas.config import TrackingConfig  # noqa: E402

NODES = [("generate", "generate", "hf_generate"), ("reward", "reward", "rule"), ("update", "update", "ppo")]
CONFIG = {"name": "demo", "mode": "sync", "trainer": {"lr": 1e-6, "total_steps": 2}, "stages": [{"kind": "generate", "impl": "hf_generate"}]}
PIPELINE_YAML = "# rlpipe run pipelines/demo.yaml\nname: demo\n"
SUMMARY = {"mode": "sync", "nodes": [{"name": n, "kind": k, "impl": i} for n, k, i in NODES]}


def trajectories(step: int) -> pa.Table:
    return pa.table(
        {
            "uid": [f"s{step}p{i // 2}" for i in range(4)],
            "response_ids": pa.array([[1, 2], [3], [4, 5, 6], [7]], pa.list_(pa.int32())),
            "token_versions": pa.array([[step, step], [step], [step] * 3, [step]], pa.list_(pa.int32())),
            "reward": pa.array([1.0, 0.0, 0.5, float(step)], pa.float32()),
        }
    )


def node_record(run_id: str, step: int, node: str, kind: str, impl: str) -> NodeRecord:
    table = trajectories(step)
    params = {"temperature": 1.0, "max_tokens": 8, "clip": {"low": 0.2}} if node != "reward" else {"scorer": "exact"}
    return NodeRecord(
        run_id=run_id, step=step, node=node, kind=kind, impl=impl, params=params, params_hash=params_hash(params),
        code_hash=f"code-{impl}", input_fingerprint="" if node == "generate" else fingerprint(table.slice(1)),
        output_fingerprint=fingerprint(table), rows_in=4, rows_out=4, policy_versions=[step], trainer_version=step,
        start_time=time.time(), duration_s=0.1 * (1 + len(node)), metrics={f"{kind}/loss": 0.5 + step, f"{kind}/n": 4},
    )


def feed(obs: MLflowObserver, run_id: str, steps, nodes=NODES, step_end: bool = True) -> None:
    for step in steps:
        for node, kind, impl in nodes:
            obs.on_node_end(node_record(run_id, step, node, kind, impl))
        if step_end:
            obs.on_step_end(step, {"reward/mean": 0.1 * step, "step": step, "timing/reward_s": 0.01},
                            trajectories(step), trajectory_lineage(trajectories(step), step))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module: creating its tables costs ~2 s."""
    root = tmp_path_factory.mktemp("mlflow")
    return root, f"sqlite:///{root}/mlflow.db"


@pytest.fixture(scope="module")
def finished(store):
    """A finished two-step, three-node run with a saved model directory."""
    root, uri = store
    obs = MLflowObserver(TrackingConfig(uri=uri, experiment="obs", sample_trajectories=3), "demo")
    run_id = obs.on_run_start(CONFIG, PIPELINE_YAML, SUMMARY)
    feed(obs, run_id, [0, 1])
    model = root / "out" / "final"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    obs.on_artifact(str(model), "model/final")
    obs.on_run_end("FINISHED")
    return obs, run_id, MlflowClient(tracking_uri=uri), root


def artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for f in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, f.path) if f.is_dir else {f.path}
    return out


def test_parent_run(finished):
    obs, run_id, client, root = finished
    assert obs.failures == []
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "demo"
    assert run.data.tags["rlpipe.role"] == "pipeline"
    assert run.data.tags["rlpipe.mode"] == "sync"
    assert run.data.tags["rlpipe.nodes"] == "generate,reward,update"
    assert run.data.params["trainer.lr"] == "1e-06"
    assert run.data.params["stages.0.impl"] == "hf_generate"
    assert run.info.artifact_uri.startswith(str(root))  # artifacts next to the sqlite file
    hist = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == [(0, 0.0), (1, 0.1)]
    timing = client.get_metric_history(run_id, "timing/reward_s")  # one timing metric per node: the records' sum
    assert [round(m.value, 6) for m in sorted(timing, key=lambda m: m.step)] == [0.7, 0.7]
    assert not any(k.startswith("timing/") and not k.endswith("_s") for k in run.data.metrics)


def test_experiment_opens_on_training_runs(finished):
    obs, _, client, _ = finished
    assert client.get_experiment(obs.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_each_step_is_a_trace_of_its_node_executions(finished):
    obs, run_id, client, _ = finished
    found = traces.step_traces(obs.experiment_id, run_id, obs.tracking_uri)
    assert sorted(found) == [0, 1]
    for step, trace in found.items():
        assert trace.info.request_metadata["mlflow.sourceRun"] == run_id  # linked to the run
        assert trace.info.tags["rlpipe.run_id"] == run_id and trace.info.state.value == "OK"
        root = next(s for s in trace.data.spans if s.parent_id is None)
        spans = [s for s in trace.data.spans if s.parent_id is not None]
        assert root.name == f"step {step}" and [s.name for s in spans] == [n for n, _, _ in NODES]
        assert root.start_time_ns <= min(s.start_time_ns for s in spans)
        assert root.end_time_ns >= max(s.end_time_ns for s in spans)
        for span, (node, kind, impl) in zip(spans, NODES):
            a = span.attributes
            assert (a["rlpipe.kind"], a["rlpipe.impl"], a["rlpipe.rows_out"]) == (kind, impl, 4)
            assert a["rlpipe.output_fingerprint"] == fingerprint(trajectories(step))
            assert a["rlpipe.policy_versions"] == [step] and a["rlpipe.trainer_version"] == step
            assert a[f"rlpipe.metric.{kind}/loss"] == 0.5 + step
            assert "rlpipe.worker" in a and "rlpipe.error" not in a
            assert abs((span.end_time_ns - span.start_time_ns) / 1e9 - a["rlpipe.duration_s"]) < 1e-3
        assert spans[0].span_type == "LLM" and spans[1].span_type == "EVALUATOR"


def test_trajectories_and_lineage_are_tables_the_ui_renders(finished):
    obs, run_id, client, _ = finished
    logged = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "tables/trajectories.json", "type": "table"} in logged
    assert {"path": "tables/lineage.json", "type": "table"} in logged
    # MlflowClient.load_table searches through the *global* store (mlflow.search_runs), as mlflow.load_table does
    mlflow.set_tracking_uri(obs.tracking_uri)
    traj = client.load_table(obs.experiment_id, "tables/trajectories.json", run_ids=[run_id])
    assert len(traj) == 6 and traj["step"].tolist() == [0, 0, 0, 1, 1, 1]
    assert {"prompt", "response", "reward", "advantage", "min_version", "max_version", "status"} <= set(traj.columns)
    assert traj["reward"].tolist()[:3] == [1.0, 0.0, 0.5] and traj["max_version"].tolist()[3:] == [1, 1, 1]
    lineage = client.load_table(obs.experiment_id, "tables/lineage.json", run_ids=[run_id])
    assert lineage[["step", "node"]].values.tolist() == [[s, n] for s in (0, 1) for n, _, _ in NODES]
    assert set(lineage["output_fingerprint"]) == {fingerprint(trajectories(s))[:12] for s in (0, 1)}


def test_figures(finished):
    _, run_id, client, _ = finished
    assert {f.path for f in client.list_artifacts(run_id, "figures")} == {
        "figures/reward.png", "figures/stage_time.png", "figures/staleness.png", "figures/token_versions.png"}


def test_node_runs(finished):
    obs, run_id, client, _ = finished
    children = client.search_runs([client.get_run(run_id).info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'")
    assert sorted(r.info.run_name for r in children) == ["generate", "reward", "update"]
    for r in children:
        node = r.info.run_name
        kind, impl = {n: (k, i) for n, k, i in NODES}[node]
        assert r.info.status == "FINISHED"
        tags = r.data.tags
        assert (tags["rlpipe.kind"], tags["rlpipe.impl"], tags["rlpipe.node"]) == (kind, impl, node)
        assert tags["rlpipe.code_hash"] == f"code-{impl}" and tags["rlpipe.role"] == "node"
        if node == "reward":
            assert r.data.params == {"scorer": "exact"}
            assert tags["rlpipe.params_hash"] == params_hash({"scorer": "exact"})
        else:
            assert r.data.params == {"temperature": "1.0", "max_tokens": "8", "clip.low": "0.2"}
        loss = sorted(client.get_metric_history(r.info.run_id, f"{kind}/loss"), key=lambda m: m.step)
        assert [(m.step, m.value) for m in loss] == [(0, 0.5), (1, 1.5)]
        for key in ("duration_s", "rows_out", "rows_in", "policy_version/max"):
            assert len(client.get_metric_history(r.info.run_id, key)) == 2, key


def test_artifacts(finished, tmp_path):
    _, run_id, client, _ = finished
    paths = artifact_paths(client, run_id)
    assert {"pipeline.yaml", "resolved_config.json", "plan_summary.json", "plan_dag.svg", "lineage/lineage.parquet",
            "trajectories/step_000000.parquet", "trajectories/step_000001.parquet",
            "model/final/config.json", "model/final/model.safetensors"} <= paths
    assert client.download_artifacts(run_id, "pipeline.yaml", str(tmp_path)).endswith("pipeline.yaml")
    assert (tmp_path / "pipeline.yaml").read_text() == PIPELINE_YAML
    assert json.loads(open(client.download_artifacts(run_id, "resolved_config.json", str(tmp_path))).read()) == CONFIG
    traj = pq.read_table(client.download_artifacts(run_id, "trajectories/step_000001.parquet", str(tmp_path)))
    assert traj.num_rows == 3 and traj.column("uid").to_pylist() == ["s1p0", "s1p0", "s1p1"]
    tag = client.get_run(run_id).data.tags["rlpipe.artifact.model/final"]
    assert tag.endswith("/model/final")


def test_lineage_table(finished, tmp_path):
    _, run_id, client, _ = finished
    table = pq.read_table(client.download_artifacts(run_id, "lineage/lineage.parquet", str(tmp_path)))
    assert table.schema == LINEAGE_SCHEMA
    assert table.num_rows == 6
    rows = table.to_pylist()
    assert [(r["step"], r["node"]) for r in rows] == [(s, n) for s in (0, 1) for n, _, _ in NODES]
    for r in rows:
        assert r["run_id"] == run_id and r["rows_out"] == 4 and r["policy_versions"] == [r["step"]]
        assert r["output_fingerprint"] == fingerprint(trajectories(r["step"]))
        assert json.loads(r["params"])  # params as JSON
        assert json.loads(r["metrics"])[f"{r['kind']}/loss"] == 0.5 + r["step"]
    assert rows[0]["input_fingerprint"] == "" and rows[1]["input_fingerprint"]


def test_reader_api(finished, store):
    _, run_id, _, _ = finished
    _, uri = store
    assert runs.latest_run(uri, "obs").info.run_id == run_id
    nodes = runs.node_runs(run_id, uri)
    assert sorted(nodes) == ["generate", "reward", "update"]
    assert runs.lineage_table(run_id, uri).num_rows == 6
    df = runs.metric_history(run_id, "reward/mean", uri)
    assert list(df.columns) == ["step", "value", "timestamp"] and df["step"].tolist() == [0, 1]
    assert runs.trajectories(run_id, 0, uri).num_rows == 3
    with pytest.raises(runs.RunNotFoundError, match="no MLflow experiment 'nope'"):
        runs.latest_run(uri, "nope")


def test_failed_run_keeps_everything_then_resumes(store, tmp_path):
    _, uri = store
    cfg = TrackingConfig(uri=uri, experiment="failing", sample_trajectories=2)
    obs = MLflowObserver(cfg, "crashy")
    run_id = obs.on_run_start(CONFIG, PIPELINE_YAML, SUMMARY)
    feed(obs, run_id, [0])
    feed(obs, run_id, [1], nodes=NODES[:2], step_end=False)  # dies inside step 1
    obs.on_run_end("FAILED", "StageError: stage 'update' (impl 'ppo') failed at step 1: boom")
    obs.on_run_end("FINISHED")  # a second end is ignored
    assert obs.failures == []

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and "boom" in run.data.tags["rlpipe.error"]
    assert "error.txt" in artifact_paths(client, run_id)
    children = runs.node_runs(run_id, uri)
    assert sorted(children) == ["generate", "reward", "update"]
    assert {r.info.status for r in children.values()} == {"FAILED"}
    lineage = runs.lineage_table(run_id, uri)
    assert lineage.num_rows == 5  # step 1's records arrived without a step end: still persisted
    assert len(client.get_metric_history(children["reward"].info.run_id, "duration_s")) == 2
    failed = traces.step_traces(obs.experiment_id, run_id, uri)
    assert sorted(failed) == [0, 1] and failed[0].info.state.value == "OK"
    assert failed[1].info.state.value == "ERROR"  # the step that died still shows on the timeline

    # Resume from the step-1 checkpoint: same MLflow runs, step 1 re-executed and its rows replaced.
    obs2 = MLflowObserver(cfg, "crashy", resume_run_id=run_id)
    assert obs2.on_run_start(CONFIG, PIPELINE_YAML, SUMMARY) == run_id
    feed(obs2, run_id, [1])
    obs2.on_run_end("FINISHED")
    assert obs2.failures == []
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.tags["rlpipe.resumes"] == "1"
    assert len(runs.node_runs(run_id, uri)) == 3
    lineage = runs.lineage_table(run_id, uri)
    assert sorted(zip(lineage.column("step").to_pylist(), lineage.column("node").to_pylist())) == sorted(
        (s, n) for s in (0, 1) for n, _, _ in NODES
    )


def test_tracking_trouble_after_start_is_survived(store):
    _, uri = store
    obs = MLflowObserver(TrackingConfig(uri=uri, experiment="flaky"), "flaky")
    run_id = obs.on_run_start(CONFIG, PIPELINE_YAML, SUMMARY)

    def broken(*args, **kwargs):
        raise ConnectionError("tracking server went away")

    real = obs.client.log_batch
    obs.client.log_batch = broken
    feed(obs, run_id, [0])  # no exception reaches the training loop
    assert obs.failures and "tracking server went away" in obs.failures[0]
    obs.client.log_batch = real
    obs.on_artifact("/definitely/not/here")
    assert "does not exist" in obs.failures[-1]
    obs.on_run_end("FINISHED")
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "FINISHED"


def test_start_failure_says_what_to_do(tmp_path):
    (tmp_path / "blocker").write_text("a file where the store's folder should be")
    uri = f"sqlite:///{tmp_path}/blocker/mlflow.db"
    with pytest.raises(TrackingError, match="tracking.enabled: false"):
        MLflowObserver(TrackingConfig(uri=uri), "x").on_run_start({}, "", {})


def test_tracking_uri_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert runs.resolve_tracking_uri(None) == f"sqlite:///{tmp_path}/mlflow.db"  # MLflow's own default
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert runs.resolve_tracking_uri(None) == "http://tracking:5000"
    assert runs.resolve_tracking_uri("sqlite:///x.db") == "sqlite:///x.db"
    assert MLflowObserver(TrackingConfig(), "x").tracking_uri == "http://tracking:5000"


def test_the_run_end_writes_the_report(finished, tmp_path):
    _, run_id, client, _ = finished
    page = open(client.download_artifacts(run_id, "report.html", str(tmp_path)), encoding="utf-8").read()
    assert 'id="timeline"' in page and page.count('class="bar"') == 3  # step 1's nodes (step 0: warm-up)
    assert page.count('<div class="traj">') == 6 and "tokens are shown as [ids]" in page  # no tokenizer saved


def test_a_report_that_fails_is_a_warning_not_a_failure(store, caplog):
    _, uri = store
    obs = MLflowObserver(TrackingConfig(uri=uri, experiment="obs"), "no-report")
    run_id = obs.on_run_start(CONFIG, PIPELINE_YAML, SUMMARY)
    feed(obs, run_id, [0])

    def broken(status):
        raise ValueError("a bug in the report")

    obs._report = broken
    obs.on_run_end("FINISHED")
    assert obs.failures == []  # not a tracking failure: nothing for the spool
    assert "report.html" not in artifact_paths(obs.client, run_id)
    assert "a bug in the report" in caplog.text and f"rlpipe report {run_id}" in caplog.text
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "FINISHED"
