"""The three modes' schedules, as simulated processes that follow the modes' own loops.

* ``sync`` (:mod:`rlpipe.modes.sync`): per step, one generate call split across the replicas,
  then the rest of the DAG; the push loads the replicas; the driver's gap; the next step.
* ``colocate_async`` (:mod:`rlpipe.modes.colocate_async`): step k+1's prompts are submitted as
  soon as step k has its batch; the driver collects finished groups and scores them only while it
  waits for a batch; before the update the engines are released (in-flight requests stop and
  resume after the push, on the new weights) unless ``release_memory_during_update`` is off.
* ``separate_async`` (:mod:`rlpipe.modes.separate_async`, ``_run_fed``): every replica's feeder
  pulls the prompts the buffer admits (at most ``capacity / replicas`` groups each), scores its
  finished groups itself and stores them; the trainer waits for a batch (``sample_wait``, retried
  on every buffer change, re-topping up every 1 s), trains, pushes without waiting for the
  replicas to load, and — off-policy — starts the next step at once on a batch already there.

Each schedule is a generator run by :class:`~rlpipe.simulate.kernel.Kernel`; when no batch can
ever come (nothing in flight, nothing admissible) it stops the run with the reason.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

# the real loops' own timings: the trainer's wait between top-ups, an idle feeder's long poll, a busy one's pulls
from rlpipe.engine.state.rollout_feeder import IDLE_WAIT_S, PULL_EVERY_POLLS
from rlpipe.modes.separate_async import HEALTH_CHECK_S
from rlpipe.simulate.buffer import BufferRefused, SimBuffer
from rlpipe.simulate.replica import Group, Replica
from rlpipe.simulate.simrun import SimRun


def sync(run: SimRun) -> Generator:
    s = run.setup
    for step in range(run.steps):
        groups = [run.draw_group(step) for _ in range(s.groups_per_step)]
        yield from run.generate_call(groups)
        run.consume(step, groups)
        yield from run.run_nodes(step, s.train, len(groups) * s.group_size, sum(g.tokens for g in groups))
        run.version += 1  # the push loaded every replica inside its node's time
        for replica in run.replicas:
            replica.version = run.version
        run.end_step(step)
        yield from run.gap()


def _buffer(run: SimRun) -> SimBuffer:
    s = run.setup
    run.buffer = SimBuffer(s.groups_per_step, s.threshold, s.strategy, s.capacity_steps)
    return run.buffer


def _head_cost(run: SimRun, groups: list[Group]) -> float:
    rows, tokens = len(groups) * run.setup.group_size, sum(g.tokens for g in groups)
    return sum(run.cost(node, rows, tokens) for node in run.setup.head)


def _check_guard(run: SimRun, step: int, groups: list[Group]) -> None:
    bound = run.setup.guard_bound
    worst = max(step - g.submit_step + 1 for g in groups)
    if bound is not None and worst > bound:
        run.fail(f"step {step}: the staleness guard's params.max_staleness={bound} refuses a group of staleness "
                 f"{worst} that the buffer lets through (max_off_policy_threshold={run.setup.threshold}); the real "
                 f"run fails here: set the guard's max_staleness to {run.setup.threshold} or drop it (it follows "
                 "the mode's bound)")


def _push(run: SimRun, released: bool, settled=None):
    """The hook of the push node: the replicas stop decoding while they load (or stay stopped since the release),
    then go on with the new version."""

    def at_push(node, seconds: float) -> Generator:
        if not released:
            for replica in run.replicas:
                replica.pause()
        if settled is not None:
            settled["pending"] += 1
        yield seconds
        run.version += 1
        for replica in run.replicas:
            replica.resume(run.version)
        if settled is not None:
            settled["pending"] -= 1
            settled["signal"].fire()

    return at_push


def colocate_async(run: SimRun) -> Generator:
    s, kernel = run.setup, run.kernel
    G, last = s.groups_per_step, run.steps - 1
    buf = _buffer(run)
    finished: list[Group] = []
    arrived = kernel.signal("group finished")

    def back(group: Group, replica: Replica) -> None:
        finished.append(group)
        arrived.fire()

    def submit(step: int, count: int) -> bool:
        try:
            buf.add_prompts(count, step)
        except BufferRefused as exc:
            run.fail(f"{exc}: colocate_async submits step {step + 1}'s prompts during step {step}, so they are "
                     f"consumed with staleness 2; set mode_params.max_off_policy_threshold=2 or overlap: false")
            return False
        pulled = buf.next_pending(1 << 30)
        for replica, part in zip(run.replicas, np.array_split(np.arange(len(pulled)), len(run.replicas))):
            for i in part:
                group = run.draw_group(pulled[i].submit_step)
                group.uid = pulled[i].uid
                run.submit(replica, group, back)
        return True

    release = s.overlap and s.release_during_update
    hooks = {"at:pushes_weights": _push(run, released=release)}
    if release:
        hooks["before:updates_policy"] = lambda node, _: _release(run)
    # its driver's round trips, where the recording's mode made none (run.calls): a sample per try, per collection
    # round the collect call, the scoring task (unless the recording's scoring was one: its duration holds it)
    # and the store; per submission the draw's store, the pending prompts' read and the replicas' submit
    scoring_trip = int(bool(s.head) and all(n.resource is not None for n in s.head))
    if not submit(0, G):
        return
    for step in range(run.steps):
        waited = kernel.now
        while True:
            yield from run.calls(1)
            if (batch := buf.sample(G, step)) is not None:
                break
            if not finished and not any(r.in_flight for r in run.replicas):
                run.fail(_starved(buf, step, G))
                return
            if not finished:
                yield (arrived, s.poll_s)
            yield from run.calls(1)
            got, finished[:] = list(finished), []
            if got:  # the driver scores what it collected (tasks it waits for), then stores it
                yield from run.calls(scoring_trip)
                yield from run.worker("driver").use(_head_cost(run, got))
                yield from run.calls(1)
                for group in got:
                    buf.add_group(group.uid, group)
            if run.stalled():
                return
        run.stats.trainer_wait_s.append(kernel.now - waited)
        groups = [p.group for p in batch]
        _check_guard(run, step, groups)
        if run.failure:
            return
        if s.overlap and step < last:
            yield from run.calls(3)
            if not submit(step, G):
                return
        run.consume(step, groups)
        yield from run.run_nodes(step, s.train, G * s.group_size, sum(g.tokens for g in groups), hooks)
        if not s.overlap and step < last:
            yield from run.calls(3)
            if not submit(step + 1, G):
                return
        run.end_step(step)
        yield from run.gap(turnaround=run.recorded_protocol)


def _release(run: SimRun) -> Generator:
    for replica in run.replicas:
        replica.pause()
    yield from run.calls(1)  # the driver's call that releases them, before the update's


def _starved(buf: SimBuffer, step: int, groups: int) -> str:
    c = buf.counts
    why = (f"{c['evicted_stale']} groups were evicted as staler than max_off_policy_threshold={buf.threshold}"
           if c["evicted_stale"] else f"the buffer holds {len(buf.prompts)} prompts")
    return (f"step {step} waits for {groups} groups and none can come: nothing is generating and {why}; "
            "raise mode_params.max_off_policy_threshold (or use strategy: wait)")


class _Feeders:
    """The rollout replicas' feeders and the refill thread of separate_async."""

    def __init__(self, run: SimRun, buf: SimBuffer):
        s = run.setup
        self.run, self.buf = run, buf
        self.changed = run.kernel.signal("buffer changed")
        self.settled = {"pending": 0, "signal": run.kernel.signal("push settled")}
        self.max_groups = -(-s.capacity_steps * s.groups_per_step // s.replicas)
        self.store = max(1, s.groups_per_step // (4 * s.replicas))
        self.holding = [0] * s.replicas  # groups a replica holds: submitted, not yet stored
        self.refill = None
        self.stopped = False
        for replica in run.replicas:
            run.kernel.process(self.feed(replica), f"feeder {replica.index}")

    def top_up(self, step: int) -> None:
        previous = self.refill
        self.refill = self.run.kernel.process(self._top_up(step, previous), f"top-up {step}")

    def _top_up(self, step: int, previous) -> Generator:
        if previous is not None:
            yield previous  # one refill thread: draws stay in order
        while self.settled["pending"]:  # prompts of `step` must be generated by versions ≥ step
            yield self.settled["signal"]
        try:
            added = self.buf.add_prompts(self.buf.refill_needed(step), step)
        except BufferRefused as exc:
            self.run.fail(str(exc))
            return
        if added:
            self.changed.fire()

    def idle(self, step: int) -> bool:
        """Nothing in flight anywhere and nothing more the buffer would admit: no batch can ever come."""
        busy = sum(self.holding) or self.buf.pending or (self.refill is not None and not self.refill.finished)
        return not busy and self.buf.refill_needed(step) == 0

    def feed(self, replica: Replica) -> Generator:
        s, run, kernel = self.run.setup, self.run, self.run.kernel
        finished: list[Group] = []
        arrived = kernel.signal(f"rollout[{replica.index}] group finished")
        scored: list[Group] = []
        last_pull = -np.inf

        def back(group: Group, r: Replica) -> None:
            finished.append(group)
            arrived.fire()

        while not self.stopped:
            held = self.holding[replica.index]
            in_service = held - len(scored)  # scored groups wait for this exchange to store them
            room = max(0, self.max_groups - in_service)
            due = in_service < self.store or kernel.now - last_pull >= PULL_EVERY_POLLS * s.poll_s
            if scored or (room and due):
                for group in scored:
                    self.buf.add_group(group.uid, group)
                self.holding[replica.index] -= len(scored)
                idle = not scored and not held
                if scored:
                    self.changed.fire()
                scored, last_pull = [], kernel.now
                prompts = self.buf.next_pending(room)
                if not prompts and idle and room:  # the long poll: wait in the buffer for prompts
                    yield (self.changed, IDLE_WAIT_S)
                    prompts = self.buf.next_pending(room)
                for p in prompts:
                    group = run.draw_group(p.submit_step)
                    group.uid = p.uid
                    run.submit(replica, group, back)
                self.holding[replica.index] += len(prompts)
            want = min(self.store, max(1, self.holding[replica.index] - len(scored)))
            deadline = kernel.now + s.poll_s
            while len(finished) < want and kernel.now < deadline:
                yield (arrived, deadline - kernel.now)
            got, finished[:] = list(finished), []
            if got:  # scored in the feeder's thread: the decode loop goes on meanwhile
                yield _head_cost(run, got)
                scored.extend(got)


def separate_async(run: SimRun) -> Generator:
    s, kernel = run.setup, run.kernel
    G = s.groups_per_step
    buf = _buffer(run)
    feeders = _Feeders(run, buf)
    hooks = {"at:pushes_weights": _push(run, released=False, settled=feeders.settled)}
    early = None
    try:
        for step in range(run.steps):
            waited = kernel.now
            feeders.top_up(step)
            batch, early = early, None
            while batch is None:
                deadline = kernel.now + HEALTH_CHECK_S
                while (batch := buf.sample(G, step)) is None and kernel.now < deadline:
                    yield (feeders.changed, deadline - kernel.now)
                if batch is not None or run.failure or run.stalled():
                    break
                if feeders.idle(step):
                    run.fail(_starved(buf, step, G))
                    break
                if feeders.refill.finished:
                    feeders.top_up(step)
            if run.failure:
                return
            feeders.changed.fire()  # a sample changes the buffer: idle feeders' long polls wake
            feeders.top_up(step)
            run.stats.trainer_wait_s.append(kernel.now - waited)
            groups = [p.group for p in batch]
            _check_guard(run, step, groups)
            if run.failure:
                return
            run.consume(step, groups)
            yield from run.run_nodes(step, s.train, G * s.group_size, sum(g.tokens for g in groups), hooks)
            if s.threshold >= 2 and step + 1 < run.steps:
                yield feeders.refill
                early = buf.sample(G, step + 1)
            run.end_step(step)
            # the driver's turnaround before the next step's training: with a batch sampled early, the replicas'
            # reports and the sample itself; else the records, then the wait for a batch
            yield from run.gap()
    finally:
        feeders.stopped = True


SCHEDULES = {"sync": sync, "colocate_async": colocate_async, "separate_async": separate_async}
"""Mode name → its simulated schedule."""
