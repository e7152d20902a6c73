"""The continuous rollout service of the async modes: a background decode loop around one engine.

A daemon thread inside the rollout worker process owns the stepping of a
:class:`~rlpipe.inference.contract.RolloutEngine`: while requests are in flight it
calls ``engine.step()`` and files finished trajectories by group; when there is
nothing to do it sleeps on a condition variable (no busy spin). Callers submit
prompt tables and collect *complete groups* (all ``n`` samples of a uid) as
trajectory tables in the generate stage's canonical schema — the requests and
rows come from the same helpers (:func:`rlpipe.stages.generate.group_requests`,
:func:`~rlpipe.stages.generate.trajectory_table`), so with the same prompts and
seed, and no pause, the service's rows equal the synchronous stage's bit for bit.

Partial rollout at a weight push (SPEC R6 boundaries 0 and 4; AReaL, Fu et al.
2025, https://arxiv.org/abs/2505.24298): ``pause()`` stops stepping and aborts
every in-flight request, keeping its partial tokens, logprobs and versions;
the caller loads the new weights (``load_weights``, or the engine directly);
``resume()`` resubmits each partial with ``GenerationResult.resume``, so it is
re-prefilled under the new weights and its ``token_versions`` switch from v to
v+1 exactly at the push. ``push_weights`` does the three in one call.

Concurrency: one condition variable guards the service state. The engine is
touched by the loop thread only between ``_stepping = True`` and ``False`` and by
callers only inside ``_engine_access()``, which asks the loop to yield (so a
caller waits at most one decode step) and holds the lock for its operation.
While the service is in use, drive the engine only through it.

Left out: releasing engine memory (sleep) while paused; aborting a single
request (the engine only aborts all), so ``drop`` of an in-flight group lets its
requests run out and discards their results; priorities between groups.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from rlpipe.inference.contract import RolloutEngine
from rlpipe.inference.contract import EngineError, GenerationRequest, GenerationResult
from rlpipe.errors import BatchError, RlpipeError
from rlpipe.schemas.batch import EXTRA_INFO, UID, column_type
from rlpipe.stages.generate import PASS_THROUGH, GenerateParams, group_requests, trajectory_table

log = logging.getLogger(__name__)

_EMPTY_PROMPTS = pa.table({name: pa.array([], type=column_type(name)) for name in PASS_THROUGH})


class RolloutServiceError(RlpipeError):
    """The rollout service cannot serve: it was shut down, or its decode loop died (the cause is chained)."""


TRAIN_LANE = "train"
"""The lane of training prompts. Another lane (``eval``: evaluation during an async run) shares the engine and
its weight pushes but is collected on its own, so its groups never reach the replay buffer."""


@dataclass
class _Group:
    """The ``n`` trajectories of one prompt, from submission to collection."""

    seq: int  # submission order: collected groups come out in it
    prompt: pa.Table  # one row, the PASS_THROUGH columns (and EXTRA_INFO when given) in canonical types
    requests: list[GenerationRequest]  # index = sample_index
    results: dict[int, GenerationResult] = field(default_factory=dict)
    lane: str = TRAIN_LANE  # which collect() takes it


def _split_id(request_id: str) -> tuple[str, int]:
    uid, _, index = request_id.rpartition("/")  # uids may contain "/"; sample indexes never do
    return uid, int(index)


class RolloutService:
    """Continuous generation on ``engine`` in a daemon thread; thread-safe submit/collect/pause/resume."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, name: str = "rollout-service"):
        self.engine = engine
        self.tokenizer = tokenizer
        self._cond = threading.Condition()
        self._groups: dict[str, _Group] = {}  # every uid from submission until collected or dropped
        self._ready: list[str] = []  # uids of complete groups, in completion order
        self._held: list[GenerationRequest] = []  # submitted while paused, not yet in the engine
        self._aborted: list[GenerationResult] = []  # partials waiting for resume()
        self._dropped: dict[str, int] = {}  # dropped uid -> its requests still in the engine
        self._seq = 0
        self._paused = False
        self._stopping = False
        self._stepping = False
        self._hold = 0  # callers waiting for, or holding, engine access
        self._error: BaseException | None = None
        self._counts = dict.fromkeys(
            ("steps", "tokens_generated", "requests_submitted", "requests_finished", "requests_aborted",
             "requests_resumed", "requests_dropped", "groups_completed", "groups_collected", "groups_dropped"), 0)
        self._in_engine = 0
        self._iterations = ({"decode_steps": 0.0, "decode_tokens": 0.0, "decode_s": 0.0, "decode_tokens_sq": 0.0,
                             "decode_token_s": 0.0, "decode_cpu_s": 0.0} if engine.decodes_in_process else None)
        """An in-process engine's decode iterations: sums over its steps of 1, k, t, k², k·t and c (t: the step's
        seconds, k: the requests it decoded, c: this thread's CPU seconds in it) — the least-squares fit
        t = a + b·k of an iteration's cost, and the CPU share the loop got (rlpipe.simulate calibrates its
        replicas on both). None for a server client, whose steps are waits, not iterations."""
        self._phase, self._since = "idle", time.perf_counter()
        self._seconds = {"busy": 0.0, "idle": 0.0, "paused": 0.0}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- the decode loop ------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    if self._paused or self._hold:
                        self._cond.wait()
                    elif not self.engine.has_active():
                        if self._in_engine:
                            self._lost()
                            return
                        self._cond.wait()
                    elif (wait := self.engine.next_ready_in()) > 0:
                        self._cond.wait(wait)  # only requests waiting for their environment: idle, not stepping
                    else:
                        break
                if self._stopping:
                    return
                self._stepping = True
                # each running request samples one token per step; waiting ones take none
                running = self.engine.num_running() - self.engine.num_waiting()
                self._enter("busy")
            clock = (time.perf_counter(), time.thread_time()) if self._iterations is not None else None
            try:
                results = self.engine.step()
            except BaseException as exc:  # noqa: BLE001 - surfaced to every caller, never swallowed
                log.exception("rollout service: engine step failed; the service stops")
                with self._cond:
                    self._error, self._stepping = exc, False
                    self._enter("idle")
                    self._cond.notify_all()
                return
            spent = (time.perf_counter() - clock[0], time.thread_time() - clock[1]) if clock is not None else None
            with self._cond:
                self._stepping = False
                self._enter("paused" if self._paused else "idle")
                self._counts["steps"] += 1
                self._counts["tokens_generated"] += running
                if spent is not None:
                    self._count_iteration(running, *spent)
                self._file(results)
                self._cond.notify_all()

    def _count_iteration(self, requests: int, seconds: float, cpu_s: float) -> None:
        sums = self._iterations
        sums["decode_steps"] += 1
        sums["decode_tokens"] += requests
        sums["decode_s"] += seconds
        sums["decode_tokens_sq"] += requests * requests
        sums["decode_token_s"] += requests * seconds
        sums["decode_cpu_s"] += cpu_s

    def _lost(self) -> None:
        """Requests vanished from the engine (lock held): someone drove it behind the service's back."""
        self._error = RolloutServiceError(
            f"{self._in_engine} request(s) vanished from the rollout engine: something called the engine "
            "(abort_all, a generate stage) directly while the service ran; at a weight push use the service's "
            "pause()/resume() (RolloutState.service_pause/service_resume or service_push_weights) instead"
        )
        log.error("%s", self._error)
        self._cond.notify_all()

    def _enter(self, phase: str) -> None:
        now = time.perf_counter()
        self._seconds[self._phase] += now - self._since
        self._phase, self._since = phase, now

    @contextmanager
    def _engine_access(self) -> Iterator[None]:
        """Hold the state lock with the loop parked between steps (it starts no step while held)."""
        with self._cond:
            self._check()
            self._hold += 1
            try:
                while self._stepping:
                    self._cond.wait()
                yield
            finally:
                self._hold -= 1
                self._cond.notify_all()

    def _check(self) -> None:
        if isinstance(self._error, RolloutServiceError):
            raise self._error
        if self._error is not None:
            raise RolloutServiceError(f"the rollout service's decode loop died: {self._error!r}") from self._error
        if self._stopping:
            raise RolloutServiceError("the rollout service was shut down; build a new one")

    def _file(self, results: Iterable[GenerationResult]) -> None:
        """Results out of the engine (lock held): finished ones to their group, partials to the resume list."""
        for result in results:
            self._in_engine -= 1
            uid, index = _split_id(result.request_id)
            if uid in self._dropped:
                self._dropped[uid] -= 1
                if not self._dropped[uid]:
                    del self._dropped[uid]
                continue
            if result.finish_reason == "abort":
                self._aborted.append(result)
                self._counts["requests_aborted"] += 1
                continue
            group = self._groups.get(uid)
            if group is None:  # cannot happen while every engine access goes through the service
                log.warning("rollout service: result %r of an unknown group dropped", result.request_id)
                continue
            group.results[index] = result
            self._counts["requests_finished"] += 1
            if len(group.results) == len(group.requests):
                self._ready.append(uid)
                self._counts["groups_completed"] += 1

    def _to_engine(self, requests: list[GenerationRequest]) -> None:
        self.engine.submit(requests)
        self._in_engine += len(requests)

    # -- requests in, groups out ----------------------------------------------------

    def submit(self, prompts: pa.Table, params: GenerateParams | Mapping[str, Any], seed: int,
               lane: str = TRAIN_LANE) -> int:
        """Queue ``params.n`` samples of every prompt row on ``lane``; returns the number of requests.

        Request ids are ``uid/sample_index`` and the seed is used as the generate
        stage uses it, so the tokens equal the stage's for the same prompts and seed.
        Invalid requests raise here (EngineError), except while paused: those are
        held and reach the engine, and raise, at ``resume()``.
        """
        if isinstance(params, Mapping):  # sampling fields only: an engine's `server` settings are not ours
            params = GenerateParams.model_validate({k: v for k, v in params.items() if k in GenerateParams.model_fields})
        missing = [name for name in PASS_THROUGH if name not in prompts.column_names]
        if missing:
            raise BatchError(f"rollout service: the prompt table lacks column(s) {missing}; "
                             f"prompts need {list(PASS_THROUGH)}")
        rows, _, requests = group_requests(prompts, params, seed)
        kept = (*PASS_THROUGH, *([EXTRA_INFO] if EXTRA_INFO in prompts.column_names else []))
        canonical = pa.table({n: prompts.column(n).cast(column_type(n)) for n in kept}).combine_chunks()
        uids = canonical.column(UID).to_pylist()
        with self._engine_access():
            busy = sorted(u for u in uids if u in self._groups or u in self._dropped)
            if busy:
                raise BatchError(f"rollout service: uid(s) {busy[:5]} are still in the service; "
                                 "collect or drop them before submitting the same uid again")
            if self._paused:
                self._held.extend(requests)
            else:
                self._to_engine(requests)
            for row, uid in enumerate(uids):
                own = requests[row * params.n : (row + 1) * params.n]
                self._groups[uid] = _Group(self._seq, canonical.slice(row, 1), own, lane=lane)
                self._seq += 1
            self._counts["requests_submitted"] += len(requests)
        return len(rows)

    def collect(self, min_groups: int = 0, timeout: float | None = None, max_groups: int | None = None,
                lane: str = TRAIN_LANE) -> pa.Table:
        """Trajectory rows of the complete groups of ``lane`` (partial groups stay), in submission order.

        With ``min_groups > 0`` blocks until that many groups are complete, until
        ``timeout`` seconds passed, or until every group of the lane in the service is
        complete (fewer than ``min_groups`` remain); ``min_groups=0`` never waits.
        ``max_groups`` caps how many (the earliest submitted) are taken.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._error is None:
                ready = [uid for uid in self._ready if self._groups[uid].lane == lane]
                if len(ready) >= min(min_groups, self._count(lane)):
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            if self._error is not None:
                self._check()
            ready = sorted(ready, key=lambda uid: self._groups[uid].seq)[:max_groups]
            taken = set(ready)
            self._ready = [uid for uid in self._ready if uid not in taken]
            groups = [self._groups.pop(uid) for uid in ready]
            self._counts["groups_collected"] += len(groups)
        return self._table(groups)

    def _count(self, lane: str) -> int:
        """Groups of ``lane`` in the service (lock held)."""
        return sum(1 for group in self._groups.values() if group.lane == lane)

    def _table(self, groups: list[_Group]) -> pa.Table:
        sizes = [len(g.requests) for g in groups]
        prompts = pa.concat_tables([g.prompt for g in groups]) if groups else _EMPTY_PROMPTS
        rows = np.repeat(np.arange(len(groups)), sizes)
        sample_index = np.concatenate([np.arange(n, dtype=np.int32) for n in sizes] or [np.zeros(0, np.int32)])
        results = [g.results[j] for g in groups for j in range(len(g.requests))]
        return trajectory_table(prompts.take(pa.array(rows, pa.int64())), sample_index, results, self.tokenizer)

    def drop(self, uids: Sequence[str]) -> int:
        """Forget the groups of ``uids`` (queued, running or complete); returns how many were known.

        Requests already in the engine run out; their results are discarded.
        """
        with self._cond:
            self._check()
            dropped = {uid for uid in uids if uid in self._groups}
            if not dropped:
                return 0
            outside = {uid: 0 for uid in dropped}  # unfinished requests that are not in the engine
            for request in [*self._held, *self._aborted]:
                uid = _split_id(request.request_id)[0]
                if uid in outside:
                    outside[uid] += 1
            for uid in dropped:
                group = self._groups.pop(uid)
                unfinished = len(group.requests) - len(group.results)
                self._counts["requests_dropped"] += unfinished
                if unfinished > outside[uid]:
                    self._dropped[uid] = unfinished - outside[uid]
            self._ready = [u for u in self._ready if u not in dropped]
            self._held = [r for r in self._held if _split_id(r.request_id)[0] not in dropped]
            self._aborted = [r for r in self._aborted if _split_id(r.request_id)[0] not in dropped]
            self._counts["groups_dropped"] += len(dropped)
            return len(dropped)

    # -- weight pushes --------------------------------------------------------------

    def pause(self) -> int:
        """Stop stepping and abort every in-flight request, keeping the partials; returns how many were aborted."""
        with self._engine_access():
            if self._paused:
                return 0
            self._paused = True
            self._enter("paused")
            before = self._counts["requests_aborted"]
            self._file(self.engine.abort_all())
            return self._counts["requests_aborted"] - before

    def load_weights(self, buckets: Sequence[Any], version: int) -> dict[str, float]:
        """Push weights of policy ``version`` into the engine; pause() first if requests are in flight.
        Returns the engine's load timings (see RolloutEngine.load_weights)."""
        with self._engine_access():
            if self._in_engine:
                raise EngineError(f"{self._in_engine} request(s) in flight: pause() the rollout service "
                                  "before a weight push")
            return self.engine.load_weights(buckets, version)

    def resume(self) -> int:
        """Resubmit the aborted partials (they continue on the current weights) and restart stepping.

        Returns how many partials were resumed. Requests submitted while paused
        join them; if those are invalid, their groups are forgotten and the
        EngineError is raised after the partials resumed.
        """
        with self._engine_access():
            if not self._paused:
                return 0
            partials, self._aborted = self._aborted, []
            held, self._held = self._held, []
            requests = []
            for partial in partials:
                uid, index = _split_id(partial.request_id)
                requests.append(partial.resume(self._groups[uid].requests[index]))
            self._to_engine(requests)
            self._counts["requests_resumed"] += len(requests)
            self._paused = False
            self._enter("idle")
            if held:
                try:
                    self._to_engine(held)
                except EngineError:
                    for uid in {_split_id(r.request_id)[0] for r in held}:
                        self._groups.pop(uid, None)
                    raise
            return len(requests)

    def push_weights(self, buckets: Sequence[Any], version: int) -> int:
        """pause() → load_weights() → resume() (unless it was paused already); returns how many were aborted."""
        was_paused = self.paused
        aborted = self.pause()
        self.load_weights(buckets, version)
        if not was_paused:
            self.resume()
        return aborted

    paused = property(lambda self: self._paused, doc="True between pause() and resume().")

    def in_service(self, lane: str = TRAIN_LANE) -> int:
        """Groups of ``lane`` submitted and not yet collected or dropped (queued, running, aborted or complete)."""
        with self._cond:
            return self._count(lane)

    # -- bookkeeping ----------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Cumulative counters and seconds since construction, and the current queue sizes.

        ``busy_s`` is time spent in ``engine.step()``, ``idle_s`` everything else
        (``paused_s`` is the paused part of it): diff two calls for an idle fraction. ``decode_*``: an
        in-process engine's decode iterations (see ``_iterations``).
        """
        with self._cond:
            seconds = dict(self._seconds)
            seconds[self._phase] += time.perf_counter() - self._since
            ready = set(self._ready)
            waiting = sum(len(g.results) for uid, g in self._groups.items() if uid not in ready)
            return {
                "busy_s": seconds["busy"],
                "idle_s": seconds["idle"] + seconds["paused"],
                "paused_s": seconds["paused"],
                **{k: float(v) for k, v in self._counts.items()},
                **(self._iterations or {}),
                "queued_requests": float(len(self._held)),
                "running_requests": float(self._in_engine),
                "aborted_requests": float(len(self._aborted)),
                "finished_waiting_for_group": float(waiting),
                "groups_ready": float(len(self._ready)),
                "groups_in_flight": float(len(self._groups) - len(self._ready)),
                "paused": float(self._paused),
                "version": float(self.engine.version),
            }

    def clear(self) -> int:
        """Abort everything and forget every group (the loop keeps running); returns the groups forgotten."""
        with self._engine_access():
            self.engine.abort_all()
            forgotten = len(self._groups)
            self._groups, self._ready, self._held, self._aborted, self._dropped = {}, [], [], [], {}
            self._in_engine = 0
            return forgotten

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread and abort whatever is in flight; idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.abort_all()
            self._in_engine = 0
