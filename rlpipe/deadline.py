"""Bounded waits: a stage execution that runs past its ``timeout_s`` fails the run.

On Ray the driver waits for a stage's task or worker calls with ``ray.get(...,
timeout=)`` and, past the deadline, cancels the task or kills the hung worker
actor (its engine server dies with it). A call in this process (driver stages,
and every stage of the inline backend) cannot be preempted: Python cannot stop
a thread. :func:`call_with_deadline` runs it on a daemon thread and stops
*waiting* at the deadline; the run then fails, and the abandoned thread dies
with the process (a daemon thread never keeps the interpreter alive).

The threads are reused: a runner that finished its call waits for the next one.
A fresh thread per call is expensive for torch work on CPU: the thread gets a
new malloc arena (its tensors land on memory the kernel must fault in again),
and its first parallel region builds a new OpenMP team; on the 2-core machine
this costs a fwd+bwd+AdamW of the benchmark model 46 -> 56 ms. A runner whose
call timed out is never handed another one.

Runners are kept per *lane*: stage calls (the ``"stage"`` lane) go back to the
runner that ran the last one, never to one that wrote tracking records meanwhile.
Each thread that runs torch work with more than one intra-op thread owns an
OpenMP pool, and once a process's pools hold more threads than it has CPUs,
libgomp stops spinning at its barriers and puts threads to sleep at every parallel
region (a futex wake each; a halted vCPU wakes slowly). With stage work wandering
over three runners, two torch threads made the benchmark step 62 -> 90 ms.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from rlpipe.errors import RlpipeError


class StageTimeout(RlpipeError):
    """A stage execution ran longer than its node's ``timeout_s``; ``where`` names the worker it ran on."""

    def __init__(self, timeout_s: float, where: str):
        self.timeout_s = timeout_s
        self.where = where
        super().__init__(f"no result after timeout_s={timeout_s:g} s on {where}")

    def __reduce__(self):
        return (type(self), (self.timeout_s, self.where))


class _Call:
    """One call handed to a runner: the function, and its outcome once ``done`` is set."""

    def __init__(self, fn: Callable[[], Any], lane: str):
        self.fn = fn
        self.lane = lane
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class _Runner:
    """A daemon thread that runs the calls handed to it, one at a time, and goes back to the idle list
    after each, unless its caller stopped waiting (then it ends once the call does)."""

    def __init__(self) -> None:
        self._next: _Call | None = None
        self._wake = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="rlpipe-stage-runner", daemon=True)
        self.thread.start()

    def hand(self, call: _Call) -> None:
        with self._wake:
            self._next = call
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._next is None:
                    self._wake.wait()
                call, self._next = self._next, None
            try:
                call.value = call.fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                call.error = exc
            call.fn = None  # drop references to the stage's inputs while idle
            with _IDLE_LOCK:
                abandoned = call in _ABANDONED
                _ABANDONED.discard(call)
                if not abandoned:
                    _IDLE.setdefault(call.lane, []).append(self)
                call.done.set()  # under the lock: a caller at its deadline sees either done or abandoned
            if abandoned:
                return


_IDLE: dict[str, list[_Runner]] = {}  # per lane, the most recently used last
_ABANDONED: set[_Call] = set()
_IDLE_LOCK = threading.Lock()


def _forget_runners() -> None:
    """In a forked child: the parent's runner threads do not exist there."""
    global _IDLE_LOCK
    _IDLE.clear()
    _ABANDONED.clear()
    _IDLE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_runners)


def _take_runner(lane: str) -> _Runner:
    with _IDLE_LOCK:
        idle = _IDLE.get(lane)
        if idle:
            return idle.pop()
    return _Runner()


def call_with_deadline(fn: Callable[[], Any], timeout_s: float | None, where: str, lane: str = "stage") -> Any:
    """``fn()``'s result, or :class:`StageTimeout` once ``timeout_s`` has passed (None: wait forever).

    ``fn`` runs on a reused daemon thread of ``lane`` (the last one that lane used and is idle); past the
    deadline it is abandoned, not stopped. Calls that do no torch work (tracking writes) take a lane of their
    own, so that stage work stays on one thread."""
    if timeout_s is None:
        return fn()
    call = _Call(fn, lane)
    _take_runner(lane).hand(call)
    if not call.done.wait(timeout_s):
        with _IDLE_LOCK:
            if not call.done.is_set():  # still running: its runner is lost to us
                _ABANDONED.add(call)
                raise StageTimeout(timeout_s, f"{where} (a thread of this process; it cannot be stopped and is abandoned)")
    if call.error is not None:
        raise call.error
    return call.value
