"""The driver's calls to workers, bounded and named: the ``ctx.workers`` facade of driver stages.

Separate from the worker groups (rlpipe.engine.execution.worker_group) because a worker running a driver
stage in its own chain call (rlpipe.engine.execution.ray_worker) names and bounds its calls to the other
workers the same way, with :func:`get_naming_workers`.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import ray

from rlpipe.engine.execution.deferred import DeferredCalls
from rlpipe.engine.execution.ray_errors import actor_error_line
from rlpipe.errors import RlpipeError

if TYPE_CHECKING:
    from rlpipe.engine.execution.worker_group import WorkerGroup


class WorkerDied(RlpipeError):
    """A worker actor died (killed, out of memory, crashed) while the run needed it."""


class WorkerCallTimeout(RlpipeError):
    """Workers did not answer a call of the driver within resources.worker_call_timeout_s."""


def get_naming_workers(refs: list[ray.ObjectRef], timeout_s: float | None,
                       name: Callable[[ray.ObjectRef], tuple[str, str] | None]) -> list[Any]:
    """``ray.get(refs)`` within ``timeout_s`` (None: no bound); workers that do not answer are a
    :class:`WorkerCallTimeout`, a dead one a :class:`WorkerDied`, each named by ``name(ref)``: (worker, method)."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        _, late = ray.wait(refs, num_returns=len(refs), timeout=0)
        who = ", ".join(f"{n[0]}.{n[1]}" if (n := name(ref)) else "a worker" for ref in late)
        raise WorkerCallTimeout(
            f"no answer after resources.worker_call_timeout_s={timeout_s:g} s from {who}; if that call is only "
            "slow, raise it (-o resources.worker_call_timeout_s=SECONDS), otherwise look for what hangs in that "
            "worker (its log is in Ray's session folder, /tmp/ray/session_latest/logs, by pid)") from None
    except ray.exceptions.RayActorError as exc:
        dead = next((ref for ref in refs if actor_died(ref)), None)
        named = name(dead) if dead is not None else None
        who = f"worker {named[0]}" if named else "a worker"
        raise WorkerDied(f"{who} died: {actor_error_line(exc)} (its log is in Ray's session folder, "
                         "/tmp/ray/session_latest/logs, by pid)") from None


def actor_died(ref: ray.ObjectRef) -> bool:
    """Whether ``ref`` is ready and failed because its actor died."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 - not ready, or another error: not this one
        return False
    return False


ORIGINS_KEPT = 4096
"""How many recent worker-call futures remember which worker they went to (to name a dead one)."""


class RayWorkerCalls(DeferredCalls):
    """The ``ctx.workers`` facade of driver stages, backed by the run's worker groups."""

    def __init__(self, groups: "dict[str, WorkerGroup]", timeout_s: float | None = None):
        self.groups = groups
        self.timeout_s = timeout_s
        """Bound on every :meth:`resolve` (resources.worker_call_timeout_s); None: wait forever."""
        self._origin: dict[ray.ObjectRef, tuple[str, int, str]] = {}
        self._origin_lock = threading.Lock()  # the async modes' helper threads call too
        self.while_waiting: Callable[[], None] = lambda: None
        """Driver work done before blocking in :meth:`resolve` (set by :meth:`RayBackend.overlap`)."""
        self._round_trips: list[float] = []
        super().__init__()

    def call(self, role: str, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[Any]:
        began = time.perf_counter()
        try:
            return self.resolve(self.call_async(role, method, *args, rank=rank, **kwargs))
        finally:
            with self._origin_lock:
                self._round_trips.append(time.perf_counter() - began)

    def take_round_trips(self) -> list[float]:
        """The seconds of every :meth:`call` since the last take (its round trip on the driver's path: submission,
        the worker's work, the answer; the driver's own work while waiting included), oldest first."""
        with self._origin_lock:
            trips, self._round_trips = self._round_trips, []
        return trips

    def call_async(self, role: str, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[Any]:
        """Like call, but returns futures that can be passed as arguments to later calls."""
        refs = self.groups[role].call_async(method, *args, rank=rank, **kwargs)
        with self._origin_lock:
            for r, ref in zip(range(self.groups[role].size) if rank is None else [rank], refs):
                self._origin[ref] = (role, r, method)
            while len(self._origin) > ORIGINS_KEPT:
                del self._origin[next(iter(self._origin))]
        return refs

    def resolve(self, futures: list[Any]) -> list[Any]:
        """The values of ``call_async`` results (blocks until they are ready); a dead worker is a
        :class:`WorkerDied` naming it (role, rank, pid)."""
        futures = list(futures)
        self.while_waiting()
        try:
            return get_naming_workers(futures, self.timeout_s, self._name)
        finally:
            with self._origin_lock:
                for ref in futures:
                    self._origin.pop(ref, None)

    def _name(self, ref: ray.ObjectRef) -> tuple[str, str] | None:
        with self._origin_lock:
            origin = self._origin.get(ref)
        return (self.groups[origin[0]].name(origin[1]), origin[2]) if origin else None

    def defer(self, futures: list[Any], failure: str, origins: list[tuple[str, int, str] | None] | None = None) -> None:
        """As :meth:`DeferredCalls.defer`; ``origins``: who answers each future (role, rank, method), when another
        worker made the call (a driver stage in its chain), so that a dead one is named."""
        with self._origin_lock:
            for ref, origin in zip(futures, origins or []):
                if origin is not None:
                    self._origin[ref] = origin
        super().defer(futures, failure)

    def has_role(self, role: str) -> bool:
        return role in self.groups

    def colocated(self, role: str, other: str) -> bool:
        """Whether the workers of ``role`` also host ``other`` (resources.colocate), rank for rank."""
        return role in self.groups and other in self.groups and self.groups[role].host == self.groups[other].host

    def handle(self, role: str, rank: int = 0) -> Any:
        """The actor of one worker, to pass to another worker (which calls it through ``call.remote``)."""
        return self.groups[role].actors[rank]
