"""The rollout side of ``separate_async`` without the driver: pull prompts, generate, score, store.

A :class:`RolloutFeeder` is a daemon thread inside a rollout replica, next to
its :class:`~rlpipe.engine.state.rollout_service.RolloutService`. It keeps the
replica's service supplied with prompts pulled from the replay buffer
(``next_pending``), collects complete groups as they finish, runs the
generation-side stages (the reward, and whatever else sits between
``generate`` and the staleness guard) on them in this process, and stores the
scored groups in the buffer (``add_trajectories``). The driver then only adds
prompts, samples batches and trains: generation never waits for a driver round
trip, and scoring costs neither a Ray task nor a copy of the trajectories to the
driver (AReaL's rollout workers also score their own trajectories; Fu et al.
2025, https://arxiv.org/abs/2505.24298).

The generation-side stages are stateless (``placement: task``, run in the
feeder's thread) or run on a pool role's workers (the reward pool): those are
called without waiting (:mod:`rlpipe.engine.state.pool_client`) — the loop hands
the collected groups to the pool and keeps pulling prompts and collecting
generations, and stores the groups when the pool has answered (groups at the
pool count against the replica's ``max_groups``, so a slow pool slows pulling,
not generation of what is already submitted). Any other worker stage makes the
mode fall back to driver-side collection. Each execution is kept as a
lineage record (fingerprints, rows, versions, duration, metrics) that the
driver drains once per step and hands to the observer, so MLflow sees the same
``generate`` and ``reward`` executions as when the driver scores. The trainer's hybrid borrow
(:mod:`rlpipe.engine.state.borrowed_rollout`) runs its groups through the same two steps,
:func:`begin_scoring` and :func:`advance_scoring`.

A failure (an engine error, a reward stage raising) stops the feeder; the error,
a :class:`~rlpipe.errors.StageError` naming kind, impl and step, is raised by
the next ``drain()``. A *hung* feeder raises nothing: ``drain()`` reports how long
ago its loop last turned (``loop_age_s``) and its cumulative counters, from which
the driver tells a stall from slow progress (``mode_params.stall_timeout_s``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlpipe.deadline import StageTimeout, call_with_deadline
from rlpipe.engine.tracking.lineage import execution_fields
from rlpipe.engine.stage_call import apply_result, run_stage
from rlpipe.engine.state.pool_client import PendingCall, PoolClient
from rlpipe.errors import StageError
from rlpipe.schemas.batch import PROMPT_STEP, UID
from rlpipe.stage import StageContext, StepExtras

log = logging.getLogger(__name__)

PULL_EVERY_POLLS = 4
"""A replica that has work asks the buffer for new prompts at least every this many ``poll_s``."""
IDLE_WAIT_S = 0.25
"""How long an idle replica's ask for prompts waits in the buffer for some to arrive (a long poll: one round trip
per wait instead of one per ``poll_s``; the feeder's stop waits at most this long for it)."""


@dataclass(frozen=True)
class HeadStage:
    """One generation-side node as the feeder runs it (picklable: no functions, no plan)."""

    name: str
    kind: str
    impl: str
    params: dict[str, Any]
    writes: dict[str, pa.DataType]
    """The node's declared writes; its results are checked against them, as the executor does."""
    timeout_s: float | None = None
    """The node's ``timeout_s``: longer and the feeder stops with a StageError naming the node."""
    role: str | None = None
    """None: a task stage, run in the feeder's thread; a pool role (``reward_model``): the stage runs on
    that role's workers, called without waiting (:mod:`rlpipe.engine.state.pool_client`)."""


class SamplerClient:
    """The replay buffer as the feeder sees it: a Ray actor handle of the ``sampler`` role, or the object."""

    def __init__(self, target: Any):
        self.target = target
        self._remote = hasattr(getattr(target, "call", None), "remote")

    def __call__(self, method: str, *args: Any) -> Any:
        if self._remote:
            import ray

            return ray.get(self.target.call.remote(method, *args))
        return getattr(self.target, method)(*args)


