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

The spans are made after the fact from the records, with their recorded times, on
the observer's writer: nothing here runs on the driver's critical path. Traces are
written synchronously through the observer's own client, several steps at once
(:func:`write_traces`: ``start_trace`` per step, then one ``log_spans`` with every
step's spans), so they are in the store when the call returns: no process-wide
tracer, no global tracking URI, no asynchronous export to wait for.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterable

from mlflow.entities import Span, SpanStatus, SpanStatusCode, SpanType, TraceData, TraceInfo, TraceLocation, TraceState
from mlflow.tracing.constant import (
    TRACE_REQUEST_ID_PREFIX,
    TRACE_SCHEMA_VERSION,
    TRACE_SCHEMA_VERSION_KEY,
    SpanAttributeKey,
    TraceMetadataKey,
    TraceTagKey,
)
from mlflow.tracing.utils import build_otel_context, encode_trace_id
from mlflow.tracking import MlflowClient
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan

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

_EMPTY_RESOURCE = Resource.get_empty()  # Resource.create() probes the host: slow, and nothing here needs it


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _status(error: str) -> SpanStatus:
    return SpanStatus(SpanStatusCode.ERROR, error[:1000]) if error else SpanStatus(SpanStatusCode.OK)


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
    built = build_step_trace(experiment_id, run_id, step, records, error)
    if built is None:
        return None
    write_traces(client, experiment_id, [built])
    return built[0].trace_id


def write_traces(client: MlflowClient, experiment_id: str, built: list[tuple[TraceInfo, list[Span]]]) -> None:
    """Write traces made by :func:`build_step_trace`: one ``start_trace`` each, then one ``log_spans`` with all
    their spans. Not through MLflow's live-span API: that path exported every span in its own store transaction
    from a background thread (~125 ms of CPU per 7-node step on sqlite, more than a quickstart-scale step).
    The order matters: ``start_trace`` after ``log_spans`` finds the trace row that log_spans made and takes
    sqlite's slow merge path (a 7-node step on this box: 37 ms of CPU one at a time in that order, 27 in
    this one, ~10 per step when 40 steps share the log_spans). A store without span logging (a file store)
    gets each trace's spans as its artifact instead, as MLflow's exporter does."""
    if not built:
        return
    tracing = client._tracing_client  # the public MlflowClient has no batch span write
    infos = [tracing.start_trace(info) for info, _ in built]
    try:
        tracing.log_spans(experiment_id, [span for _, spans in built for span in spans])
    except NotImplementedError:
        for info, (_, spans) in zip(infos, built):
            tracing._upload_trace_data(info, TraceData(spans=spans))


def build_step_trace(experiment_id: str, run_id: str, step: int, records: Iterable[NodeRecord],
                     error: str = "") -> tuple[TraceInfo, list[Span]] | None:
    """One step's node executions as a trace linked to ``run_id``: its info and spans (None: no records)."""
    ordered = sorted(records, key=lambda r: r.start_time)
    if not ordered:
        return None
    start = min(r.start_time for r in ordered)
    end = max(r.start_time + r.duration_s for r in ordered)
    failed = error or next((f"{r.node}: {r.error}" for r in ordered if r.error), "")
    otel_trace_id = random.getrandbits(128)
    trace_id = TRACE_REQUEST_ID_PREFIX + encode_trace_id(otel_trace_id)
    root_id = _span_id()
    inputs = {"step": step, "rows": ordered[0].rows_in, "input_fingerprint": ordered[0].input_fingerprint}
    last = ordered[-1]
    outputs = {"rows": last.rows_out, "output_fingerprint": last.output_fingerprint}
    spans = [_span(otel_trace_id, trace_id, root_id, None, f"step {step}", SpanType.CHAIN, _ns(start), _ns(end),
                   failed, inputs, outputs, {"rlpipe.step": step, "rlpipe.nodes": len(ordered),
                                             "rlpipe.trainer_version": max(r.trainer_version for r in ordered)},
                   experiment_id=experiment_id)]
    seen: Counter[str] = Counter()
    for r in ordered:
        seen[r.node] += 1
        name = r.node if seen[r.node] == 1 else f"{r.node} #{seen[r.node]}"  # refills, continuous generation
        spans.append(_span(
            otel_trace_id, trace_id, _span_id(), root_id, name, _SPAN_TYPES.get(r.kind, SpanType.TASK),
            _ns(r.start_time), _ns(r.start_time + r.duration_s), r.error,
            {"input_fingerprint": r.input_fingerprint, "rows": r.rows_in},
            {"output_fingerprint": r.output_fingerprint, "rows": r.rows_out, "policy_versions": list(r.policy_versions)},
            span_attributes(r)))
    info = TraceInfo(
        trace_id=trace_id, trace_location=TraceLocation.from_experiment_id(experiment_id),
        request_time=int(start * 1000), execution_duration=int((end - start) * 1000),
        state=TraceState.ERROR if failed else TraceState.OK,
        request_preview=json.dumps(inputs), response_preview=json.dumps(outputs),
        trace_metadata={TraceMetadataKey.SOURCE_RUN: run_id, TRACE_SCHEMA_VERSION_KEY: str(TRACE_SCHEMA_VERSION),
                        TraceMetadataKey.INPUTS: json.dumps(inputs), TraceMetadataKey.OUTPUTS: json.dumps(outputs)},
        tags={STEP_TAG: str(step), RUN_TAG: run_id, TraceTagKey.TRACE_NAME: f"step {step}"},
    )
    return info, spans


def _span_id() -> int:
    return random.getrandbits(64) or 1


def _span(otel_trace_id: int, trace_id: str, span_id: int, parent_id: int | None, name: str, span_type: str,
          start_ns: int, end_ns: int, error: str, inputs: dict, outputs: dict, attributes: dict,
          experiment_id: str | None = None) -> Span:
    """A finished MLflow span; attribute values are JSON-encoded, as MLflow stores them."""
    attrs = {SpanAttributeKey.REQUEST_ID: trace_id, SpanAttributeKey.SPAN_TYPE: span_type,
             SpanAttributeKey.INPUTS: inputs, SpanAttributeKey.OUTPUTS: outputs, **attributes}
    if experiment_id is not None:
        attrs[SpanAttributeKey.EXPERIMENT_ID] = experiment_id
    otel = ReadableSpan(
        name=name, context=build_otel_context(otel_trace_id, span_id),
        parent=build_otel_context(otel_trace_id, parent_id) if parent_id is not None else None,
        start_time=start_ns, end_time=end_ns, status=_status(error).to_otel_status(),
        attributes={k: json.dumps(v) for k, v in attrs.items()}, resource=_EMPTY_RESOURCE,
    )
    return Span(otel)


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
