"""Calling one registered stage, Ray-free: used by every backend and by the rollout feeder.

``run_stage`` looks an implementation up by (kind, impl), validates its params and
runs it, turning any failure into a :class:`~rlpipe.errors.StageError` that names
kind, impl and step; ``apply_result`` checks a result against the node's declared
writes and assembles the next table; ``run_chain`` runs consecutive stages in one call (a
fused task or worker call) and returns each stage's result and the last table; ``shard_rows``
routes rows to a role's workers.
Kept apart from the execution backends so that worker state (the rollout feeder)
can run stages without importing them: imports run execution → state → this module.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
import time
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from rlpipe.deadline import call_with_deadline
from rlpipe.engine.thread_clock import ThreadClock
from rlpipe.errors import StageError
from rlpipe.plugin_files import import_plugin_files
from rlpipe.registry import load_plugins
from rlpipe.stage import StageContext, StageResult, stage_registry

log = logging.getLogger(__name__)


def run_stage(spec_kind: str, impl: str, params: dict, batch: pa.Table, ctx: StageContext, state: Any = None):
    load_plugins()
    if ctx.plugins:
        import_plugin_files(ctx.plugins)
    spec = stage_registry(spec_kind).get(impl)
    parsed = spec.params_model.model_validate(params)
    try:
        if spec.placement == "worker":
            return spec.fn(state, batch, parsed, ctx)
        return spec.fn(batch, parsed, ctx)
    except StageError:
        raise
    except Exception as exc:
        # the traceback travels with the error (to the driver's error log), not to the terminal: the run's
        # failure is reported once, in one line, where it ends (rlpipe.error_log)
        log.debug("stage %s/%s failed at step %d", spec_kind, impl, ctx.step, exc_info=True)
        raise StageError(spec_kind, impl, ctx.step, exc, details=traceback.format_exc()) from exc


def shard_rows(table: pa.Table, size: int, sharded: bool, dp_rank_column: str) -> list[np.ndarray]:
    """Row indices each worker gets: by ``dp_rank`` when sharded, else contiguous even chunks."""
    if sharded and size > 1:
        ranks = table.column(dp_rank_column).to_numpy()
        return [np.flatnonzero(ranks == r) for r in range(size)]
    return list(np.array_split(np.arange(table.num_rows), size))


def apply_result(node: PlannedNode, table: pa.Table, result: StageResult) -> pa.Table:
    """The next table: ``result`` applied to ``table``, after checking the node's write contract."""
    if result.table is not None:
        out = result.table
        written = {name: out.schema.field(name).type for name in out.column_names}
    else:
        out = table.take(pa.array(np.asarray(result.keep, dtype=np.int64))) if result.keep is not None else table
        written = {}
        for name, arr in result.columns.items():
            arr = as_array(arr)
            if len(arr) != out.num_rows:
                raise ValueError(f"column {name!r} has {len(arr)} rows, the batch has {out.num_rows}")
            written[name] = arr.type
            idx = out.schema.get_field_index(name)
            out = out.set_column(idx, name, arr) if idx >= 0 else out.append_column(name, arr)
    missing = sorted(set(node.writes) - set(written))
    undeclared = sorted(set(written) - set(node.writes) - (set(table.column_names) if result.table is not None else set()))
    wrong = sorted(n for n, t in written.items() if n in node.writes and t != node.writes[n])
    if missing or undeclared or wrong:
        details = []
        if missing:
            details.append(f"declared but not written: {missing}")
        if undeclared:
            details.append(f"written but not declared: {undeclared}")
        if wrong:
            details.append("wrong types: " + ", ".join(f"{n} is {written[n]}, declared {node.writes[n]}" for n in wrong))
        raise ValueError("stage broke its column contract: " + "; ".join(details))
    return out


