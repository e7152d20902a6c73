"""What every simulated schedule shares: workers, replicas, draws, the step DAG runner, the statistics.

A :class:`SimRun` holds one simulated run of a :class:`~rlpipe.simulate.setup.SimSetup` with the
costs of a :class:`~rlpipe.simulate.calibration.Calibration`; the modes' schedules
(:mod:`rlpipe.simulate.schedules`) drive it. The step DAG's nodes run as processes: a node
starts when the nodes it depends on are done and its worker is free (a task node waits for no
worker), so independent branches overlap as the executor overlaps them.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import numpy as np

from rlpipe.simulate.calibration import Calibration
from rlpipe.simulate.contention import Contention
from rlpipe.simulate.kernel import Kernel
from rlpipe.simulate.replica import Group, Replica
from rlpipe.simulate.setup import SimNode, SimSetup

STALL_HORIZON_S = 3600.0
"""Simulated seconds without a finished step after which a run is declared stuck (a backstop: the schedules
name the cause sooner when nothing is in flight)."""


class Worker:
    """A worker process (the trainer, the reference, the driver): one call at a time, calls queue."""

    def __init__(self, kernel: Kernel, name: str):
        self.kernel = kernel
        self.name = name
        self.busy_s = 0.0
        self._free = True
        self._queue: deque = deque()

    def use(self, seconds: float, contention: Contention | None = None) -> Generator:
        """Run ``seconds`` of work when free (slowed where ``contention`` says the cores are shared)."""
        while not self._free:
            turn = self.kernel.signal(f"{self.name} free")
            self._queue.append(turn)
            yield turn
        self._free = False
        if contention is None:
            yield seconds
        else:
            seconds = yield from contention.run(seconds)
        self.busy_s += seconds
        self._free = True
        if self._queue:
            self._queue.popleft().fire()


@dataclass
class Consumed:
    """One group as the trainer consumed it."""

    step: int
    staleness: int
    version_lag: int
    versions_spanned: int
    tokens: int
    longest: int


@dataclass
class Stats:
    """What a simulated run did, as it went (summarised by rlpipe.simulate.predict.summarise)."""

    step_end: list[float] = field(default_factory=list)
    consumed: list[Consumed] = field(default_factory=list)
    trainer_wait_s: list[float] = field(default_factory=list)
    submitted: int = 0
    """Prompts submitted (each one a group of n requests)."""
    uncalibrated: set[str] = field(default_factory=set)
    """Nodes without recorded executions (costed 0 s)."""


class SimRun:
    """One simulated run (see the module docstring)."""

    def __init__(self, setup: SimSetup, calibration: Calibration, steps: int):
        self.setup = setup
        self.cal = calibration
        self.steps = steps
        self.kernel = Kernel()
        self.rng = np.random.default_rng(setup.seed)
        self.version = 0
        """The trainer's policy version (one more after every push)."""
        gen = calibration.generate
        self.contention = Contention(self.kernel, calibration.trainer_share,
                                     calibration.rollout_share if setup.mode != "sync" else 1.0)
        """How the trainer's nodes and the replicas slow each other (rlpipe.simulate.contention): a sync run's
        generate call decodes with nothing beside it."""
        self.replicas = [Replica(self.kernel, i, gen.coef.get("decode_steps", 0.0), gen.coef.get("tokens", 0.0),
                                 self._unrouted, contention=self.contention) for i in range(setup.replicas)]
        self.contention.replicas = self.replicas
        self.workers: dict[str, Worker] = {}
        self.stats = Stats()
        self.failure: str | None = None
        """Why the run cannot go on (None while it can)."""
        self.buffer = None
        """The async modes' replay buffer (rlpipe.simulate.buffer.SimBuffer)."""
        self._uids = itertools.count()
        self._lengths = [np.asarray(g, dtype=np.int64) for g in calibration.group_lengths if len(g)]
        self._flat = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)

    # -- draws ----------------------------------------------------------------------------------
    def draw_group(self, submit_step: int) -> Group:
        """A new prompt's group: a recorded group's lengths resampled whole (one length at a time when the
        group size changed), capped at the simulated max_tokens."""
        n, cap = self.setup.group_size, self.setup.max_tokens
        if self._lengths and len(self._lengths[0]) == n:
            lengths = self._lengths[int(self.rng.integers(len(self._lengths)))]
        elif len(self._flat):
            lengths = self._flat[self.rng.integers(len(self._flat), size=n)]
        else:
            lengths = np.full(n, cap)
        return Group(next(self._uids), submit_step, np.minimum(lengths, cap).tolist())

    def ready_times(self, count: int) -> list[float]:
        """When each of ``count`` requests may start: now plus its environment latency (a Pareto draw, as
        rlpipe.stages.generate.env_latencies)."""
        s = self.setup
        if not s.env_latency_s:
            return [self.kernel.now] * count
        u = self.rng.uniform(size=count)
        latency = np.minimum(s.env_latency_s * (1.0 - u) ** (-1.0 / s.pareto_alpha), s.env_latency_max_s)
        return (self.kernel.now + latency).tolist()

    # -- costs ------------------------------------------------------------------------------------
    def cost(self, node: SimNode, rows: float, tokens: float) -> float:
        fit = self.cal.nodes.get(node.name)
        if fit is None:
            self.stats.uncalibrated.add(node.name)
            return 0.0
        return fit(rows=rows, tokens=tokens)

    def worker(self, name: str) -> Worker:
        if name not in self.workers:
            self.workers[name] = Worker(self.kernel, name)
        return self.workers[name]

    # -- generation -----------------------------------------------------------------------------------
    def _unrouted(self, group: Group, replica: Replica) -> None:
        raise RuntimeError(f"group {group.uid} finished on rollout[{replica.index}] with no one to take it")

    def submit(self, replica: Replica, group: Group, on_done: Callable[[Group, Replica], None]) -> None:
        group.on_done = on_done
        self.stats.submitted += 1
        replica.submit(group, self.ready_times(len(group.lengths)))

    def generate_call(self, groups: list[Group]) -> Generator:
        """A sync generate call: the prompts split across the replicas (as submit_to_replicas splits them), each
        replica pays the call overhead and decodes its share; done when every group is back."""
        left = {"groups": len(groups)}
        done = self.kernel.signal("generate call done")

        def back(group: Group, replica: Replica) -> None:
            left["groups"] -= 1
            if not left["groups"]:
                done.fire()

        # a sync recording's calls hold their overhead; from an async one, whose replicas decode without calls, it
        # is a driver call's round trip
        overhead = self.cal.generate.intercept_s if self.cal.generate_source == "calls" else self.cal.call_s
        for replica, part in zip(self.replicas, np.array_split(np.arange(len(groups)), len(self.replicas))):
            if len(part):
                self.kernel.process(self._call_on(replica, [groups[i] for i in part], overhead, back))
        if groups:
            yield done

    def _call_on(self, replica: Replica, groups: list[Group], overhead: float, back) -> Generator:
        yield overhead  # wake, prefill, round trip: the replica does nothing else meanwhile
        replica.busy_s += overhead
        for group in groups:
            self.submit(replica, group, back)

    # -- the step DAG ---------------------------------------------------------------------------------
    def run_nodes(self, step: int, nodes: list[SimNode], rows: float, tokens: float,
                  hooks: dict[str, Callable[[SimNode, float], Generator | None]] | None = None) -> Generator:
        """Run ``nodes`` (a DAG in run order) on their workers; ``hooks[f"before:{role}"]`` / ``[f"at:{role}"]``
        of a node's step role run before it takes its worker / when it starts (with its duration)."""
        hooks = hooks or {}
        procs = {}
        for node in nodes:
            deps = [procs[d] for d in node.depends_on if d in procs]
            procs[node.name] = self.kernel.process(self._node(node, deps, rows, tokens, hooks), node.name)
        for proc in procs.values():
            yield proc

    def _node(self, node: SimNode, deps, rows: float, tokens: float, hooks) -> Generator:
        for dep in deps:
            yield dep
        before = hooks.get(f"before:{node.step_role}")
        if before is not None:
            body = before(node, 0.0)
            if body is not None:
                yield from body
        dispatch = self.cal.dispatch_s.get(node.name, 0.0)
        if dispatch:
            yield dispatch  # the executor's work between calls (records, the next submission)
        seconds = self.cost(node, rows, tokens)
        at = hooks.get(f"at:{node.step_role}")
        if at is not None:
            body = at(node, seconds)
            if body is not None:
                self.kernel.process(body, f"{node.name} side effect")
        if node.resource is None:
            yield from self.contention.run(seconds)
        else:
            yield from self.worker(node.resource).use(seconds, self.contention)

    # -- bookkeeping ------------------------------------------------------------------------------------
    def consume(self, step: int, groups: list[Group]) -> None:
        for g in groups:
            lo = g.min_version if g.min_version is not None else self.version
            hi = g.max_version if g.max_version is not None else lo
            self.stats.consumed.append(Consumed(step, step - g.submit_step + 1, self.version - lo, hi - lo + 1,
                                                g.tokens, max(g.lengths, default=0)))

    def end_step(self, step: int) -> None:
        self.stats.step_end.append(self.kernel.now)

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason

    def stalled(self) -> bool:
        """The backstop: no step finished for STALL_HORIZON_S simulated seconds."""
        last = self.stats.step_end[-1] if self.stats.step_end else 0.0
        if self.kernel.now - last > STALL_HORIZON_S:
            self.fail(f"no step finished in {STALL_HORIZON_S:.0f} simulated seconds")
        return self.failure is not None

    @property
    def recorded_protocol(self) -> bool:
        """The recording is of the simulated mode: its gaps and dispatches hold the driver's protocol."""
        return self.setup.mode == self.cal.recorded_mode

    def calls(self, count: int) -> Generator:
        """``count`` round trips of the driver's protocol (Calibration.call_s each), where the recording's mode made
        none (:attr:`recorded_protocol`)."""
        if count and self.cal.call_s and not self.recorded_protocol:
            yield from self.worker("driver").use(count * self.cal.call_s)

    def gap(self, turnaround: bool = True) -> Generator:
        """The driver's time between steps: its records of a step, and in an async mode with ``turnaround`` the
        turnaround the recording measured (colocate_async simulated from another mode's recording passes False: its
        protocol's calls are charged where they happen, :meth:`calls`)."""
        cal = self.cal
        yield from self.worker("driver").use(cal.step_gap_s if turnaround and self.setup.mode != "sync"
                                             else cal.sync_gap_s)
