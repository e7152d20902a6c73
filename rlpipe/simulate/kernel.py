"""The discrete-event kernel of ``rlpipe simulate``: a simulated clock, a heap of events, processes.

Nothing here sleeps: :meth:`Kernel.run` pops the earliest event, moves the clock to its time
and runs it, so a simulated 100-step run costs only the events it schedules (a few per node
execution and per finished trajectory).

A *process* is a generator that yields what it waits for, as SimPy's do (the modes'
schedules read like the modes' own loops this way):

* a number — wait that many simulated seconds;
* a :class:`Signal` — wait until something fires it (a buffer change, a replica going idle);
* ``(signal, timeout)`` — either, whichever comes first (the mode's ``sample_wait`` with its
  health-check timeout); the process gets ``True`` back when the signal fired.

A process that yields a :class:`Process` waits for it to end. Left out: priorities between
events at the same time (they run in the order they were scheduled), interrupts.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator
from typing import Any

Waitable = Any  # float | Signal | tuple[Signal, float] | Process


class Signal:
    """Something processes wait for; :meth:`fire` resumes every waiter (at the current time)."""

    def __init__(self, kernel: "Kernel", name: str = ""):
        self.kernel = kernel
        self.name = name
        self._waiters: list[Callable[[bool], None]] = []

    def wait(self, resume: Callable[[bool], None]) -> None:
        self._waiters.append(resume)

    def discard(self, resume: Callable[[bool], None]) -> None:
        """Forget a waiter (its wait timed out): a signal waited on with a timeout in a loop keeps no backlog."""
        try:
            self._waiters.remove(resume)
        except ValueError:
            pass

    def fire(self) -> None:
        waiters, self._waiters = self._waiters, []
        for resume in waiters:
            self.kernel.call_soon(resume, True)

    @property
    def waiting(self) -> int:
        return len(self._waiters)


class Process:
    """A generator driven by the kernel (see the module docstring for what it may yield)."""

    def __init__(self, kernel: "Kernel", body: Generator[Waitable, Any, Any], name: str = ""):
        self.kernel = kernel
        self.body = body
        self.name = name
        self.done = Signal(kernel, f"{name} done")
        self.finished = False
        self.result: Any = None
        self._turn = 0  # a resume from an earlier wait (the timeout of a signal that fired) is ignored
        kernel.call_soon(self._step, None, 0)

    def _step(self, value: Any, turn: int) -> None:
        if turn != self._turn or self.finished:
            return
        self._turn += 1
        try:
            waited = self.body.send(value)
        except StopIteration as stop:
            self.finished, self.result = True, stop.value
            self.done.fire()
            return
        self._wait(waited, self._turn)

    def _wait(self, waited: Waitable, turn: int) -> None:
        resume = lambda value: self._step(value, turn)  # noqa: E731 - bound to this turn
        if isinstance(waited, (int, float)):
            self.kernel.call_later(float(waited), resume, None)
        elif isinstance(waited, Signal):
            waited.wait(resume)
        elif isinstance(waited, Process):
            if waited.finished:
                self.kernel.call_soon(resume, waited.result)
            else:
                waited.done.wait(lambda _: resume(waited.result))
        elif isinstance(waited, tuple) and len(waited) == 2 and isinstance(waited[0], Signal):
            signal, timeout = waited
            signal.wait(resume)

            def timed_out(_: bool) -> None:
                signal.discard(resume)
                resume(False)

            self.kernel.call_later(float(timeout), timed_out, False)
        else:
            raise TypeError(f"process {self.name!r} yielded {waited!r}; yield seconds, a Signal, (Signal, timeout) "
                            "or a Process")


class Kernel:
    """The simulated clock and its event heap."""

    def __init__(self):
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.events = 0
        """Events run so far (a cost measure: the simulated run's work)."""

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        heapq.heappush(self._heap, (self.now + delay, next(self._seq), fn, args))

    def call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        self.call_later(0.0, fn, *args)

    def call_at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        self.call_later(max(0.0, when - self.now), fn, *args)

    def signal(self, name: str = "") -> Signal:
        return Signal(self, name)

    def process(self, body: Generator[Waitable, Any, Any], name: str = "") -> Process:
        return Process(self, body, name)

    def run(self, until: Callable[[], bool], max_events: int = 5_000_000) -> bool:
        """Run events until ``until()`` holds (True) or none is left (False: nothing more can happen)."""
        while not until():
            if not self._heap:
                return False
            if self.events >= max_events:
                raise RuntimeError(f"simulation ran {max_events} events without finishing; a schedule loops")
            when, _, fn, args = heapq.heappop(self._heap)
            self.now = max(self.now, when)
            self.events += 1
            fn(*args)
        return True

    @property
    def pending(self) -> int:
        return len(self._heap)
