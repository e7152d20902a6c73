"""The calling thread's own clocks: its CPU seconds and, where the kernel reports it, the seconds it was ready to run
but waited for a core.

A stage's wall time on a machine whose cores other processes share (a CPU run, the test machine) holds three
things: its computing (CPU time), its waits for other work (I/O, other workers' answers, locks) and its waits for a
core while runnable (the run queue). Only the last depends on what else runs: wall time less the run-queue wait is
what the stage takes where it has the cores to itself — the cost ``rlpipe simulate`` calibrates on. Linux reports
the run-queue wait per thread in ``/proc/thread-self/schedstat`` (its second field, nanoseconds); elsewhere it is
unknown (None). Torch's other intra-op threads, where a stage has more than one, are not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

_SCHEDSTAT = "/proc/thread-self/schedstat"


def run_queue_wait_s() -> float | None:
    """Seconds this thread has waited for a core while runnable, since it started (None: not reported here)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ThreadClock:
    """A reading of this thread's clocks; :meth:`since` gives what the thread spent from it to now."""

    cpu_s: float
    wait_s: float | None

    @classmethod
    def now(cls) -> "ThreadClock":
        return cls(time.thread_time(), run_queue_wait_s())

    def since(self) -> tuple[float, float | None]:
        """(CPU seconds, run-queue seconds or None) of this thread since this reading (taken on the same thread)."""
        later = ThreadClock.now()
        wait = later.wait_s - self.wait_s if later.wait_s is not None and self.wait_s is not None else None
        return later.cpu_s - self.cpu_s, wait
