"""Each executed step as an MLflow trace: the step DAG on the UI's trace timeline.

One trace per global step, linked to the pipeline run (trace metadata
``mlflow.sourceRun``), tagged ``rlpipe.step`` / ``rlpipe.run_id``. Its root span
``step N`` covers the step's first start to its last end; under it, one span per
node execution (:class:`rlpipe.engine.tracking.observer.NodeRecord`) with the
record's own start and end times, so the timeline shows what ran when — in the
async modes, generation for later steps overlapping the update of this one.

Span attributes (``rlpipe.*``): kind, impl, worker, rows in/out, input/output
fingerprints, policy versions, trainer version, params and code hashes, duration,
and the stage's metrics; span inputs/outputs repeat the fingerprints and rows so
the UI's input/output panes show them. A failed execution's span has status
ERROR with the error text, and so has its step's root span.

The spans are made after the fact from the records, with explicit times
(``MlflowClient.start_trace`` / ``start_span`` with ``start_time_ns`` and
``end_span`` with ``end_time_ns``), on the observer's writer thread: nothing
here runs on the driver's critical path. MLflow exports traces through its
process-wide tracer to the *global* tracking URI, so :func:`use_store` points it
at the run's store; exports are asynchronous, :func:`flush` waits for them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import mlflow
from mlflow.entities import SpanStatus, SpanStatusCode, SpanType
from mlflow.tracking import MlflowClient

from rlpipe.engine.tracking.observer import NodeRecord

STEP_TAG = "rlpipe.step"
RUN_TAG = "rlpipe.run_id"

_SPAN_TYPES = {
    "generate": SpanType.LLM,
    "reward": SpanType.EVALUATOR,
    "staleness_guard": SpanType.GUARDRAIL,
    "filter_groups": SpanType.GUARDRAIL,
}
"""Span type per stage kind (the UI's icon); other kinds are TASK."""


def use_store(tracking_uri: str) -> None:
    """Export traces to ``tracking_uri`` (MLflow's tracer follows the global tracking URI)."""
    if mlflow.get_tracking_uri() != tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)


def flush() -> None:
    """Wait until every trace handed to MLflow is written."""
    mlflow.flush_trace_async_logging()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _status(error: str) -> SpanStatus | str:
    return SpanStatus(SpanStatusCode.ERROR, error[:1000]) if error else "OK"


def span_attributes(r: NodeRecord) -> dict:
    """What a node execution's span carries (``rlpipe.*`` attributes)."""
    attrs = {
        "rlpipe.node": r.node,
        "rlpipe.kind": r.kind,
        "rlpipe.impl": r.impl,
        "rlpipe.worker": r.worker,
        "rlpipe.rows_in": r.rows_in,
        "rlpipe.rows_out": r.rows_out,
        "rlpipe.input_fingerprint": r.input_fingerprint,
        "rlpipe.output_fingerprint": r.output_fingerprint,
        "rlpipe.policy_versions": list(r.policy_versions),
        "rlpipe.trainer_version": r.trainer_version,
        "rlpipe.params_hash": r.params_hash,
        "rlpipe.code_hash": r.code_hash,
        "rlpipe.duration_s": round(r.duration_s, 6),
    }
    if r.error:
        attrs["rlpipe.error"] = r.error
    for k, v in r.metrics.items():
        try:
            attrs[f"rlpipe.metric.{k}"] = float(v)
        except (TypeError, ValueError):
            continue
    return attrs


def log_step_trace(client: MlflowClient, experiment_id: str, run_id: str, step: int,
                   records: Iterable[NodeRecord], error: str = "") -> str | None:
    """Log one step's node executions as a trace linked to ``run_id``; returns the trace id (None: no records)."""
    ordered = sorted(records, key=lambda r: r.start_time)
    if not ordered:
        return None
    start = min(r.start_time for r in ordered)
    end = max(r.start_time + r.duration_s for r in ordered)
    failed = error or next((f"{r.node}: {r.error}" for r in ordered if r.error), "")
    root = client.start_trace(
        f"step {step}", span_type=SpanType.CHAIN, experiment_id=experiment_id, run_id=run_id,
        start_time_ns=_ns(start), tags={STEP_TAG: str(step), RUN_TAG: run_id},
        inputs={"step": step, "rows": ordered[0].rows_in, "input_fingerprint": ordered[0].input_fingerprint},
        attributes={"rlpipe.step": step, "rlpipe.nodes": len(ordered),
                    "rlpipe.trainer_version": max(r.trainer_version for r in ordered)},
    )
    seen: Counter[str] = Counter()
    for r in ordered:
        seen[r.node] += 1
        name = r.node if seen[r.node] == 1 else f"{r.node} #{seen[r.node]}"  # refills, continuous generation
        span = client.start_span(
            name, trace_id=root.trace_id, parent_id=root.span_id, span_type=_SPAN_TYPES.get(r.kind, SpanType.TASK),
            inputs={"input_fingerprint": r.input_fingerprint, "rows": r.rows_in}, attributes=span_attributes(r),
            start_time_ns=_ns(r.start_time),
        )
        client.end_span(root.trace_id, span.span_id, status=_status(r.error),
                        outputs={"output_fingerprint": r.output_fingerprint, "rows": r.rows_out,
                                 "policy_versions": list(r.policy_versions)},
                        end_time_ns=_ns(r.start_time + r.duration_s))
    last = ordered[-1]
    client.end_trace(root.trace_id, status=_status(failed), end_time_ns=_ns(end),
                     outputs={"rows": last.rows_out, "output_fingerprint": last.output_fingerprint})
    return root.trace_id


def step_traces(experiment_id: str, run_id: str, tracking_uri: str) -> dict[int, object]:
    """The step traces of a run by step (``mlflow.entities.Trace``, spans included)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    out, token = {}, None
    while True:
        page = client.search_traces(locations=[experiment_id], run_id=run_id, max_results=100, page_token=token)
        out.update({int(t.info.tags[STEP_TAG]): t for t in page if STEP_TAG in t.info.tags})
        token = page.token
        if not token:
            return dict(sorted(out.items()))
