"""The lineage side of the step executor: one record per node execution, handed to the observer.

:class:`StepRecords` is the part of :class:`rlpipe.engine.execution.executor.StepExecutor` that writes what
ran: a node's record (fingerprints, rows, policy versions, where it ran), a failed node's record and error, the
node inputs kept for replay, the rollout replica of each prompt. On a backend whose stages run elsewhere (Ray)
the records wait in a per-thread backlog and are written while the driver waits on the next call; the modes
call :meth:`StepRecords.record` / :meth:`StepRecords.record_external` for work done outside a step's run.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
import pyarrow as pa

from rlpipe.deadline import StageTimeout
from rlpipe.engine.execution.backend import Backend
from rlpipe.engine.planning.plan import PlannedNode
from rlpipe.engine.stage_call import ChainStep, apply_result, merge_results
from rlpipe.engine.tracking.lineage import LazyFingerprint, execution_fields
from rlpipe.engine.tracking.observer import NodeRecord, Observer
from rlpipe.errors import StageError
from rlpipe.schemas.batch import UID
from rlpipe.stage import StageContext, StageResult

_MAX_REPLICA_NOTES = 1 << 20


class Backlog(threading.local):
    """This thread's lineage records not yet handed to the observer (oldest first), and the first error one
    raised while the driver was waiting on a remote call (raised at the end of the executor's ``run``)."""

    def __init__(self) -> None:
        self.records: list[Callable[[], None]] = []
        self.error: BaseException | None = None


def _stage_error(node: PlannedNode, step: int, exc: Exception) -> StageError:
    """The StageError of a failed node: its own, the one a Ray error wraps, or a new one naming kind, impl, step."""
    cause = getattr(exc, "cause", None)  # Ray wraps a remote error; its `cause` is the original
    if isinstance(cause, StageError):  # first: Ray's wrapper is itself a StageError, its text the worker's traceback
        return cause
    if isinstance(exc, StageError):
        return exc
    return StageError(node.kind, node.impl, step, cause if isinstance(cause, BaseException) else exc)


class StepRecords:
    """Lineage records of node executions (mixed into the step executor, which sets these attributes)."""

    observer: Observer
    run_id: str
    backend: Backend
    policy_version: int
    carry: dict[str, dict]
    record_batches_every: int
    replica_of: dict[str, int]
    _backlog: Backlog
    _records_overlap: bool

    def note_replicas(self, uids: list[str], replica: int) -> None:
        """Remember that rollout replica ``replica`` generates the prompts ``uids``."""
        if len(self.replica_of) > _MAX_REPLICA_NOTES:  # groups never consumed (evicted, dropped): forget the oldest
            for uid in list(self.replica_of)[: _MAX_REPLICA_NOTES // 2]:
                del self.replica_of[uid]
        self.replica_of.update(dict.fromkeys(uids, replica))

    def write_backlog(self) -> None:
        """Hand this thread's pending lineage records to the observer, in order; raise the first error one raised
        while the driver was waiting on a remote call."""
        backlog = self._backlog
        while backlog.records:
            backlog.records.pop(0)()
        error, backlog.error = backlog.error, None
        if error is not None:
            raise error

    def _write_backlog_while_waiting(self) -> None:
        """The backend's wait hook: write pending records; an error waits for :meth:`write_backlog` (raised from
        inside the backend's call it would read as a failure of the node it waits on)."""
        backlog = self._backlog
        while backlog.records and backlog.error is None:
            try:
                backlog.records.pop(0)()
            except Exception as exc:  # noqa: BLE001 - kept, raised by write_backlog
                backlog.error = exc

    def _fail(self, step: int, node: PlannedNode, table: pa.Table, input_fp: str | LazyFingerprint, start: float,
              exc: Exception):
        """Record the failed execution (after the records of the nodes before it) and raise its StageError."""
        if isinstance(exc, StageTimeout):
            error = StageError(node.kind, node.impl, step, (
                f"node {node.name!r} timed out: {exc}. If the stage is only slow, raise its `timeout_s` "
                f"(-o stages.{node.name}.timeout_s=SECONDS); otherwise look for what hangs in that worker's log"
            ))
        else:
            error = _stage_error(node, step, exc)
        self._write_backlog_while_waiting()  # the records before it first; the stage's error is the one raised
        self._record_failure(step, node, table, input_fp, start, error)
        if error is exc:
            raise exc
        chained = isinstance(exc, StageTimeout) or error is getattr(exc, "cause", None)
        raise error from (None if chained else exc)

    def record(self, step: int, node: PlannedNode, table_in: pa.Table | None, table_out: pa.Table, start: float,
               duration: float, metrics: dict[str, float], input_fp: str | LazyFingerprint | None = None,
               where: str | None = None, output_fp: LazyFingerprint | None = None,
               trainer_version: int | None = None, clocks: tuple[float | None, float | None] = (None, None)) -> str:
        """Hand a lineage record of one node execution to the observer; returns the output fingerprint.
        ``where``: where it ran, when not where its placement says (a task node fused into a worker's call);
        ``trainer_version``: the trainer's version when it ran (default: now); ``clocks``: its stage thread's CPU
        and run-queue seconds, where measured (NodeRecord.cpu_s, run_queue_s).

        Modes call this directly for work done outside ``run`` (e.g. continuous generation)."""
        fields = execution_fields(table_in, table_out, start, duration, metrics, input_fp, output_fp)
        self.record_external(step, node, worker=where, trainer_version=trainer_version, cpu_s=clocks[0],
                             run_queue_s=clocks[1], **fields)
        return fields["output_fingerprint"]

    def _record_input(self, step: int, node: PlannedNode, table: pa.Table, ctx: StageContext) -> None:
        every = self.record_batches_every
        on_node_input = getattr(self.observer, "on_node_input", None)
        if not every or step % every or on_node_input is None:
            return
        on_node_input(step, node.name, table, {"step": ctx.step, "seed": ctx.seed, "policy_version": ctx.policy_version,
                                               "dp_size": ctx.dp_size, "extras": ctx.extras.as_dict(), "carry": ctx.carry})

    def _record_failure(self, step: int, node: PlannedNode, table_in: pa.Table, input_fp: str | LazyFingerprint,
                        start: float, error: BaseException) -> None:
        """The lineage of a failed execution: its input and the error (the trace shows it in red)."""
        self.record_external(step, node, input_fingerprint=str(input_fp), output_fingerprint="", rows_in=table_in.num_rows,
                             rows_out=0, policy_versions=[], start_time=start, duration_s=time.time() - start,
                             metrics={}, error=f"{type(error).__name__}: {error}")

    def where(self, node: PlannedNode) -> str:
        """Where a node runs, for its lineage: ``task``, ``driver`` or ``<role>×<replicas>``, followed on Ray by
        ``@<node ids>`` (the Ray nodes of the role's workers); colocated roles (resources.colocate) are named
        together, ``actor+rollout×1``."""
        spec = node.spec
        if spec.placement != "worker":
            return spec.placement
        roles = self.backend.hosted_roles(spec.role)
        where = f"{'+'.join(roles)}×{self.backend.group_size(spec.role)}"
        nodes = self.backend.group_nodes(spec.role)
        return f"{where}@{','.join(sorted(set(nodes)))}" if nodes else where

    def record_external(self, step: int, node: PlannedNode, *, input_fingerprint: str, output_fingerprint: str,
                        rows_in: int, rows_out: int, policy_versions: list[int], start_time: float,
                        duration_s: float, metrics: dict[str, float], worker: str | None = None,
                        error: str = "", trainer_version: int | None = None, cpu_s: float | None = None,
                        run_queue_s: float | None = None) -> None:
        """Hand the observer a node execution that another process ran and fingerprinted
        (separate_async's rollout replicas score their own groups). ``trainer_version``: the trainer's
        version when it ran (default: now); ``cpu_s``, ``run_queue_s``: its stage thread's clocks, where measured."""
        self.observer.on_node_end(NodeRecord(
            run_id=self.run_id, step=step, node=node.name, kind=node.kind, impl=node.impl,
            params=node.params_dict, params_hash=node.params_hash, code_hash=node.spec.code_hash,
            input_fingerprint=input_fingerprint, output_fingerprint=output_fingerprint,
            rows_in=rows_in, rows_out=rows_out, policy_versions=policy_versions,
            trainer_version=self.policy_version if trainer_version is None else trainer_version,
            start_time=start_time, duration_s=duration_s, metrics=dict(metrics),
            worker=worker if worker is not None else self.where(node), error=error, cpu_s=cpu_s,
            run_queue_s=run_queue_s,
        ))

    def _record_chain(self, step: int, group: list[PlannedNode], ctxs: list[StageContext], steps: list[ChainStep],
                      table: pa.Table, input_fp: str | LazyFingerprint,
                      role: str | None) -> tuple[pa.Table, dict[str, float], LazyFingerprint]:
        """Per node of a fused call (``role``: the worker that ran it, None: a task), the same records and checks
        as :meth:`run_node`, its result applied here to rebuild its input and output. The mode hooks of the
        group's nodes ran before the whole call and run after it; a node's duration is its stage's run time inside
        the call. Each node's ``timeout_s`` is enforced inside the call (a worker whose own stage ran past it is
        then killed), their sum bounds the wait for it."""
        metrics: dict[str, float] = {}
        fp = input_fp
        # a task or driver node that ran in a worker's call says so in its lineage
        host = self.where(next(n for n in group if n.spec.placement == "worker")) if role else None
        for node, ctx, done in zip(group, ctxs, steps):
            self._record_input(step, node, table, ctx)
            spec = node.spec
            for futures, failure, origins in done.deferred:  # a driver stage's deferred calls: settled from here
                self.backend.workers.defer(futures, failure, origins)
            try:
                if done.error is not None:
                    raise done.error
                result = done.result
                if spec.placement == "worker":  # as run_node's merge of its one worker's result
                    result = merge_results([result], [np.arange(table.num_rows)], spec.creates_rows)
                    if spec.role == "rollout" and spec.creates_rows and UID in table.column_names:
                        self.note_replicas(table.column(UID).to_pylist(), 0)
                out = apply_result(node, table, result)
            except Exception as exc:
                self._fail(step, node, table, fp, done.start, exc)
            table, node_metrics, fp = self._finish(step, node, table, out, result, done.start, done.duration_s, fp,
                                                   f"{spec.placement} in {host}" if host and spec.placement != "worker"
                                                   else None, (done.cpu_s, done.run_queue_s))
            metrics.update(node_metrics)
        return table, metrics, fp

    def _finish(self, step: int, node: PlannedNode, table: pa.Table, out: pa.Table, result: StageResult, start: float,
                duration: float, input_fp: str | LazyFingerprint,
                where: str | None = None, clocks: tuple[float | None, float | None] = (None, None),
                ) -> tuple[pa.Table, dict[str, float], LazyFingerprint]:
        if result.carry:
            self.carry[node.name] = dict(result.carry)
        if node.step_role == "pushes_weights":
            # the push says the version it made current; ask the trainer only when an impl does not
            self.policy_version = result.policy_version if result.policy_version is not None else int(
                self.backend.workers.call("actor", "get_version", rank=0)[0])
        metrics = dict(result.metrics)
        metrics[f"timing/{node.name}_s"] = duration
        # a node that only set or added columns: the output's other column digests are the input's
        same_rows = result.table is None and result.keep is None and isinstance(input_fp, LazyFingerprint)
        out_fp = LazyFingerprint(out, input_fp, result.columns) if same_rows else LazyFingerprint(out)
        # what the record says is fixed now (the version it ran under, where); hashing and handing it over may wait
        trainer_version, worker = self.policy_version, where if where is not None else self.where(node)
        self._backlog.records.append(lambda: self.record(step, node, table, out, start, duration, result.metrics,
                                                         input_fp, worker, out_fp, trainer_version, clocks))
        if not self._records_overlap:
            self.write_backlog()
        return out, metrics, out_fp
