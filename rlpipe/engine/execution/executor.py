"""The step executor: runs planned nodes over one batch on Ray.

Task stages become Ray tasks; worker stages run on every worker of their role
(rows routed by ``dp_rank`` for data-parallel roles, split evenly across
replicas otherwise); driver stages run here with a facade to the workers. After
each node the executor checks the stage kept its column contract, assembles the
next table, and hands a lineage record to the observer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import pyarrow as pa
from rlpipe.deadline import StageTimeout, call_with_deadline
from rlpipe.engine.execution.backend import Backend
from rlpipe.engine.execution.branches import runs_beside
from rlpipe.engine.tracking.lineage import LazyFingerprint, execution_fields
from rlpipe.engine.tracking.observer import NodeRecord, Observer
from rlpipe.engine.planning.plan import Plan, PlannedNode
from rlpipe.errors import StageError
from rlpipe.schemas.batch import DP_RANK, UID
from rlpipe.engine.stage_call import ChainedStage, ChainStep, apply_result, as_array, merge_results
from rlpipe.stage import StageContext, StageResult

log = logging.getLogger(__name__)

_MAX_REPLICA_NOTES = 1 << 20


class _Backlog(threading.local):
    """This thread's lineage records not yet handed to the observer (oldest first), and the first error one
    raised while the driver was waiting on a remote call (raised at the end of the executor's ``run``)."""

    def __init__(self) -> None:
        self.records: list[Callable[[], None]] = []
        self.error: BaseException | None = None


class StepExecutor:
    """Runs nodes of a plan; one instance per pipeline run."""

    def __init__(self, plan: Plan, backend: Backend, observer: Observer, run_id: str, seed: int,
                 record_batches_every: int = 0, concurrent_branches: bool = True):
        self.plan = plan
        self.backend = backend
        self.observer = observer
        self.run_id = run_id
        self.seed = seed
        self.policy_version = 0
        generate = plan.anchor("generates")
        # One source of truth for sampling temperature: the generate node's params.
        self.base_extras = {"temperature": float(getattr(generate.params, "temperature", 1.0)) if generate else 1.0}
        self.carry: dict[str, dict[str, Any]] = {}
        """Per node: the state its last execution handed forward (StageResult.carry)."""
        self.before_role: dict[str, list[Callable[[PlannedNode, int], None]]] = {}
        """Mode hooks called right before the node playing a step role (colocate_async releases the rollout
        engine before ``updates_policy``). A fused call ends before such a node, so its hook fires between the
        calls, after the nodes before it are done."""
        self.concurrent_branches = concurrent_branches
        """Start the next worker chain beside the current call when nothing orders them (resources.concurrent_branches)."""
        self.record_batches_every = record_batches_every
        """Every N steps, hand each node's input batch and context to the observer (for replay); 0 = never."""
        self.replica_of: dict[str, int] = {}
        """The rollout replica each prompt uid went to, until the step consuming it ends (for lineage)."""
        self._backlog = _Backlog()
        self._started: tuple[int, pa.Table, list[PlannedNode], dict[str, Any], _StartedChain] | None = None
        """The next step's first worker chain, started by ``run(..., then=...)``: its step, input, nodes, extras."""
        overlap = getattr(backend, "overlap", None)
        self._records_overlap = callable(overlap)
        """On a backend whose stages run elsewhere (Ray) a node's record (fingerprints: ~0.5 ms a node) is written
        while the driver waits on the next call; in-process, at once. Either way before ``run`` returns."""
        if self._records_overlap:
            overlap(self._write_backlog_while_waiting)

    def note_replicas(self, uids: list[str], replica: int) -> None:
        """Remember that rollout replica ``replica`` generates the prompts ``uids``."""
        if len(self.replica_of) > _MAX_REPLICA_NOTES:  # groups never consumed (evicted, dropped): forget the oldest
            for uid in list(self.replica_of)[: _MAX_REPLICA_NOTES // 2]:
                del self.replica_of[uid]
        self.replica_of.update(dict.fromkeys(uids, replica))

    @property
    def dp_size(self) -> int:
        return self.backend.group_size("actor")

    def run(self, step: int, table: pa.Table, nodes: list[PlannedNode] | None = None,
            extras: dict[str, Any] | None = None,
            then: Callable[[], tuple[int, pa.Table] | None] | None = None) -> tuple[pa.Table, dict[str, float]]:
        """Run ``nodes`` (default: all) in plan order; returns the final table and all metrics.

        Consecutive nodes run as one remote call when the backend can chain them (Ray): the nodes of
        a role that has one worker with the task nodes next to them, as one call of that worker;
        other consecutive task nodes as one task. One round trip and one shipment of the batch
        instead of one per node; each node still gets its own lineage record.

        ``then``: called once this step's last node is done, when the nodes begin with a worker chain;
        returns the next step and its input (or None), which the caller then runs next with the same
        ``nodes`` and ``extras``. That step's first chain starts at once, so that it runs while this
        step's records are written and the caller ends the step; the caller must not change in between
        what that chain reads."""
        metrics: dict[str, float] = {}
        fp = LazyFingerprint(table)
        todo = list(nodes if nodes is not None else self.plan.nodes)
        extras = extras or {}
        i = 0
        handed = self._take_started(step, table, todo, extras)  # the worker chain at ``i``, already started
        try:
            while i < len(todo):
                group, role = self._fusable(todo, i)
                after = i + len(group)
                beside = None
                if handed is None and after < len(todo) and self._beside(todo, group, role, *self._fusable(todo, after)):
                    # the next worker chain reads nothing this call writes: it starts now, on this call's input
                    beside = self._start_chain(step, todo, after, table, extras, hand_on=False)
                table, node_metrics, fp, handed = self._run_call(step, todo, i, group, role, table, fp, extras, handed,
                                                                 hand_on=beside is None)
                metrics.update(node_metrics)
                if beside is not None:  # recorded on this call's output, as if it had run after it
                    table, node_metrics, fp = self.finish_chain(step, beside, table, fp)
                    metrics.update(node_metrics)
                    after += len(beside.group)
                i = after
            if then is not None and not self._hooked(todo[0]) and self._fusable(todo, 0)[1] is not None:
                if (following := then()) is not None:
                    self._started = (*following, todo, extras, self._start_chain(following[0], todo, 0, following[1],
                                                                                 extras))
        except BaseException:
            # whatever ended the step (a mode hook, an interrupt), the nodes that ran keep their records; the
            # error that ended it is the one raised
            self._write_backlog_while_waiting()
            self._backlog.records.clear()
            self._backlog.error = None
            raise
        self.write_backlog()
        return table, metrics

    def _run_call(self, step: int, todo: list[PlannedNode], i: int, group: list[PlannedNode], role: str | None,
                  table: pa.Table, fp: LazyFingerprint, extras: dict[str, Any], handed: "_StartedChain | None",
                  hand_on: bool = True) -> tuple[pa.Table, dict[str, float], LazyFingerprint, "_StartedChain | None"]:
        """Run the call ``group`` at ``todo[i]`` (see :meth:`_fusable`); returns its output, metrics, fingerprint
        and the next worker chain when this one handed its table on (started already)."""
        if len(group) > 1 and role is not None:
            started = handed or self._start_chain(step, todo, i, table, extras, hand_on)
            following = None
            if started.hands_on:  # the next worker chain starts now, on this one's output
                following = self._start_chain(step, todo, i + len(group), started.call, extras)
            return (*self.finish_chain(step, started, table, fp), following)
        if len(group) > 1:
            return (*self.run_fused(step, group, table, fp, extras), None)
        return (*self.run_node(step, todo[i], table, fp, extras), None)

    def _beside(self, todo: list[PlannedNode], group: list[PlannedNode], role: str | None,
                following: list[PlannedNode], following_role: str | None) -> bool:
        """Whether the call after ``group`` may run beside it (rlpipe.engine.execution.branches)."""
        if not self.concurrent_branches or following_role is None or len(following) < 2:
            # only a worker chain starts without the driver waiting on it
            return False
        worker = next((n for n in group if n.spec.placement == "worker"), None)
        host = self.backend.host(role or worker.spec.role) if worker is not None else None
        return runs_beside(group, host, following, self.backend.host(following_role), {n.name: n for n in todo},
                           self._hooked)

    def _take_started(self, step: int, table: pa.Table, todo: list[PlannedNode],
                      extras: dict[str, Any]) -> "_StartedChain | None":
        """The chain the previous ``run`` started for this one (what its ``then`` returned), if any."""
        if self._started is None:
            return None
        (started_step, started_table, started_nodes, started_extras, started), self._started = self._started, None
        if (started_step, started_nodes, started_extras) != (step, todo, extras) or started_table is not table:
            raise ValueError(f"step {step}: run() was told (then=) that step {started_step} comes next with other "
                             "input or nodes; its first chain already started")
        return started

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

    def _fusable(self, nodes: list[PlannedNode], i: int) -> tuple[list[PlannedNode], str | None]:
        """The nodes from ``nodes[i]`` that run as one call, and the role whose worker runs them (None: a task).

        A worker chain: task nodes and the nodes of the roles one worker hosts (one role, or the roles
        colocated with it), when it is the only worker of its roles (with more, rows are split by
        ``dp_rank``, which the task nodes before them may still be writing), and after them the driver
        nodes that declare the roles they call (a weight push as the trainer's last act). Otherwise the
        run of task nodes from ``nodes[i]``. ``([nodes[i]], None)`` when nothing fuses. A node with a mode hook
        (:attr:`before_role`) starts a call of its own."""
        if getattr(self.backend, "task_stages_in_workers", False):
            role = host = None
            j = i
            while j < len(nodes) and nodes[j].spec.placement in ("task", "worker", "driver"):
                if j > i and self._hooked(nodes[j]):
                    break
                spec = nodes[j].spec
                if spec.placement == "worker":
                    if host is None and self.backend.group_size(spec.role) == 1:
                        role, host = spec.role, self.backend.host(spec.role)
                    elif host is None or self.backend.host(spec.role) != host:
                        break
                elif spec.placement == "driver" and (host is None or not spec.calls):
                    break  # a driver stage joins a worker's call only after that worker's nodes, and when it says
                    # which roles it calls (the worker reaches them from there)
                j += 1
            if role is not None and j - i > 1:
                return nodes[i:j], role
        if not hasattr(self.backend, "run_task_chain"):
            return [nodes[i]], None
        j = i
        while j < len(nodes) and nodes[j].spec.placement == "task" and not (j > i and self._hooked(nodes[j])):
            j += 1
        return (nodes[i:j] if j - i > 1 else [nodes[i]]), None

    def _hooked(self, node: PlannedNode) -> bool:
        """Whether a mode hook fires before ``node``."""
        return bool(self.before_role.get(node.step_role))

    def _context(self, step: int, node: PlannedNode, extras: dict[str, Any]) -> StageContext:
        return StageContext(step=step, seed=self.seed, policy_version=self.policy_version,
                            dp_size=self.dp_size, extras={**self.base_extras, **extras},
                            carry=dict(self.carry.get(node.name, {})), plugins=self.plan.plugins)

    def run_node(self, step: int, node: PlannedNode, table: pa.Table, input_fp: str | LazyFingerprint,
                 extras: dict[str, Any]) -> tuple[pa.Table, dict[str, float], LazyFingerprint]:
        ctx = self._context(step, node, extras)
        for hook in self.before_role.get(node.step_role, ()):
            hook(node, step)
        self._record_input(step, node, table, ctx)
        start = time.time()
        try:
            result = self._dispatch(node, table, ctx)
            out = apply_result(node, table, result)
        except Exception as exc:
            self._fail(step, node, table, input_fp, start, exc)
        return self._finish(step, node, table, out, result, start, time.time() - start, input_fp)

    def _chained(self, step: int, group: list[PlannedNode], extras: dict[str, Any],
                 role: str | None) -> tuple[list[StageContext], list[ChainedStage], float | None]:
        """What a fused call of ``group`` needs: each node's context and stage, and the bound of the wait for the
        whole (the sum of the nodes' timeouts); the mode hooks before the group's nodes run here."""
        ctxs = [self._context(step, node, extras) for node in group]
        for hook in self.before_role.get(group[0].step_role, ()):  # only a group's first node has hooks
            hook(group[0], step)
        stages = [ChainedStage(n.kind, n.impl, n.params_dict, dict(n.writes), n.timeout_s,
                               role if n.spec.placement == "driver" else
                               n.spec.role if n.spec.placement == "worker" else None, n.spec.placement == "driver")
                  for n in group]
        timeouts = [n.timeout_s for n in group]
        return ctxs, stages, None if None in timeouts else sum(timeouts)

    def _start_chain(self, step: int, todo: list[PlannedNode], at: int, source: Any,
                     extras: dict[str, Any], hand_on: bool = True) -> "_StartedChain":
        """Submit the worker chain at ``todo[at]`` (see :meth:`_fusable`) on ``source``: the step's table, or the
        started chain before it. It hands its last table on to the next node's worker chain, to be started at
        once (the batch goes worker to worker, not through the driver), when there is one and nothing the
        driver does after this chain can change what the next one is given: no driver stage in it (a weight
        push bumps the policy version of the next nodes' contexts) and no mode hook between nodes."""
        group, role = self._fusable(todo, at)
        hands_on = hand_on and self._hands_on(todo, at, group)
        ctxs, stages, bound = self._chained(step, group, extras, role)
        start = time.time()
        call = self.backend.start_worker_chain(role, stages, source, ctxs, hands_on)
        return _StartedChain(group, role, ctxs, call, bound, start, hands_on)

    def _hands_on(self, todo: list[PlannedNode], at: int, group: list[PlannedNode]) -> bool:
        """Whether the worker chain ``group`` at ``todo[at]`` hands its last table to the next call (see
        :meth:`_start_chain`)."""
        after = at + len(group)
        following, next_role = self._fusable(todo, after) if after < len(todo) else ([], None)
        return (next_role is not None and len(following) > 1 and not self._hooked(following[0])
                and all(n.spec.placement != "driver" for n in group))

    def finish_chain(self, step: int, started: "_StartedChain", table: pa.Table,
                     input_fp: str | LazyFingerprint) -> tuple[pa.Table, dict[str, float], LazyFingerprint]:
        """Wait for a started worker chain (its bound counted from now), then record it as :meth:`run_fused`."""
        try:
            steps = self.backend.finish_worker_chain(started.call, started.bound)
        except Exception as exc:
            self._fail(step, started.group[0], table, input_fp, started.start, exc)
        return self._record_chain(step, started.group, started.ctxs, steps, table, input_fp, started.role)

    def run_fused(self, step: int, group: list[PlannedNode], table: pa.Table, input_fp: str | LazyFingerprint,
                  extras: dict[str, Any]) -> tuple[pa.Table, dict[str, float], LazyFingerprint]:
        """``group``, a run of task nodes, as one task (see :meth:`_fusable`); then, per node, the same records and
        checks as :meth:`run_node`. See :meth:`_record_chain`."""
        ctxs, stages, bound = self._chained(step, group, extras, None)
        start = time.time()
        try:
            steps = self.backend.run_task_chain(stages, table, ctxs, bound)
        except Exception as exc:
            self._fail(step, group[0], table, input_fp, start, exc)
        return self._record_chain(step, group, ctxs, steps, table, input_fp, None)

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
                                                   else None)
            metrics.update(node_metrics)
        return table, metrics, fp

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

    def _finish(self, step: int, node: PlannedNode, table: pa.Table, out: pa.Table, result: StageResult, start: float,
                duration: float, input_fp: str | LazyFingerprint,
                where: str | None = None) -> tuple[pa.Table, dict[str, float], LazyFingerprint]:
        if result.carry:
            self.carry[node.name] = dict(result.carry)
        if node.step_role == "pushes_weights":
            # the push reports the version it bumped to; ask the trainer only when an impl does not
            pushed = result.metrics.get("weight_sync/version")
            self.policy_version = int(pushed) if pushed is not None else int(
                self.backend.workers.call("actor", "get_version", rank=0)[0])
        metrics = dict(result.metrics)
        metrics[f"timing/{node.name}_s"] = duration
        # a node that only set or added columns: the output's other column digests are the input's
        same_rows = result.table is None and result.keep is None and isinstance(input_fp, LazyFingerprint)
        out_fp = LazyFingerprint(out, input_fp, result.columns) if same_rows else LazyFingerprint(out)
        # what the record says is fixed now (the version it ran under, where); hashing and handing it over may wait
        trainer_version, worker = self.policy_version, where if where is not None else self.where(node)
        self._backlog.records.append(lambda: self.record(step, node, table, out, start, duration, result.metrics,
                                                         input_fp, worker, out_fp, trainer_version))
        if not self._records_overlap:
            self.write_backlog()
        return out, metrics, out_fp

    def record(self, step: int, node: PlannedNode, table_in: pa.Table | None, table_out: pa.Table, start: float,
               duration: float, metrics: dict[str, float], input_fp: str | LazyFingerprint | None = None,
               where: str | None = None, output_fp: LazyFingerprint | None = None,
               trainer_version: int | None = None) -> str:
        """Hand a lineage record of one node execution to the observer; returns the output fingerprint.
        ``where``: where it ran, when not where its placement says (a task node fused into a worker's call);
        ``trainer_version``: the trainer's version when it ran (default: now).

        Modes call this directly for work done outside ``run`` (e.g. continuous generation)."""
        fields = execution_fields(table_in, table_out, start, duration, metrics, input_fp, output_fp)
        self.record_external(step, node, worker=where, trainer_version=trainer_version, **fields)
        return fields["output_fingerprint"]

    def _record_input(self, step: int, node: PlannedNode, table: pa.Table, ctx: StageContext) -> None:
        every = self.record_batches_every
        on_node_input = getattr(self.observer, "on_node_input", None)
        if not every or step % every or on_node_input is None:
            return
        on_node_input(step, node.name, table, {"step": ctx.step, "seed": ctx.seed, "policy_version": ctx.policy_version,
                                               "dp_size": ctx.dp_size, "extras": ctx.extras, "carry": ctx.carry})

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
        roles = getattr(self.backend, "hosted_roles", lambda role: (role,))(spec.role)
        where = f"{'+'.join(roles)}×{self.backend.group_size(spec.role)}"
        nodes = getattr(self.backend, "group_nodes", lambda role: [])(spec.role)
        return f"{where}@{','.join(sorted(set(nodes)))}" if nodes else where

    def record_external(self, step: int, node: PlannedNode, *, input_fingerprint: str, output_fingerprint: str,
                        rows_in: int, rows_out: int, policy_versions: list[int], start_time: float,
                        duration_s: float, metrics: dict[str, float], worker: str | None = None,
                        error: str = "", trainer_version: int | None = None) -> None:
        """Hand the observer a node execution that another process ran and fingerprinted
        (separate_async's rollout replicas score their own groups). ``trainer_version``: the trainer's
        version when it ran (default: now)."""
        self.observer.on_node_end(NodeRecord(
            run_id=self.run_id, step=step, node=node.name, kind=node.kind, impl=node.impl,
            params=node.params_dict, params_hash=node.params_hash, code_hash=node.spec.code_hash,
            input_fingerprint=input_fingerprint, output_fingerprint=output_fingerprint,
            rows_in=rows_in, rows_out=rows_out, policy_versions=policy_versions,
            trainer_version=self.policy_version if trainer_version is None else trainer_version,
            start_time=start_time, duration_s=duration_s, metrics=dict(metrics),
            worker=worker if worker is not None else self.where(node), error=error,
        ))

    def _dispatch(self, node: PlannedNode, table: pa.Table, ctx: StageContext) -> StageResult:
        spec = node.spec
        params = node.params_dict
        if spec.placement == "task":
            return self.backend.run_task(node.kind, node.impl, params, table, ctx, node.timeout_s)
        if spec.placement == "driver":
            driver_ctx = dataclasses.replace(ctx, workers=self.backend.workers)
            return call_with_deadline(lambda: spec.fn(table, node.params, driver_ctx), node.timeout_s,
                                      "the driver (a driver stage waiting on its workers)")
        shards = self.backend.shards(spec.role, table, DP_RANK)
        if spec.role == "rollout" and spec.creates_rows and UID in table.column_names:
            for replica, rows in enumerate(shards):
                self.note_replicas(table.column(UID).take(pa.array(rows)).to_pylist(), replica)
        tables = [_rows(table, rows) for rows in shards]
        ctxs = [dataclasses.replace(ctx, dp_rank=rank) for rank in range(len(shards))]
        results = self.backend.run_on_workers(spec.role, node.kind, node.impl, params, tables, ctxs, node.timeout_s)
        return merge_results(results, shards, spec.creates_rows)


@dataclasses.dataclass
class _StartedChain:
    """A worker chain submitted by :meth:`StepExecutor._start_chain`, not yet waited for."""

    group: list[PlannedNode]
    role: str
    ctxs: list[StageContext]
    call: Any
    """The backend's handle of the call."""
    bound: float | None
    start: float
    hands_on: bool
    """Its last table goes straight to the next worker chain."""


def _stage_error(node: PlannedNode, step: int, exc: Exception) -> StageError:
    """The StageError of a failed node: its own, the one a Ray error wraps, or a new one naming kind, impl, step."""
    cause = getattr(exc, "cause", None)  # Ray wraps a remote error; its `cause` is the original
    if isinstance(cause, StageError):  # first: Ray's wrapper is itself a StageError, its text the worker's traceback
        return cause
    if isinstance(exc, StageError):
        return exc
    return StageError(node.kind, node.impl, step, cause if isinstance(cause, BaseException) else exc)


def _rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    if len(rows) == table.num_rows and (len(rows) == 0 or np.all(np.diff(rows) == 1)):
        return table
    return table.take(pa.array(rows))
