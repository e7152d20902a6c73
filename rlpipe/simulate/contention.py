"""Shared cores in ``rlpipe simulate``: how fast the trainer's nodes and the replicas' decode loops run beside each
other and the run's other processes.

On a machine where the trainer and the rollout replicas share CPU cores (a CPU run, this project's 2-core test
machine), two slowdowns are measured in an async recording and applied to the async modes:

* a replica's decode loop runs at ``decode_share`` of its own speed whenever it decodes (its iterations' CPU
  seconds over their wall seconds). What it loses goes to everything else that computes — the driver's collection
  rounds, its own process's feeder and Ray threads, the buffer, the tracking writes, the trainer — and in the
  recordings it hardly depends on the trainer: colocate_async's replica, which decodes mostly while the trainer is
  idle, and separate_async's, beside the trainer most of the time, got about the same share. So it is one number;
* a trainer node runs at ``node_share`` of its own speed while at least one replica decodes, and at its own speed
  otherwise (a node's own time is its wall time less its thread's wait for a core: ``NodeRecord.run_queue_s``).

A sync run's generate call decodes with nothing beside it: the schedule gives its replicas a share of 1. A node's
execution is a fluid job: its remaining work drains at the current rate, and a replica starting or stopping
decoding moves its finish. With both shares 1 (a sync recording, or a GPU cluster where the trainer and the rollout
do not share devices) nothing slows.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

from rlpipe.simulate.kernel import Kernel, Signal


@dataclass
class _Job:
    work: float
    """Seconds of its own speed still to run."""
    since: float
    done: Signal
    turn: int = 0


@dataclass
class Contention:
    """The node executions running now and the replicas whose decoding slows them (see the module)."""

    kernel: Kernel
    node_share: float = 1.0
    """A node's speed while a replica decodes (a share of its own)."""
    decode_share: float = 1.0
    """A replica's decode speed (a share of its own)."""
    replicas: list = field(default_factory=list)
    rate: float = 1.0
    """The speed the running node executions have now."""
    _jobs: list[_Job] = field(default_factory=list)

    def run(self, seconds: float) -> Generator:
        """A node's execution of ``seconds`` (its own speed); returns the seconds it took."""
        if self.node_share >= 1.0 or seconds <= 0:
            yield seconds
            return seconds
        began = self.kernel.now
        job = _Job(seconds, began, self.kernel.signal("node done"))
        self._advance_all()
        self.rate = self._rate()
        self._jobs.append(job)
        self._plan(job)
        yield job.done
        return self.kernel.now - began

    def replica_changed(self) -> None:
        """A replica started or stopped decoding."""
        rate = self._rate()
        if rate != self.rate:
            self._advance_all()
            self.rate = rate
            for job in self._jobs:
                self._plan(job)

    def _rate(self) -> float:
        return self.node_share if any(r.decoding for r in self.replicas) else 1.0

    def _advance_all(self) -> None:
        now = self.kernel.now
        for job in self._jobs:
            job.work -= (now - job.since) * self.rate
            job.since = now

    def _plan(self, job: _Job) -> None:
        job.turn += 1
        self.kernel.call_later(max(0.0, job.work) / self.rate, self._finish, job, job.turn)

    def _finish(self, job: _Job, turn: int) -> None:
        if turn != job.turn:
            return
        self._advance_all()
        self._jobs.remove(job)
        job.done.fire()
