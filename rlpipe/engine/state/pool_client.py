"""Calling a worker stage on a pool without waiting for it: the rollout feeder's reward-pool client.

In ``separate_async`` a rollout replica's feeder (:mod:`rlpipe.engine.state.rollout_feeder`)
hands its finished groups to the reward pool (the ``reward_model`` role's workers,
:mod:`rlpipe.engine.state.reward_pool`) and goes on collecting and submitting prompts while
the pool scores: :meth:`PoolClient.submit` splits the rows evenly over the pool's workers
and returns a :class:`PendingCall` at once; the feeder polls :meth:`PendingCall.ready`
between its own rounds and takes :meth:`PendingCall.result` when every worker answered.
While as many calls are out as the pool has workers (:attr:`PoolClient.saturated`) the
feeder leaves finished groups in its rollout service, so they reach the pool together in
one call instead of queueing one small call (and one round trip) per group.

Every call has a deadline: the stage's :class:`~rlpipe.stage.Unreachable` ``timeout_s``
(the reward stage's ``call_timeout_s``). Rows of a worker that has not answered by then,
or that died (a transport error), become the stage's unreachable result — status
``failed``, an infrastructure failure that DAPO and the advantages leave out — so a hung
judge costs a bounded wait and some failed rows, never a stalled rollout. A stage without
that hook fails the feeder instead (a :class:`~rlpipe.errors.StageError` past the node's
``timeout_s``). An error the stage itself raised (bad params, a bug) is re-raised.

The workers are Ray actor handles (:class:`~rlpipe.engine.execution.ray_worker.WorkerActor`)
or, in-process, the role's state objects (each call on a thread of this client: tests).
A call past its deadline is abandoned, not cancelled: the worker finishes it and drops the
answer (Ray cannot interrupt a running actor method), so a worker that hangs for good keeps
failing its rows until the run's ``trainer.max_failed_steps`` stops it.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from rlpipe.deadline import StageTimeout
from rlpipe.engine.stage_call import merge_results, run_stage, shard_rows
from rlpipe.errors import RlpipeError, StageError
from rlpipe.stage import StageContext, StageResult, stage_registry


class PoolWorkerLost(RlpipeError):
    """A pool worker died (or its answer was lost) while a call of a stage without an unreachable hook waited."""


class PendingCall:
    """One stage call spread over the pool's workers; ready when all answered or the deadline passed."""

    def __init__(self, node, table: pa.Table, shards: list[np.ndarray], futures: list[Any], remote: bool,
                 timeout_s: float | None, step: int, client: "PoolClient"):
        self.node, self.table, self.shards, self.futures, self.client = node, table, shards, futures, client
        self.remote, self.timeout_s, self.step = remote, timeout_s, step
        self.started = time.time()
        """Wall-clock start (lineage)."""
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def _done(self) -> list[bool]:
        if not self.remote:
            return [f.done() for f in self.futures]
        import ray

        ready, _ = ray.wait(self.futures, num_returns=len(self.futures), timeout=0)
        return [f in ready for f in self.futures]

    def ready(self) -> bool:
        """Every worker answered, or the deadline passed (never blocks)."""
        return all(self._done()) or (self.deadline is not None and time.monotonic() >= self.deadline)

    def result(self) -> StageResult:
        """The merged result; unanswered or lost shards get the stage's unreachable result (call after ``ready``)."""
        self.client.in_flight.discard(self)
        spec = stage_registry(self.node.kind).get(self.node.impl)
        params = spec.params_model.model_validate(self.node.params)
        results = []
        for future, rows, done in zip(self.futures, self.shards, self._done()):
            chunk = self.table.take(pa.array(rows))
            why = None if done else f"no answer within the per-call deadline of {self.timeout_s:g} s"
            if done:
                try:
                    results.append(self._value(future))
                    continue
                except PoolWorkerLost as exc:
                    why = str(exc)
            if spec.unreachable is None:
                if done:
                    raise PoolWorkerLost(f"stage {self.node.kind}/{self.node.impl}: {why}")
                raise StageTimeout(self.timeout_s, f"the {spec.role!r} pool (stage {self.node.kind}/{self.node.impl})")
            results.append(spec.unreachable.result(chunk, params, why))
        return merge_results(results, self.shards, creates_rows=False)

    def _value(self, future: Any) -> StageResult:
        if not self.remote:
            return future.result()  # run_stage raises StageError for what the stage raised
        import ray

        try:
            return ray.get(future)
        except ray.exceptions.RayTaskError as exc:  # the stage raised on the worker: re-raise its error
            cause = getattr(exc, "cause", None)
            if isinstance(cause, StageError):
                raise cause from None
            raise StageError(self.node.kind, self.node.impl, self.step, cause or exc) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.RaySystemError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PoolWorkerLost(f"pool worker lost: {first}") from None


class PoolClient:
    """The workers of one pool role as a caller that does not wait sees them."""

    def __init__(self, workers: list[Any]):
        if not workers:
            raise ValueError("a pool client needs at least one worker")
        self.workers = list(workers)
        self.remote = hasattr(getattr(self.workers[0], "run_stage", None), "remote")
        self._threads = None if self.remote else ThreadPoolExecutor(len(self.workers), thread_name_prefix="rlpipe-pool")
        self.in_flight: set[PendingCall] = set()
        """Calls submitted and not yet taken (``result``)."""

    @property
    def saturated(self) -> bool:
        """As many calls out as the pool has workers: a caller should let finished work pile up (one bigger
        call later) rather than queue many small calls, each paying a round trip."""
        return len(self.in_flight) >= len(self.workers)

    def submit(self, node, table: pa.Table, ctx: StageContext) -> PendingCall:
        """Start ``node`` (a worker stage) on ``table``, rows split evenly over the workers; returns at once."""
        spec = stage_registry(node.kind).get(node.impl)
        params = spec.params_model.model_validate(node.params)
        timeout_s = spec.unreachable.timeout_s(params) if spec.unreachable is not None else node.timeout_s
        shards = shard_rows(table, len(self.workers), False, "")
        futures: list[Any] = []
        for rank, (worker, rows) in enumerate(zip(self.workers, shards)):
            chunk, rank_ctx = table.take(pa.array(rows)), dataclasses.replace(ctx, dp_rank=rank)
            if self.remote:
                futures.append(worker.run_stage.remote(node.kind, node.impl, node.params, chunk, rank_ctx))
            else:
                futures.append(self._threads.submit(run_stage, node.kind, node.impl, node.params, chunk, rank_ctx,
                                                    worker))
        call = PendingCall(node, table, shards, futures, self.remote, timeout_s, ctx.step, self)
        self.in_flight.add(call)
        return call

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
