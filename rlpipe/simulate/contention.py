"""Shared cores in ``rlpipe simulate``: the trainer's nodes and the replicas' decode loops slow each other down.

On a machine where the trainer and the rollout replicas share CPU cores (this project's 2-core
test machine, any CPU run), a node that computes while a replica decodes gets only part of a
core, and so does the replica. The model: the processes computing at a moment (each running
node execution, each decoding replica) share ``cores`` effective cores — each runs at
``min(1, cores / computing)`` of its own speed. ``cores`` is twice the calibration's
``overlap_share`` (the share each of a node and a replica got while both computed, measured
from an async recording; the rest of the machine went to the driver, the buffer, the tracking
process); with ``overlap_share = 1`` (a sync recording, where nothing overlapped; a GPU cluster,
where they do not share) every process runs at its own speed. The fitted costs are each one's
own, alone.

A node's execution is a fluid job: its remaining work drains at the current rate, and every
change of the computing set moves its finish; a replica's iteration costs ``1 / rate`` times its
own, and it advances its progress at the old rate before each change.
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
    """The computing node executions and replicas, sharing ``cores`` (see the module; None: unlimited)."""

    kernel: Kernel
    cores: float | None = None
    replicas: list = field(default_factory=list)
    rate: float = 1.0
    """The speed every computing process has now (a share of its own)."""
    _jobs: list[_Job] = field(default_factory=list)

    @classmethod
    def from_share(cls, kernel: Kernel, overlap_share: float) -> "Contention":
        return cls(kernel, 2.0 * overlap_share if overlap_share < 1.0 else None)

    def run(self, seconds: float) -> Generator:
        """A node's execution of ``seconds`` (its own speed); returns the seconds it took."""
        if self.cores is None or seconds <= 0:
            yield seconds
            return seconds
        began = self.kernel.now
        job = _Job(seconds, began, self.kernel.signal("node done"))
        self._advance_all()
        self._jobs.append(job)
        self._replan()
        yield job.done
        return self.kernel.now - began

    def replica_changed(self) -> None:
        """A replica started or stopped decoding (it advanced itself at the old rate already)."""
        if self.cores is not None:
            self._advance_all()
            self._replan()

    def _computing(self) -> int:
        return len(self._jobs) + sum(1 for r in self.replicas if r.decoding)

    def _advance_all(self) -> None:
        now = self.kernel.now
        for job in self._jobs:
            job.work -= (now - job.since) * self.rate
            job.since = now
        for replica in self.replicas:
            replica.advance()

    def _replan(self) -> None:
        self.rate = min(1.0, self.cores / max(1, self._computing()))
        for job in self._jobs:
            job.turn += 1
            self.kernel.call_later(max(0.0, job.work) / self.rate, self._finish, job, job.turn)
        for replica in self.replicas:
            replica.reschedule()

    def _finish(self, job: _Job, turn: int) -> None:
        if turn != job.turn:
            return
        self._advance_all()
        self._jobs.remove(job)
        self._replan()
        job.done.fire()
