"""The tracking spool: observer calls that could not reach MLflow, kept in a local file and replayed later.

When the tracking server goes away, :class:`~rlpipe.engine.tracking.background_observer.BackgroundObserver`
stops waiting at run end after ``tracking.drain_timeout_s`` and writes every call it could
not deliver (still queued, in flight, or failed) to ``<output_dir>/<run>/tracking_spool.jsonl``.
``rlpipe spool replay PATH`` sends them to MLflow later, into the same run.

Format (JSON lines): the first line is a header (``rlpipe_spool``: the format version, the
tracking URI, experiment, run id and name, the tracking config, and what ``on_run_start``
logged); each next line is one call, ``{"call": "on_step_end", "args": [...]}``, in the
order the run made them. Arrow tables are Arrow IPC streams in base64
(``{"__arrow__": ...}``), lineage records their fields (``{"__node_record__": {...}}``).

Replaying is idempotent where MLflow allows: the lineage table is keyed by (step, node,
start), metrics by step (readers take the last value per step: see
:func:`rlpipe.engine.tracking.runs.metric_history`), so a call that was half delivered
before the server went away can be sent again.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.errors import RlpipeError

log = logging.getLogger(__name__)

SPOOL_NAME = "tracking_spool.jsonl"
"""File name of a run's spool, in the run's output folder."""
FORMAT = 1


class SpoolError(RlpipeError):
    """A spool file cannot be read or replayed."""


def _encode(value: Any) -> Any:
    if isinstance(value, pa.RecordBatch):
        value = pa.Table.from_batches([value])
    if isinstance(value, pa.Table):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, value.schema) as writer:
            writer.write_table(value)
        return {"__arrow__": base64.b64encode(sink.getvalue().to_pybytes()).decode()}
    if isinstance(value, NodeRecord):
        return {"__node_record__": dataclasses.asdict(value)}
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if type(value).__name__ == "DataFrame":  # trajectories given as a pandas frame
        return _encode(pa.Table.from_pandas(value, preserve_index=False))
    if isinstance(value, np.generic):
        return value.item()
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__arrow__" in value:
            return pa.ipc.open_stream(base64.b64decode(value["__arrow__"])).read_all()
        if "__node_record__" in value:
            return NodeRecord(**value["__node_record__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def write_spool(path: Path, header: dict[str, Any], calls: list[tuple[str, tuple]]) -> Path:
    """Append ``calls`` to the spool at ``path`` (a header first when it is new); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", encoding="utf-8") as out:
        if new:
            out.write(json.dumps({"rlpipe_spool": FORMAT, **_encode(header)}) + "\n")
        for method, args in calls:
            out.write(json.dumps({"call": method, "args": _encode(list(args))}) + "\n")
        out.flush()
    return path


def read_spool(path: str | Path) -> tuple[dict[str, Any], list[tuple[str, list]]]:
    """(header, calls) of a spool file; a missing or damaged file is a SpoolError naming it."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SpoolError(f"cannot read spool {path}: {exc.strerror or exc}") from None
    try:
        entries = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as exc:
        raise SpoolError(f"spool {path} line {exc.lineno}: not JSON ({exc.msg}); is it a tracking spool?") from None
    if not entries or entries[0].get("rlpipe_spool") != FORMAT:
        raise SpoolError(f"{path} is not an rlpipe tracking spool (format {FORMAT}): its first line has no header")
    header = _decode(entries[0])
    return header, [(e["call"], _decode(e["args"])) for e in entries[1:]]


def replay_spool(path: str | Path, tracking_uri: str | None = None) -> tuple[str, int]:
    """Send a spool's calls into its MLflow run (at ``tracking_uri``, default the one the run used).

    Returns (run id, calls replayed). On success the file is renamed ``*.replayed``; if MLflow
    fails again the file stays and a SpoolError says what failed."""
    from rlpipe.engine.tracking import runs
    from rlpipe.engine.tracking.mlflow_observer import MLflowObserver
    from rlpipe.schemas.config import TrackingConfig

    path = Path(path)
    header, calls = read_spool(path)
    tracking = TrackingConfig.model_validate({**header["tracking"], "uri": tracking_uri or header["tracking_uri"]})
    observer = MLflowObserver(tracking, header["run_name"], resume_run_id=header["run_id"])
    client = runs.client(tracking.uri)
    try:
        resumes = client.get_run(header["run_id"]).data.tags.get("rlpipe.resumes")
    except Exception as exc:  # noqa: BLE001 - MLflow raises per store
        raise SpoolError(f"cannot reach run {header['run_id']} at {tracking.uri}: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}; is the tracking server up? "
                         "(--tracking-uri points the replay at another store)") from None
    observer.on_run_start(header["config"], header["pipeline_yaml"], header["plan_summary"])
    _restore_resumes_tag(client, header["run_id"], resumes)
    observer._earlier_attempt.clear()  # spooled records add to the step they belong to; they do not replace it
    _reload_trajectory_lineage(observer, client, calls)
    if not any(method == "on_run_end" for method, _ in calls):
        calls = [*calls, ("on_run_end", ["FAILED", "the run ended without recording its end (replayed spool)"])]
    for method, args in calls:
        getattr(observer, method)(*args)
    if observer.failures:
        raise SpoolError(f"replaying {path} into run {header['run_id']}: {len(observer.failures)} calls failed, "
                         f"first: {observer.failures[0]}; the spool is kept, replay it again")
    path.rename(path.with_name(path.name + ".replayed"))
    return header["run_id"], len(calls)


def _restore_resumes_tag(client, run_id: str, value: str | None) -> None:
    """A replay is not a resume: put back the run's ``rlpipe.resumes`` tag that on_run_start counted up."""
    if value is None:
        client.delete_tag(run_id, "rlpipe.resumes")
    else:
        client.set_tag(run_id, "rlpipe.resumes", value)


def _reload_trajectory_lineage(observer, client, calls: list[tuple[str, list]]) -> None:
    """Keep the run's consumed-trajectory lineage: the observer writes ``lineage/trajectories.parquet``
    at the run's end from what it holds, so it must start from what the run already logged (minus the
    spooled steps)."""
    from rlpipe.engine.tracking import runs

    if observer._trajectory_lineage:  # the observer reloads it itself on resume
        return
    try:
        earlier = runs._read_step_parts(client, observer.run_id, runs.TRAJECTORY_LINEAGE_STEPS_DIR,
                                        runs.TRAJECTORY_LINEAGE_ARTIFACT)
    except runs.RunNotFoundError:
        return
    spooled = [args[0] for method, args in calls if method == "on_step_end" and len(args) > 3 and args[3] is not None]
    if spooled:
        earlier = earlier.filter(pc.invert(pc.is_in(earlier.column("consumed_step"), pa.array(spooled, pa.int32()))))
    observer._trajectory_lineage.append(earlier)
