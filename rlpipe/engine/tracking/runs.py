"""Read rlpipe runs back from MLflow: for users, notebooks and tests.

What :class:`rlpipe.engine.tracking.mlflow_observer.MLflowObserver` writes, read with the
plain MLflow client: the parent run of a pipeline run (tag ``rlpipe.role =
pipeline``), its node runs (``rlpipe.role = node``, nested through
``mlflow.parentRunId``), the lineage table (``lineage/lineage.parquet``),
metric histories and sampled trajectories (``trajectories/step_XXXXXX.parquet``).

Every function takes an optional ``tracking_uri``; None resolves as the observer
does: ``MLFLOW_TRACKING_URI``, else MLflow's own default, ``sqlite:///<cwd>/mlflow.db``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before mlflow is imported
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no download bars in CLI output

import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from mlflow.entities import Run  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from rlpipe.errors import RlpipeError  # noqa: E402

ROLE_TAG = "rlpipe.role"
ROLE_PIPELINE = "pipeline"
ROLE_NODE = "node"
NODE_TAG = "rlpipe.node"
LINEAGE_ARTIFACT = "lineage/lineage.parquet"
TRAJECTORY_LINEAGE_ARTIFACT = "lineage/trajectories.parquet"
LINEAGE_STEPS_DIR = "lineage/steps"
"""Per-step parts of the lineage table, ``step_XXXXXX.parquet``, appended while the run goes."""
TRAJECTORY_LINEAGE_STEPS_DIR = "lineage/trajectories"
"""Per-step parts of the trajectory lineage (by consuming step), appended while the run goes."""
TRAJECTORIES_DIR = "trajectories"
BATCHES_DIR = "batches"


class RunNotFoundError(RlpipeError):
    """No rlpipe run where one was looked for."""


def resolve_tracking_uri(uri: str | None = None) -> str:
    """``uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlflow.db`` (MLflow's default store)."""
    if uri:
        return uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def client(tracking_uri: str | None = None) -> MlflowClient:
    """An MlflowClient on the resolved tracking URI."""
    return MlflowClient(tracking_uri=resolve_tracking_uri(tracking_uri))


def latest_run(tracking_uri: str | None = None, experiment: str = "rlpipe") -> Run:
    """The most recently started pipeline (parent) run of ``experiment``."""
    uri = resolve_tracking_uri(tracking_uri)
    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise RunNotFoundError(
            f"no MLflow experiment {experiment!r} at {uri}; run a pipeline with tracking enabled, "
            "or point MLFLOW_TRACKING_URI (or tracking.uri) at the store that has it"
        )
    runs = c.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`{ROLE_TAG}` = '{ROLE_PIPELINE}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise RunNotFoundError(f"experiment {experiment!r} at {uri} has no rlpipe pipeline run yet; run a pipeline first")
    return runs[0]


def node_runs(run_id: str, tracking_uri: str | None = None) -> dict[str, Run]:
    """The node (child) runs of a pipeline run, by node name, in the order the nodes first ran."""
    c = client(tracking_uri)
    parent = c.get_run(run_id)
    runs = c.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'",
        order_by=["attributes.start_time ASC"],  # node runs are made on first execution: DAG order
        max_results=10_000,
    )
    return {r.data.tags.get(NODE_TAG, r.info.run_name): r for r in runs}


def _read_parquet_artifact(c: MlflowClient, run_id: str, path: str) -> pa.Table:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = c.download_artifacts(run_id, path, tmp)
        except Exception as exc:  # MLflow raises different types per artifact store
            raise RunNotFoundError(
                f"run {run_id} has no artifact {path!r} ({exc}); was it logged by rlpipe with tracking enabled?"
            ) from None
        return pq.read_table(local, memory_map=False)  # fully read before the temp dir goes