class RolloutFeeder:
    """Keeps one rollout service fed from the buffer and the buffer fed with scored groups."""

    def __init__(self, service, sampler: SamplerClient, head: list[HeadStage], gen_params: dict[str, Any],
                 seed_of_step, max_groups: int, store_groups: int, poll_s: float, run_seed: int,
                 name: str = "rollout-feeder", pools: dict[str, PoolClient] | None = None):
        self.pools = dict(pools or {})
        """Pool role → client, for the head stages that run on a pool's workers."""
        missing = sorted({n.role for n in head if n.role is not None} - set(self.pools))
        if missing:
            raise ValueError(f"head stages run on the pool role(s) {missing}, but the feeder got no client for them")
        self.service = service
        self.sampler = sampler
        self.head = head
        self.gen_params = gen_params
        self.seed_of_step = seed_of_step
        """prompt_step → sampling seed (the generate stage's seed for that step on this replica)."""
        self.max_groups = max_groups
        """Groups this replica holds at most (submitted and not yet stored in the buffer)."""
        self.store_groups = store_groups
        """Complete groups to wait for (up to ``poll_s``) before scoring and storing: fewer round trips."""
        self.poll_s = poll_s
        self.run_seed = run_seed
        self.extras = StepExtras(temperature=float(gen_params.get("temperature", 1.0)))
        self._records: list[dict[str, Any]] = []
        self._generated: list[str] = []  # prompt uids this replica generated since the last drain (lineage)
        self._counts = {"pulled": 0, "stored_groups": 0, "score_s": 0.0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._beat = time.monotonic()
        """When the loop last started an iteration (a loop stuck in one call stops updating it)."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- the loop -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            parts: list[pa.Table] = []  # scored tables not yet stored
            pending: list[Scoring] = []  # collected tables still in the generation-side stages (the pool)
            last_pull = 0.0
            while not self._stop.is_set():
                self._beat = time.monotonic()
                # groups waiting for the pool count against this replica's share, as groups in generation do
                in_service = self.service.in_service()
                room = max(0, self.max_groups - in_service - sum(p.groups for p in pending))
                # ask for prompts with each store, at once when about to run dry, else every few polls
                # (new prompts join a long tail's small decode batch); a round trip per poll would
                # take more CPU from the trainer (on shared cores) than late prompts cost
                due = in_service < self.store_groups or time.monotonic() - last_pull >= PULL_EVERY_POLLS * self.poll_s
                scored = (parts[0] if len(parts) == 1 else pa.concat_tables(parts)) if parts else None
                if scored is not None or (room and due):
                    last_pull, parts = time.monotonic(), []
                    # with nothing to generate, collect or store, the buffer holds the call until prompts arrive
                    idle = scored is None and not in_service and not pending
                    stored, prompts = self.sampler("exchange", scored, room, IDLE_WAIT_S if idle else 0.0)
                    self._submit(prompts)
                    with self._lock:
                        self._counts["stored_groups"] += stored
                start = time.time()
                if any(pool.saturated for pool in self.pools.values()):
                    # every pool worker is busy: finished groups wait in the service (which goes on
                    # generating) and reach the pool together, in one call, when a worker is free
                    self._stop.wait(self.poll_s)
                else:
                    table = self.service.collect(min_groups=min(self.store_groups, max(1, self.service.in_service())),
                                                 timeout=self.poll_s)
                    if table.num_rows:
                        pending.append(self._begin(table, start))
                # advance every table as far as it goes without waiting (a pool call still running waits
                # for a later turn of the loop: generation goes on meanwhile)
                still = []
                for scoring in pending:
                    done = self._advance(scoring)
                    if done is None:
                        still.append(scoring)
                    else:
                        parts.append(done)
                pending = still
        except BaseException as exc:
            log.exception("rollout feeder stopped")
            self._error = exc

    def _submit(self, prompts: pa.Table) -> None:
        if prompts.num_rows == 0:
            return
        steps = prompts.column(PROMPT_STEP).to_numpy()
        distinct = np.unique(steps)
        for step in distinct:  # one seed per submission step, as the generate stage of that step
            rows = prompts.filter(pa.array(steps == step)) if len(distinct) > 1 else prompts
            self.service.submit(rows, self.gen_params, self.seed_of_step(int(step)))
        with self._lock:
            self._counts["pulled"] += prompts.num_rows

    def _begin(self, table: pa.Table, collect_start: float) -> Scoring:
        """A collected table entering the generation-side stages (its generate record kept for the driver)."""
        scoring = begin_scoring(table, collect_start, {"generate/collected_rows": float(table.num_rows)})
        with self._lock:
            self._generated.extend(scoring.uids)
        return scoring

    def _advance(self, s: Scoring) -> pa.Table | None:
        """Run ``s`` through the next stages until a pool call is still out (None) or all are done (the table)."""
        ctx = StageContext(step=s.step, seed=self.run_seed, policy_version=int(self.service.engine.version),
                           extras=self.extras)
        out = advance_scoring(s, self.head, self.pools, ctx, f"{self._thread.name} (the rollout replica's feeder)")
        if out is not None:
            with self._lock:
                self._records.extend(s.records)
                self._counts["score_s"] += sum(r["duration_s"] for r in s.records[1:])
        return out

    # -- the driver's side ---------------------------------------------------------

    def drain(self) -> dict[str, Any]:
        """Lineage records since the last drain, the prompt uids generated since then (``uids``: the driver
        notes this replica as theirs, for the trajectory lineage), cumulative counters and the age of the
        loop's last turn (``loop_age_s``); raises the feeder's error."""
        if self._error is not None:
            raise self._error
        with self._lock:
            records, self._records = self._records, []
            uids, self._generated = self._generated, []
            return {"records": records, "uids": uids, "counts": dict(self._counts),
                    "loop_age_s": time.monotonic() - self._beat}

    def stop(self, timeout: float = 10.0) -> None:
        """Stop pulling and storing (idempotent); what is in the service stays there."""
        self._stop.set()
        self._thread.join(timeout)
        for pool in self.pools.values():
            pool.close()


@dataclass
class Scoring:
    """Collected groups on their way through the generation-side stages."""

    table: pa.Table
    step: int
    """The prompt step of the rows' generate stage (the stages' ``ctx.step``)."""
    fp: str
    """Fingerprint of ``table`` (the next record's input)."""
    records: list[dict[str, Any]]
    uids: list[str]
    """The prompt uids of the groups in ``table`` (they count against the replica's ``max_groups``)."""
    next: int = 0
    """Index of the next head stage to run."""
    call: PendingCall | None = None
    """The pool call of head stage ``next`` while it runs."""

    @property
    def groups(self) -> int:
        return len(self.uids)


def begin_scoring(table: pa.Table, start: float, metrics: dict[str, float], prompts: pa.Table | None = None) -> Scoring:
    """Generated groups (``table``, generation began at ``start``) entering the generation-side stages, with the
    lineage record of their generation (``prompts``: its input, when known)."""
    step = int(table.column(PROMPT_STEP).to_numpy().max())  # what these rows' generate stage had as step
    record = {"node": "generate", **execution_fields(prompts, table, start, time.time() - start, metrics)}
    return Scoring(table, step, record["output_fingerprint"], [record], pc.unique(table.column(UID)).to_pylist())


def advance_scoring(s: Scoring, head: list[HeadStage], pools: dict[str, PoolClient], ctx: StageContext,
                    where: str) -> pa.Table | None:
    """Run ``s`` through its next head stages (a record each) until a pool call is still out (None: call again
    later) or all are done (the scored table). ``where`` names the caller in a timeout's message. Raises a
    StageError naming the node's kind, impl and the rows' step."""
    while s.next < len(head):
        node = head[s.next]
        try:
            if node.role is None:
                start = time.time()
                result = call_with_deadline(lambda: run_stage(node.kind, node.impl, node.params, s.table, ctx),
                                            node.timeout_s, where)
            else:
                if s.call is None:  # hand the rows to the pool and come back on a later turn
                    s.call = pools[node.role].submit(node, s.table, ctx)
                    return None
                if not s.call.ready():
                    return None
                start, result = s.call.started, s.call.result()
                s.call = None
            out = apply_result(node, s.table, result)
        except StageError:
            raise
        except StageTimeout as exc:
            raise StageError(node.kind, node.impl, s.step, f"node {node.name!r} timed out: {exc}") from None
        except Exception as exc:
            raise StageError(node.kind, node.impl, s.step, exc) from exc
        took = time.time() - start
        rec = {"node": node.name, **execution_fields(s.table, out, start, took, result.metrics, s.fp)}
        s.records.append(rec)
        s.table, s.fp, s.next = out, rec["output_fingerprint"], s.next + 1
    return s.table