def as_array(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous array from an array or a chunked array."""
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


def merge_results(results: list[StageResult], shards: list[np.ndarray], creates_rows: bool) -> StageResult:
    """Combine the per-worker results of one worker stage into one, in the input's row order."""
    counts = frozenset().union(*(r.counts for r in results))
    metrics = _mean_metrics([r.metrics for r in results], counts)
    carry = results[0].carry if results else {}  # replicas agree (data-parallel ranks run in lockstep)
    if creates_rows:
        return StageResult(table=pa.concat_tables([r.table for r in results]), metrics=metrics, carry=carry,
                           counts=counts)
    if any(r.keep is not None for r in results):
        raise ValueError("worker stages cannot select rows; use a task stage for filtering")
    order = np.concatenate(shards) if shards else np.array([], dtype=np.int64)
    if len(results) == 1 and np.array_equal(order, np.arange(len(order))):  # one worker had every row, in order
        return StageResult(columns=dict(results[0].columns), metrics=metrics, carry=carry, counts=counts)
    inverse = pa.array(np.argsort(order, kind="stable"))
    columns = {}
    for name in results[0].columns if results else []:
        merged = pa.concat_arrays([as_array(r.columns[name]) for r in results])
        columns[name] = merged.take(inverse)
    return StageResult(columns=columns, metrics=metrics, carry=carry, counts=counts)


def _mean_metrics(all_metrics: list[dict[str, float]], counts: frozenset[str] = frozenset()) -> dict[str, float]:
    """Per metric, the mean over the workers that report it; the sum for ``counts``."""
    out = {}
    for key in sorted({k for m in all_metrics for k in m}):
        values = [m[key] for m in all_metrics if key in m]
        out[key] = float(np.sum(values) if key in counts else np.mean(values))
    return out


@dataclasses.dataclass(frozen=True)
class ChainedStage:
    """What a fused task needs of one node: the stage to call and its write contract."""

    kind: str
    impl: str
    params: dict
    writes: dict[str, pa.DataType]
    timeout_s: float | None = None
    """The node's own deadline, enforced inside the chain (the caller's wait only bounds the whole)."""
    role: str | None = None
    """The worker role of a worker stage, the hosting worker's role for a driver stage (None: a task stage). Past its
    deadline the worker running the chain is killed, as the thread abandoned in it still holds that role's state."""
    driver: bool = False
    """A driver stage (StageSpec.calls): it runs with ``ctx.workers`` set to the chain's worker facade."""


@dataclasses.dataclass
class ChainStep:
    """One stage of a fused chain: its result, or the error that ended the chain; when it ran."""

    result: StageResult | None
    error: BaseException | None
    start: float
    duration_s: float
    deferred: list[tuple[list[Any], str, list[Any]]] = dataclasses.field(default_factory=list)
    """A driver stage's deferred worker calls (``ctx.workers.defer``) and who answers each: the driver settles them,
    as if deferred there."""
    cpu_s: float | None = None
    """CPU seconds of the thread that ran the stage (None: it failed)."""
    run_queue_s: float | None = None
    """Seconds that thread was runnable but waited for a core (rlpipe.engine.thread_clock; None: not reported)."""


def run_chain(stages: list[ChainedStage], batch: pa.Table, ctxs: list, where: str,
              states: dict[str, Any] | None = None, workers: Any = None) -> tuple[list[ChainStep], pa.Table | None]:
    """Run ``stages`` in order, each on the table the previous one made; stops at the first error. Returns
    every stage's step and the last table (None when a stage failed).

    Each stage gets its own ``timeout_s`` (:func:`~rlpipe.deadline.call_with_deadline`): a hung stage
    ends the chain with a :class:`~rlpipe.deadline.StageTimeout` naming ``where``, at its own deadline.
    ``states``: per role, the worker state its stages run against (a chain fused into a worker's call);
    ``workers``: the ``ctx.workers`` of driver stages in the chain, with ``take_deferred()`` handing over what a
    stage deferred."""
    steps: list[ChainStep] = []
    for stage, ctx in zip(stages, ctxs):
        start = time.time()
        if stage.driver:
            ctx = dataclasses.replace(ctx, workers=workers)
        try:
            state = (states or {}).get(stage.role) if stage.role else None
            result, (cpu_s, wait_s) = call_with_deadline(
                lambda: _clocked(lambda: run_stage(stage.kind, stage.impl, stage.params, batch, ctx, state)),
                stage.timeout_s, where)
            batch = apply_result(stage, batch, result)
        except Exception as exc:  # noqa: BLE001 - handed to the driver, which records and raises it for its node
            steps.append(ChainStep(None, exc, start, time.time() - start, _deferred(stage, workers)))
            return steps, None
        steps.append(ChainStep(result, None, start, time.time() - start, _deferred(stage, workers), cpu_s, wait_s))
    return steps, batch


def _clocked(fn: Callable[[], Any]) -> tuple[Any, tuple[float, float | None]]:
    """``fn()`` and its thread's clocks over the call (rlpipe.engine.thread_clock), read on the thread that runs it."""
    began = ThreadClock.now()
    value = fn()
    return value, began.since()


def _deferred(stage: ChainedStage, workers: Any) -> list[tuple[list[Any], str, list[Any]]]:
    return workers.take_deferred() if stage.driver and workers is not None else []
