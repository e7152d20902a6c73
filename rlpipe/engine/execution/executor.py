"""The step executor: runs planned nodes over one batch, on Ray or in this process.

It walks the calls compiled for the nodes (rlpipe.engine.execution.call_plan): a worker's chain, a chain
of task nodes, or one node — task stages as Ray tasks, worker stages on every worker of their role (rows
routed by ``dp_rank`` for data-parallel roles, split evenly across replicas otherwise), driver stages here
with a facade to the workers. After each node it checks the stage kept its column contract, assembles the
next table, and hands a lineage record to the observer (rlpipe.engine.execution.recording).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import numpy as np
import pyarrow as pa
from rlpipe.deadline import call_with_deadline
from rlpipe.engine.execution.backend import Backend
from rlpipe.engine.execution.call_plan import Call, CallRules, compile_calls
from rlpipe.engine.execution.recording import Backlog, StepRecords
from rlpipe.engine.tracking.lineage import LazyFingerprint
from rlpipe.engine.tracking.observer import Observer
from rlpipe.engine.planning.plan import Plan, PlannedNode
from rlpipe.schemas.batch import DP_RANK, UID
from rlpipe.engine.stage_call import ChainedStage, apply_result, merge_results
from rlpipe.stage import StageContext, StageResult, StepExtras

log = logging.getLogger(__name__)


class StepExecutor(StepRecords):
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
        self.base_extras = StepExtras(temperature=float(getattr(generate.params, "temperature", 1.0)) if generate else 1.0)
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
        self._backlog = Backlog()
        self._calls: dict[tuple, tuple[Call, ...]] = {}
        """The compiled calls per node list and set of hooked step roles (:meth:`calls`)."""
        self._records_overlap = backend.overlap(self._write_backlog_while_waiting)
        """On a backend whose stages run elsewhere (Ray) a node's record (fingerprints: ~0.5 ms a node) is written
        while the driver waits on the next call; in-process, at once. Either way before ``run`` returns."""

    @property
    def dp_size(self) -> int:
        return self.backend.group_size("actor")

    def calls(self, nodes: list[PlannedNode]) -> tuple[Call, ...]:
        """The calls a run of ``nodes`` makes (rlpipe.engine.execution.call_plan), compiled on first use and kept:
        the placement is fixed once the workers start, and the mode hooks are part of the key."""
        hooked = tuple(sorted(role for role, hooks in self.before_role.items() if hooks))
        key = (tuple(map(id, nodes)), hooked)
        compiled = self._calls.get(key)
        if compiled is None:
            backend = self.backend
            rules = CallRules(backend, backend.task_stages_in_workers, backend.chains_tasks, self._hooked,
                              self.concurrent_branches)
            compiled = self._calls[key] = compile_calls(nodes, rules)
        return compiled

    def start(self, step: int, table: pa.Table, nodes: list[PlannedNode] | None = None,
              extras: dict[str, Any] | None = None) -> StepRun:
        """Begin a run of ``nodes`` (default: all) on ``table``: its first call is submitted now when it is a
        worker chain, so a mode that starts the next step before it ends this one (its records written, its
        metrics logged) overlaps the two. :meth:`finish` runs the rest."""
        todo = list(nodes if nodes is not None else self.plan.nodes)
        extras = extras or {}
        calls = self.calls(todo)
        first = self._start_chain(step, calls[0], table, extras) if calls and calls[0].worker_chain else None
        return StepRun(step, table, todo, extras, calls, first)

    def finish(self, run: StepRun, write_records: bool = True) -> tuple[pa.Table, dict[str, float]]:
        """Run the rest of ``run``'s calls in order; returns the final table and all metrics. Each node of a
        fused call still gets its own lineage record. ``write_records`` False: the records of the last nodes
        stay pending, written at the next wait on a remote call or by :meth:`write_backlog` (the runtime's
        ``end_step`` does it first), so a mode can start the next step's run before they are written."""
        step, table, extras, calls = run.step, run.table, run.extras, run.calls
        metrics: dict[str, float] = {}
        fp = LazyFingerprint(table)
        handed = run.first
        try:
            k = 0
            while k < len(calls):
                call = calls[k]
                partners = []
                while k + 1 + len(partners) < len(calls) and calls[k + 1 + len(partners)].beside:
                    partners.append(calls[k + 1 + len(partners)])
                # the concurrent branches start now, on this call's input, and are recorded, in plan order, on the
                # output of the calls before them: they read nothing those write
                besides = [self._start_chain(step, partner, table, extras) for partner in partners]
                table, node_metrics, fp, handed = self._run_call(step, call, calls[k + 1] if call.hands_on else None,
                                                                 table, fp, extras, handed)
                metrics.update(node_metrics)
                for started in besides:
                    table, node_metrics, fp = self.finish_chain(step, started, table, fp)
                    metrics.update(node_metrics)
                k += 1 + len(partners)
        except BaseException:
            # whatever ended the step (a mode hook, an interrupt), the nodes that ran keep their records; the
            # error that ended it is the one raised
            self._write_backlog_while_waiting()
            self._backlog.records.clear()
            self._backlog.error = None
            raise
        if write_records:
            self.write_backlog()
        return table, metrics

    def run(self, step: int, table: pa.Table, nodes: list[PlannedNode] | None = None,
            extras: dict[str, Any] | None = None) -> tuple[pa.Table, dict[str, float]]:
        """:meth:`start` and :meth:`finish` at once: the nodes' table and metrics, their records written."""
        return self.finish(self.start(step, table, nodes, extras))

    def _run_call(self, step: int, call: Call, following: Call | None, table: pa.Table, fp: LazyFingerprint,
                  extras: dict[str, Any], handed: "_StartedChain | None",
                  ) -> tuple[pa.Table, dict[str, float], LazyFingerprint, "_StartedChain | None"]:
        """Run ``call`` (``handed``: it started already); returns its output, metrics, fingerprint and, when it
        hands its table on, the ``following`` call, started on it."""
        if call.worker_chain:
            started = handed or self._start_chain(step, call, table, extras)
            handed_on = self._start_chain(step, following, started.call, extras) if following is not None else None
            return (*self.finish_chain(step, started, table, fp), handed_on)
        if call.task_chain:
            return (*self.run_fused(step, list(call.nodes), table, fp, extras), None)
        return (*self.run_node(step, call.nodes[0], table, fp, extras), None)

    def _hooked(self, node: PlannedNode) -> bool:
        """Whether a mode hook fires before ``node``."""
        return bool(self.before_role.get(node.step_role))

    def _context(self, step: int, node: PlannedNode, extras: dict[str, Any]) -> StageContext:
        return StageContext(step=step, seed=self.seed, policy_version=self.policy_version,
                            dp_size=self.dp_size, extras=self.base_extras.merged(extras),
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

    def _start_chain(self, step: int, call: Call, source: Any, extras: dict[str, Any]) -> "_StartedChain":
        """Submit the worker chain ``call`` on ``source``: the step's table, or the started chain before it (which
        hands its table on)."""
        ctxs, stages, bound = self._chained(step, list(call.nodes), extras, call.role)
        start = time.time()
        handle = self.backend.start_worker_chain(call.role, stages, source, ctxs, call.hands_on)
        return _StartedChain(list(call.nodes), call.role, ctxs, handle, bound, start)

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
        """``group``, a run of task nodes, as one task (rlpipe.engine.execution.call_plan); then, per node, the same records and
        checks as :meth:`run_node`. See :meth:`_record_chain`."""
        ctxs, stages, bound = self._chained(step, group, extras, None)
        start = time.time()
        try:
            steps = self.backend.run_task_chain(stages, table, ctxs, bound)
        except Exception as exc:
            self._fail(step, group[0], table, input_fp, start, exc)
        return self._record_chain(step, group, ctxs, steps, table, input_fp, None)

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


@dataclasses.dataclass(frozen=True)
class StepRun:
    """A run of nodes begun by :meth:`StepExecutor.start` and not yet finished."""

    step: int
    table: pa.Table
    """Its input."""
    nodes: list[PlannedNode]
    extras: dict[str, Any]
    calls: tuple[Call, ...]
    """The calls it makes (:meth:`StepExecutor.calls`)."""
    first: "_StartedChain | None"
    """Its first call, submitted at the start (a worker chain), or None."""


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


def _rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    if len(rows) == table.num_rows and (len(rows) == 0 or np.all(np.diff(rows) == 1)):
        return table
    return table.take(pa.array(rows))