def resolved_config(run_id: str, tracking_uri: str | None = None) -> dict:
    """The resolved config (a plain dict) the run was started with (its ``resolved_config.json``)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client(tracking_uri).download_artifacts(run_id, "resolved_config.json", tmp)
        except Exception as exc:  # MLflow raises different types per artifact store
            raise RunNotFoundError(f"run {run_id} has no resolved_config.json ({exc}); was it recorded by "
                                   "rlpipe with tracking enabled?") from None
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def _read_step_parts(c: MlflowClient, run_id: str, folder: str, whole: str) -> pa.Table:
    """A per-step table: its ``step_*.parquet`` parts when the run has them (every recorded step has
    one, the newest write of a step wins, so they are complete even mid-run or after a crash), else
    the whole-run file (runs recorded before parts existed)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            files = sorted(Path(c.download_artifacts(run_id, folder, tmp)).glob("step_*.parquet"))
        except Exception:  # no such folder: MLflow raises different types per artifact store
            files = []
        if files:
            return pa.concat_tables([pq.read_table(f, memory_map=False) for f in files], promote_options="default")
    return _read_parquet_artifact(c, run_id, whole)


def lineage_table(run_id: str, tracking_uri: str | None = None) -> pa.Table:
    """The lineage table of a pipeline run (schema :data:`rlpipe.engine.tracking.lineage.LINEAGE_SCHEMA`)."""
    return _read_step_parts(client(tracking_uri), run_id, LINEAGE_STEPS_DIR, LINEAGE_ARTIFACT)


def trajectory_lineage_table(run_id: str, tracking_uri: str | None = None) -> pa.Table:
    """Every consumed trajectory of a run: uid, versions, prompt and consuming step
    (schema :data:`rlpipe.engine.tracking.lineage.TRAJECTORY_LINEAGE_SCHEMA`)."""
    return _read_step_parts(client(tracking_uri), run_id, TRAJECTORY_LINEAGE_STEPS_DIR, TRAJECTORY_LINEAGE_ARTIFACT)


def table_rows(run_id: str, path: str, tracking_uri: str | None = None) -> list[dict]:
    """The rows of a JSON table artifact (MLflow's ``split`` layout, as ``log_table`` writes); [] if absent."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client(tracking_uri).download_artifacts(run_id, path, tmp)
        except Exception:  # MLflow raises different types per artifact store
            return []
        df = pd.read_json(local, orient="split", dtype=False, convert_dates=False)
        return df.astype(object).where(df.notna(), None).to_dict("records")


def trajectories(run_id: str, step: int, tracking_uri: str | None = None) -> pa.Table:
    """The sampled trajectories logged at ``step``."""
    return _read_parquet_artifact(client(tracking_uri), run_id, f"{TRAJECTORIES_DIR}/step_{step:06d}.parquet")


def metric_history(run_id: str, key: str, tracking_uri: str | None = None, all_attempts: bool = False) -> pd.DataFrame:
    """History of one metric: columns step, value, timestamp (ms), sorted by step then time.

    Metrics are step-keyed: a step run again after a resume (or a tracking spool replayed)
    logs its metrics again at the same step, and MLflow keeps every point. The re-run
    replaces the earlier attempt: one row per step, the last logged (``all_attempts=True``
    returns every point)."""
    hist = client(tracking_uri).get_metric_history(run_id, key)
    df = pd.DataFrame(
        {"step": [m.step for m in hist], "value": [m.value for m in hist], "timestamp": [m.timestamp for m in hist]},
        columns=["step", "value", "timestamp"],
    )
    df = df.sort_values(["step", "timestamp"], kind="stable")
    if not all_attempts:
        df = df.drop_duplicates("step", keep="last")
    return df.reset_index(drop=True)


def ui_route(run_id: str, tracking_uri: str | None = None) -> str:
    """The MLflow UI's route to a run, in its model-training view (append to the UI's address).

    MLflow 3.17's UI chooses between its GenAI and model-training views by a switch kept in
    the browser (default GenAI); ``workflowType=machine_learning`` in the route selects training."""
    run = client(tracking_uri).get_run(run_id)
    return f"#/experiments/{run.info.experiment_id}/runs/{run_id}?workflowType=machine_learning"
