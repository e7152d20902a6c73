"""Re-run one stage of a recorded run on the exact batch it saw, as recorded or changed.

A run with ``tracking.record_batches_every: N`` keeps, every N steps, each node's
input batch and stage context (``batches/step_<S>/<node>.parquet`` / ``.json``).
:func:`replay` loads one, runs the node's recorded implementation on it (and checks
its output fingerprint against the lineage: same data, same code → same bytes) and,
with overrides (``impl=rloo``, ``params.clip_ratio=0.1``), the changed stage too;
:class:`Replay` holds both outputs, the per-column differences and both metric sets.
The changed pipeline is re-validated and re-planned, so an override that breaks a
column contract fails with the planner's message.

Task stages (reward, balance, advantage, filters, guards ...) replay anywhere. Worker
and driver stages (generate, old_log_prob, update, weight_sync) need the workers'
state at that step (weights, optimizer), which batches do not hold: they are refused.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import PlannedNode, build_plan
from rlpipe.engine.stage_call import apply_result, run_stage
from rlpipe.engine.tracking import explain, runs
from rlpipe.engine.tracking.lineage import fingerprint
from rlpipe.errors import ConfigError, RlpipeError
from rlpipe.stage import StageContext


@dataclass
class ColumnDiff:
    """How one written column differs between the recorded and the changed stage."""

    name: str
    rows_changed: int
    rows: int
    mean_before: float | None
    mean_after: float | None
    max_abs_diff: float | None


@dataclass
class Replay:
    """The outcome of :func:`replay`."""

    run_id: str
    step: int
    node: str
    before: str
    """kind/impl as recorded."""
    after: str
    """kind/impl after the overrides (the same when none)."""
    reproduced: bool | None
    """Did the recorded impl give the recorded output fingerprint (None: no lineage record)?"""
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]
    recorded_metrics: dict[str, float]
    columns: list[ColumnDiff] = field(default_factory=list)
    table_after: pa.Table | None = None


def _download(run_id: str, path: str, uri: str, dest: str) -> str:
    try:
        return runs.client(uri).download_artifacts(run_id, path, dest)
    except Exception:  # noqa: BLE001 - MLflow raises per artifact store
        raise runs.RunNotFoundError(
            f"run {run_id} has no {path!r}: its batches are recorded only with tracking.record_batches_every "
            "(run again with e.g. -o tracking.record_batches_every=10, then replay a step it recorded)"
        ) from None


def _recorded_steps(run_id: str, uri: str) -> list[int]:
    found = runs.client(uri).list_artifacts(run_id, runs.BATCHES_DIR)
    return sorted(int(f.path.rsplit("_", 1)[1]) for f in found if f.is_dir)


def _apply_overrides(stages: list[dict], node: str, overrides: list[str]) -> None:
    """``impl=X`` / ``params.a.b=V`` (YAML values) on the stage named ``node``, in place."""
    stage = next(s for s in stages if (s.get("name") or s["kind"]) == node)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write KEY=VALUE, e.g. -o impl=rloo or -o params.clip_ratio=0.1")
        *parents, last = key.split(".")
        target = stage
        for p in parents:
            target = target.setdefault(p, {})
        target[last] = yaml.safe_load(text)


def _context(saved: dict[str, Any]) -> StageContext:
    return StageContext(step=saved["step"], seed=saved["seed"], policy_version=saved["policy_version"],
                        dp_size=saved.get("dp_size", 1), extras=saved.get("extras", {}), carry=saved.get("carry", {}))


def _run(node: PlannedNode, table: pa.Table, ctx: StageContext) -> tuple[pa.Table, dict[str, float]]:
    if node.spec.placement != "task":
        where = node.spec.role if node.spec.placement == "worker" else "driver"
        raise RlpipeError(
            f"node {node.name!r} ({node.kind}/{node.impl}) runs on the {where}: replaying it needs the workers' state "
            "at that step (weights, optimizer), which recorded batches do not hold; replay a task stage "
            "(reward, balance, advantage, filters, guards)"
        )
    result = run_stage(node.kind, node.impl, node.params_dict, table, ctx)
    return apply_result(node, table, result), {k: float(v) for k, v in result.metrics.items()}


def _flat(col: pa.ChunkedArray) -> tuple[np.ndarray | None, np.ndarray]:
    """(numeric values per element or None, per-row element offsets) of a scalar or list column."""
    arr = col.combine_chunks()
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        offsets = arr.offsets.to_numpy()
        values = arr.flatten()
    else:
        offsets = np.arange(len(arr) + 1)
        values = arr
    if pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type):
        return values.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False), offsets
    return None, offsets


def diff_columns(before: pa.Table, after: pa.Table, names: list[str]) -> list[ColumnDiff]:
    """Per column: rows that differ, means and the largest absolute difference (numeric columns)."""
    out = []
    for name in names:
        if name not in before.column_names or name not in after.column_names:
            continue
        a, b = before.column(name), after.column(name)
        rows = before.num_rows
        if a.type != b.type or pa.types.is_list(a.type) or pa.types.is_large_list(a.type):
            changed = sum(x != y for x, y in zip(a.to_pylist(), b.to_pylist()))  # one batch: fine per row
        else:
            changed = rows - int(pc.sum(pc.fill_null(pc.equal(a, b), False)).as_py() or 0)
        va, oa = _flat(a)
        vb, ob = _flat(b)
        numeric = va is not None and vb is not None
        same_shape = numeric and np.array_equal(oa, ob)
        out.append(ColumnDiff(
            name=name, rows_changed=changed, rows=rows,
            mean_before=float(np.nanmean(va)) if numeric and len(va) else None,
            mean_after=float(np.nanmean(vb)) if numeric and len(vb) else None,
            max_abs_diff=float(np.nanmax(np.abs(va - vb))) if same_shape and len(va) else None,
        ))
    return out


def replay(run_ref: str, step: int, node_name: str, overrides: list[str] | None = None,
           tracking_uri: str | None = None, experiment: str | None = None) -> Replay:
    """Re-run ``node_name`` on its recorded input at ``step``: as recorded, and with ``overrides``."""
    uri = runs.resolve_tracking_uri(tracking_uri)
    run = explain.find_run(run_ref, uri, experiment)
    run_id = run.info.run_id
    raw = runs.resolved_config(run_id, uri)
    with tempfile.TemporaryDirectory() as tmp:
        base = f"{runs.BATCHES_DIR}/step_{step:06d}/{node_name}"
        try:
            table = pq.read_table(_download(run_id, f"{base}.parquet", uri, tmp), memory_map=False)
        except runs.RunNotFoundError as exc:
            steps = _recorded_steps(run_id, uri)
            hint = f" Recorded steps: {', '.join(map(str, steps))}." if steps else ""
            raise runs.RunNotFoundError(f"{exc}{hint}") from None
        saved = json.loads(open(_download(run_id, f"{base}.json", uri, tmp)).read())
    plan = build_plan(validate_config(raw))
    names = [n.name for n in plan.nodes]
    if node_name not in names:
        raise ConfigError(f"run {run_id} has no node {node_name!r}; its nodes: {', '.join(names)}")
    original = plan.node(node_name)
    changed = original
    if overrides:
        _apply_overrides(raw["stages"], node_name, overrides)
        changed = build_plan(validate_config(raw)).node(node_name)
    ctx = _context(saved)
    out_before, m_before = _run(original, table, ctx)
    out_after, m_after = _run(changed, table, _context(saved)) if overrides else (out_before, m_before)
    record = next((r for r in explain.step_nodes(run_id, step, uri) if r.node == node_name), None)
    written = sorted(set(original.writes) | set(changed.writes))
    return Replay(
        run_id=run_id, step=step, node=node_name, before=f"{original.kind}/{original.impl}",
        after=f"{changed.kind}/{changed.impl}",
        reproduced=None if record is None else fingerprint(out_before) == record.output_fingerprint,
        metrics_before=m_before, metrics_after=m_after, recorded_metrics=dict(record.metrics) if record else {},
        columns=diff_columns(out_before, out_after, written), table_after=out_after,
    )
