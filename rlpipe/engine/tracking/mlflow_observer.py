"""The MLflow observer: lineage and metrics of a pipeline run in MLflow.

Layout of what it writes (readable with the plain MLflow client, or with
:mod:`rlpipe.engine.tracking.runs`):

* one **parent run** per pipeline run (tag ``rlpipe.role = pipeline``), in
  experiment ``tracking.experiment`` of the store at ``tracking.uri``, else
  ``MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlflow.db``. Tags
  ``rlpipe.<key>`` from the plan summary (``rlpipe.mode``, ``rlpipe.nodes`` ...);
  params = the resolved config flattened to dotted keys; artifacts
  ``pipeline.yaml``, ``resolved_config.json``, ``plan_summary.json``, ``plan_dag.svg`` (the step DAG with its
  call groups, :mod:`~rlpipe.engine.tracking.dag_picture`),
  ``lineage/steps/step_XXXXXX.parquet`` (one row per node execution of that step, see
  :data:`rlpipe.engine.tracking.lineage.LINEAGE_SCHEMA`), ``lineage/trajectories/step_XXXXXX.parquet``
  (the trajectories that step consumed), both gathered at the run's end into
  ``lineage/lineage.parquet`` and ``lineage/trajectories.parquet``; ``trajectories/step_XXXXXX.parquet``
  and whatever :meth:`MLflowObserver.on_artifact` is given (saved models); headline
  metrics per step plus ``timing/<node>_s`` (seconds, summed over the step's executions);
  browsable ``tables/trajectories.json`` and ``tables/lineage.json``
  (:mod:`~rlpipe.engine.tracking.ui_tables`) and ``figures/*.png``
  (:mod:`~rlpipe.engine.tracking.figures`), redrawn every ``tracking.figures_every`` steps
  and at the end; ``report.html`` at the end (:mod:`~rlpipe.engine.tracking.report`); with
  ``tracking.record_batches_every``, ``batches/step_XXXXXX/<node>.parquet`` and ``.json``
  (a node's input and stage context, for ``rlpipe replay``).
* one **trace** per executed step (:mod:`rlpipe.engine.tracking.traces`), linked to
  the parent run: a root span ``step N`` and one span per node execution with its
  recorded start and end, so the UI's trace timeline shows the step DAG (and, in the
  async modes, generation overlapping training). The experiment is tagged
  ``mlflow.experimentKind = custom_model_development`` so the UI opens on its runs.
* one **child run** per DAG node (nested through ``mlflow.parentRunId``, tag
  ``rlpipe.role = node``), created on the node's first record, tagged
  ``rlpipe.kind / impl / node / code_hash / params_hash``, with the impl params
  as MLflow params and per-step metrics: the stage's metrics plus ``duration_s``,
  ``rows_in``, ``rows_out``, ``trainer_version`` and ``policy_version/min|max``.

Cost: the per-step metrics of the pipeline run and of the node runs are buffered and sent
as one ``log_batch`` per run every ``tracking.metrics_every_s`` and at the run's end (a call
costs 20–110 ms on a sqlite store, busy or not; one per run per step was most of the writer's
CPU after the traces). Metrics still unsent when a run ends badly are handed to the tracking
spool as ``on_node_metrics`` calls (:meth:`MLflowObserver.unsent_calls`), so a replay delivers
them. Figures are redrawn at most every ``tracking.figures_min_interval_s`` (a redraw costs
~0.5 s of CPU). Step traces go with the metrics: a ``start_trace`` per step, one ``log_spans`` for all
the queued steps (:func:`~rlpipe.engine.tracking.traces.write_traces`; ~10 ms of CPU per 7-node step
instead of ~37 one by one); a queued trace's step comes back through the spool like a dirty step.
Lineage is appended per step (a part file per step, O(rows of the step); rewriting the
whole table every step was O(steps²)), so a crash loses at most the records of the step in
flight; the whole-run files are written once, at the end.

Tracking trouble never stops training: after the run has started, MLflow or I/O
errors are logged as warnings and kept in :attr:`MLflowObserver.failures`. Only
:meth:`~MLflowObserver.on_run_start` raises
(:class:`~rlpipe.engine.tracking.mlflow_experiment.TrackingError`), because a
run that cannot be tracked at all should not start silently.

Resuming: ``MLflowObserver(..., resume_run_id=id)`` continues an existing parent
run (its node runs and lineage are picked up; a (step, node) executed again
replaces its earlier lineage row).

Left out: async logging (``synchronous=False``), system metrics, MLflow
datasets/``log_input``, model registry entries.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before mlflow is imported

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from mlflow.utils.validation import (  # noqa: E402
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)

from rlpipe.engine.tracking import runs, traces, ui_tables  # noqa: E402
from rlpipe.engine.tracking.dag_picture import dag_svg  # noqa: E402
from rlpipe.engine.tracking.lineage import table_to_records  # noqa: E402
from rlpipe.engine.tracking.mlflow_artifacts import ArtifactWriter  # noqa: E402
from rlpipe.engine.tracking.mlflow_experiment import TrackingError, open_experiment, summary_tags  # noqa: E402
from rlpipe.engine.tracking.mlflow_names import chunks as _chunks  # noqa: E402
from rlpipe.engine.tracking.mlflow_names import flatten as _flatten  # noqa: E402
from rlpipe.engine.tracking.mlflow_names import key as _key  # noqa: E402
from rlpipe.engine.tracking.observer import NodeRecord  # noqa: E402
from rlpipe.errors import RlpipeError  # noqa: E402
from rlpipe.schemas.config import TrackingConfig  # noqa: E402

log = logging.getLogger(__name__)

_STATUSES = ("FINISHED", "FAILED", "KILLED")
PIPELINE_RUN = ""
"""The key of the pipeline run's own buffered metrics among the node runs' (no node has an empty name)."""


class MLflowObserver(ArtifactWriter):
    """An :class:`rlpipe.engine.tracking.observer.Observer` that writes to MLflow (layout in the module docstring)."""

    def __init__(self, tracking: TrackingConfig, run_name: str, *, resume_run_id: str | None = None,
                 tags: dict[str, str] | None = None):
        self.tracking = tracking
        self.tags = dict(tags or {})
        """Extra tags on the parent run (e.g. rlpipe.forked_from)."""
        self.run_name = run_name
        self.resume_run_id = resume_run_id
        self.tracking_uri = runs.resolve_tracking_uri(tracking.uri)
        self.client: MlflowClient | None = None  # made in on_run_start, where a bad store is reported well
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._artifact_uri = ""
        self.failures: list[str] = []
        """Tracking errors survived since the run started (also logged as warnings)."""
        self._node_runs: dict[str, str] = {}
        self._node_hash: dict[str, str] = {}
        # step → (node, start time) → record: a node may run several times in one step
        # (DAPO refill rounds, continuous generation in the async modes)
        self._records: dict[int, dict[tuple[str, float], NodeRecord]] = {}
        self._trajectory_lineage: list[pa.Table] = []
        self._earlier_attempt: set[int] = set()  # steps whose records come from before a resume
        self._traced: set[int] = set()  # steps logged (or queued to be logged) as an MLflow trace
        self._trace_queue: list[tuple[int, str]] = []  # (step, error) of traces written at the next metrics flush
        self._resumed_lineage_steps: set[int] = set()  # consuming steps of trajectory lineage from before a resume
        self._rewards: dict[int, float] = {}  # reward/mean per step, for the figures
        self._trajectory_rows: list[dict] = []  # the browsable trajectories table
        self._dirty_steps: set[int] = set()  # steps whose lineage part is not written yet
        # node (PIPELINE_RUN: the pipeline run itself) → buffered [key, value, ms, step]
        self._node_metrics: dict[str, list[list]] = {}
        self._node_metrics_sent = time.monotonic()
        self._figures_drawn = time.monotonic()
        self._ended = False
        self._lock = threading.RLock()  # the async modes may report from several threads
        self._tmp = Path(tempfile.mkdtemp(prefix="rlpipe-mlflow-"))

    # -- Observer protocol -------------------------------------------------------------------

    def on_run_start(self, config: dict[str, Any], pipeline_yaml: str, plan_summary: dict[str, Any]) -> str:
        with self._lock:
            try:
                self.client = MlflowClient(tracking_uri=self.tracking_uri)
                self.experiment_id = open_experiment(self.client, self.tracking.experiment, self.tracking_uri)
                if self.resume_run_id:
                    self._resume(self.resume_run_id)
                    for k, v in self.tags.items():
                        self.client.set_tag(self.run_id, k, v)
                else:
                    tags = {runs.ROLE_TAG: runs.ROLE_PIPELINE, **summary_tags(plan_summary), **self.tags}
                    run = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=tags)
                    self.run_id = run.info.run_id
                    params = [Param(_key(k), v) for k, v in _flatten(config).items()]
                    for chunk in _chunks(params, MAX_PARAMS_TAGS_PER_BATCH):
                        self.client.log_batch(self.run_id, params=chunk)
                self._artifact_uri = self.client.get_run(self.run_id).info.artifact_uri
                self.client.log_text(self.run_id, pipeline_yaml or "", "pipeline.yaml")
                for name, obj in (("resolved_config.json", config), ("plan_summary.json", plan_summary)):
                    self.client.log_text(self.run_id, json.dumps(obj, indent=2, sort_keys=True, default=str), name)
                if plan_summary.get("nodes"):  # the step DAG with its call groups, drawn from the summary
                    self.client.log_text(self.run_id, dag_svg(plan_summary), "plan_dag.svg")
            except RlpipeError:
                raise
            except Exception as exc:
                raise TrackingError(
                    f"cannot start MLflow tracking at {self.tracking_uri} (experiment {self.tracking.experiment!r}): "
                    f"{type(exc).__name__}: {exc}. Check tracking.uri / MLFLOW_TRACKING_URI (is the server up?), "
                    "or set tracking.enabled: false for a throwaway run"
                ) from exc
            log.info("MLflow run %s (%s) at %s", self.run_id, self.run_name, self.tracking_uri)
            return self.run_id

    def on_node_end(self, record: NodeRecord) -> None:
        with self._lock:
            if not self._accepting("on_node_end"):
                return
            if record.step in self._earlier_attempt:  # a resumed run re-runs this step: its records replace the old
                self._earlier_attempt.discard(record.step)
                self._traced.discard(record.step)
                self._records.pop(record.step, None)
            self._records.setdefault(record.step, {})[(record.node, record.start_time)] = record
            self._dirty_steps.add(record.step)
            self._guard(f"logging node {record.node!r} step {record.step}", self._log_node, record)

    def on_step_end(self, step: int, metrics: dict[str, float], trajectories: Any | None,
                    trajectory_lineage: Any | None = None) -> None:
        with self._lock:
            if not self._accepting("on_step_end"):
                return
            self._guard(f"logging step {step} metrics", self._log_step_metrics, step, metrics)
            self._queue_trace(step, "")
            if trajectories is not None and self.tracking.sample_trajectories:
                self._guard(f"logging step {step} trajectories", self._log_trajectories, step, trajectories)
            if trajectory_lineage is not None:
                if step in self._resumed_lineage_steps:  # this step ran before a resume: its new rows replace the old
                    self._resumed_lineage_steps.discard(step)
                    self._trajectory_lineage = [t.filter(pc.not_equal(t.column("consumed_step"), step))
                                                for t in self._trajectory_lineage]
                    self._trajectory_rows = [r for r in self._trajectory_rows if r["step"] != step]
                self._trajectory_lineage.append(trajectory_lineage)
                self._guard("writing the trajectory lineage", self._write_trajectory_parts, trajectory_lineage)
            self._guard("writing the lineage table", self._write_lineage_parts)
            if time.monotonic() - self._node_metrics_sent >= self.tracking.metrics_every_s:
                self._guard("logging metrics", self._flush_node_metrics)
                self._guard("logging step traces", self._flush_traces)
            every = self.tracking.figures_every
            if every and (step + 1) % every == 0 and \
                    time.monotonic() - self._figures_drawn >= self.tracking.figures_min_interval_s:
                self._figures_drawn = time.monotonic()
                self._guard("drawing the figures and tables", self._write_views)

    def on_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Log a file (to ``<artifact_path>/<name>``) or a directory (its contents to ``artifact_path``, default its name).

        The resulting artifact URI is recorded as tag ``rlpipe.artifact.<location>``.
        """
        with self._lock:
            if not self._accepting("on_artifact"):
                return
            self._guard(f"logging artifact {local_path}", self._log_artifact, Path(local_path), artifact_path)

    def on_node_input(self, step: int, node: str, table: pa.Table, context: dict[str, Any]) -> None:
        """``batches/step_<S>/<node>.parquet`` and ``.json`` (the stage context): what ``rlpipe replay`` re-runs."""
        with self._lock:
            if not self._accepting("on_node_input"):
                return
            self._guard(f"recording the input of {node!r} at step {step}", self._log_node_input, step, node, table,
                        context)

    def on_run_end(self, status: str, error: str | None = None) -> None:
        with self._lock:
            if self._ended or self.run_id is None:
                return
            self._ended = True
            if status not in _STATUSES:
                log.warning("unknown run status %r; recording FAILED", status)
                status = "FAILED"
            self._guard("logging metrics", self._flush_node_metrics)
            self._guard("writing the lineage table", self._write_lineage_parts)
            self._guard("writing the whole-run lineage", self._write_whole_lineage)
            for step in sorted(set(self._records) - self._traced - self._earlier_attempt):
                # steps without a step end: the one that failed, or one cut short
                self._queue_trace(step, error or f"run ended {status}")
            self._guard("logging step traces", self._flush_traces)
            self._guard("drawing the figures and tables", self._write_views)
            self._write_report(status)  # a view of what is written: a failure is a warning, never a spooled call
            if error:
                self._guard("recording the error", self._log_error, error)
            end = int(time.time() * 1000)
            for node, child in self._node_runs.items():
                self._guard(f"ending node run {node!r}", self.client.set_terminated, child, status, end)
            self._guard("ending the run", self.client.set_terminated, self.run_id, status, end)
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- run start -----------------------------------------------------------------------------

    def _resume(self, run_id: str) -> None:
        run = self.client.get_run(run_id)
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")
        resumes = int(run.data.tags.get("rlpipe.resumes", "0")) + 1
        self.client.set_tag(run_id, "rlpipe.resumes", str(resumes))
        for node, child in runs.node_runs(run_id, self.tracking_uri).items():
            self._node_runs[node] = child.info.run_id
            self._node_hash[node] = child.data.tags.get("rlpipe.params_hash", "")
            self.client.update_run(child.info.run_id, status="RUNNING")
        self._rewards = {int(m.step): m.value for m in self.client.get_metric_history(run_id, "reward/mean")}
        try:
            table = runs.lineage_table(run_id, self.tracking_uri)
        except runs.RunNotFoundError:
            return  # the run died before its first step end
        for r in table_to_records(table):
            self._records.setdefault(r.step, {})[(r.node, r.start_time)] = r
        self._dirty_steps = set(self._records)  # once: a run recorded before per-step parts has none yet
        self._earlier_attempt = set(self._records)
        self._traced = set(self._records)  # their traces exist; a step run again gets a new one
        try:
            earlier = runs.trajectory_lineage_table(run_id, self.tracking_uri)
        except runs.RunNotFoundError:
            return
        self._trajectory_lineage = [earlier]
        self._write_trajectory_parts(earlier)  # once, for the same reason
        self._resumed_lineage_steps = set(earlier.column("consumed_step").to_pylist())
        self._trajectory_rows = runs.table_rows(run_id, ui_tables.TRAJECTORIES_TABLE, self.tracking_uri)

    # -- per node / per step -------------------------------------------------------------------

    def _accepting(self, what: str) -> bool:
        if self.run_id is None or self._ended:
            log.warning("MLflowObserver.%s called %s; ignored", what, "after on_run_end" if self._ended else "before on_run_start")
            return False
        return True

    def _guard(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # tracking must not kill a training run
            msg = f"{what}: {type(exc).__name__}: {exc}"
            self.failures.append(msg)
            log.warning("MLflow tracking trouble (the run continues): %s", msg, exc_info=log.isEnabledFor(logging.DEBUG))

    def _node_run(self, r: NodeRecord) -> str:
        child = self._node_runs.get(r.node)
        if child is None:
            tags = {
                "mlflow.parentRunId": self.run_id,
                runs.ROLE_TAG: runs.ROLE_NODE,
                runs.NODE_TAG: r.node,
                "rlpipe.kind": r.kind,
                "rlpipe.impl": r.impl,
                "rlpipe.code_hash": r.code_hash,
                "rlpipe.params_hash": r.params_hash,
            }
            child = self.client.create_run(self.experiment_id, run_name=r.node, tags=tags).info.run_id
            self._node_runs[r.node] = child
            self._node_hash[r.node] = r.params_hash
            params = [Param(_key(k), v) for k, v in _flatten(r.params).items()]
            for chunk in _chunks(params, MAX_PARAMS_TAGS_PER_BATCH):
                self.client.log_batch(child, params=chunk)
        elif self._node_hash.get(r.node) != r.params_hash:
            # MLflow params are immutable; the tag follows the change and the lineage keeps every value.
            log.warning("node %r changed params (hash %s → %s) at step %d", r.node, self._node_hash.get(r.node), r.params_hash, r.step)
            self._node_hash[r.node] = r.params_hash
            self.client.set_tag(child, "rlpipe.params_hash", r.params_hash)
        return child

    def _log_node(self, r: NodeRecord) -> None:
        child = self._node_run(r)
        ts = int((r.start_time + r.duration_s) * 1000)
        values: dict[str, float] = {}
        for k, v in r.metrics.items():
            try:
                values[_key(k)] = float(v)
            except (TypeError, ValueError):
                log.debug("node %r metric %r is not a number (%r); skipped", r.node, k, v)
        values.update(duration_s=float(r.duration_s), rows_in=float(r.rows_in), rows_out=float(r.rows_out),
                      trainer_version=float(r.trainer_version))
        if r.policy_versions:
            values["policy_version/min"] = float(min(r.policy_versions))
            values["policy_version/max"] = float(max(r.policy_versions))
        self._node_metrics.setdefault(r.node, []).extend([k, v, ts, r.step] for k, v in values.items())

    def on_node_metrics(self, node: str, metrics: list[list]) -> None:
        """Send buffered metrics ``[key, value, timestamp ms, step]`` of node ``node``'s run, or of the pipeline
        run when ``node`` is :data:`PIPELINE_RUN` (spool replays)."""
        with self._lock:
            if not self._accepting("on_node_metrics"):
                return
            self._node_metrics.setdefault(node, []).extend(metrics)
            self._guard("logging node metrics", self._flush_node_metrics)
            self._guard("logging step traces", self._flush_traces)  # traces go with the metrics (unsent_calls)

    def unsent_calls(self) -> list[tuple[str, tuple]]:
        """What this observer holds but has not written, as calls for the spool of a run that ended badly:
        ``on_node_end`` for the records of steps whose lineage part or trace is unwritten (those calls themselves
        succeeded: they only buffer), then ``on_node_metrics`` for the other buffered metrics.
        No lock: the writer thread may be stuck in a call holding it; a snapshot is enough."""
        dirty = set(self._dirty_steps) | {step for step, _ in self._trace_queue}  # their traces come back too
        records = [("on_node_end", (r,)) for step in sorted(dirty) for r in self._step_records(step)]
        # a dirty step's node metrics come back with its on_node_end calls; its step metrics only from here
        metrics = [("on_node_metrics", (node, [m for m in buffered if node == PIPELINE_RUN or m[3] not in dirty]))
                   for node, buffered in list(self._node_metrics.items())]
        return records + [call for call in metrics if call[1][1]]

    def _flush_node_metrics(self) -> None:
        """One log_batch per run (chunked); a run whose write fails keeps its metrics for the next flush."""
        self._node_metrics_sent = time.monotonic()
        for node in list(self._node_metrics):
            metrics = [Metric(k, v, ts, step) for k, v, ts, step in self._node_metrics[node]]
            for chunk in _chunks(metrics, MAX_METRICS_PER_BATCH):
                self.client.log_batch(self.run_id if node == PIPELINE_RUN else self._node_runs[node], metrics=chunk)
            del self._node_metrics[node]

    def _log_step_metrics(self, step: int, metrics: dict[str, float]) -> None:
        values: dict[str, float] = {}
        for k, v in metrics.items():
            try:
                values[_key(k)] = float(v)
            except (TypeError, ValueError):
                log.debug("step metric %r is not a number (%r); skipped", k, v)
        timing: dict[str, float] = {}
        for r in self._records.get(step, {}).values():
            key = _key(f"timing/{r.node}_s")
            timing[key] = timing.get(key, 0.0) + float(r.duration_s)  # summed over repeated runs
            # Headline fallback: the reward stage's own mean when the engine did not pass one.
            if "reward/mean" in r.metrics:
                values.setdefault("reward/mean", float(r.metrics["reward/mean"]))
        values.update(timing)  # the records' sum replaces the executor's last-execution figure: one metric per node
        if "reward/mean" in values:
            self._rewards[step] = values["reward/mean"]
        ts = int(time.time() * 1000)
        self._node_metrics.setdefault(PIPELINE_RUN, []).extend([k, v, ts, step] for k, v in values.items())

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        with self._lock:
            if not self._accepting("on_metrics"):
                return
            ts = int(time.time() * 1000)
            self._node_metrics.setdefault(PIPELINE_RUN, []).extend(
                [_key(k), float(v), ts, step] for k, v in metrics.items())

    def _queue_trace(self, step: int, error: str) -> None:
        """Log ``step``'s trace with the next metrics flush (several steps' spans in one store call)."""
        if step in self._traced or not self._records.get(step):
            return
        self._traced.add(step)
        self._trace_queue.append((step, error))

    def _flush_traces(self) -> None:
        queued, self._trace_queue = self._trace_queue, []
        built = [traces.build_step_trace(self.experiment_id, self.run_id, step, self._records[step].values(), error)
                 for step, error in queued if self._records.get(step)]
        traces.write_traces(self.client, self.experiment_id, [b for b in built if b is not None])

    def _log_error(self, error: str) -> None:
        self.client.set_tag(self.run_id, "rlpipe.error", error[:MAX_TAG_VAL_LENGTH])
        self.client.log_text(self.run_id, error, "error.txt")
