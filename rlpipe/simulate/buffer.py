"""The replay buffer as ``rlpipe simulate`` runs it: the rules of the real one, on integers.

:class:`rlpipe.engine.state.replay_buffer.ReplayBuffer` holds Arrow rows; the simulator needs
only its decisions, taken thousands of times per simulated run: which prompts are admitted
(``refill_needed``: capacity, and under ``wait`` the staleness schedule), which are pulled
(oldest first), which finished groups are evicted as stale (``drop``), and when ``sample``
serves a batch or blocks (``wait``). The rules are the real buffer's, and the wait schedule's arithmetic is its
own code (``wait_slack``, ``wait_room``); ``tests/simulate/test_buffer.py`` drives both with the same calls and checks they decide
alike. Left out: DAPO's uninformative-group eviction and infrastructure failures (the simulated
groups are all informative and all succeed).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from rlpipe.engine.state.replay_buffer import wait_room, wait_slack
from rlpipe.errors import RlpipeError

PENDING, RUNNING, FINISHED = "pending", "running", "finished"


class BufferRefused(RlpipeError):
    """Prompts submitted beyond what the ``wait`` schedule admits (the real buffer raises the same)."""


@dataclass
class Prompt:
    uid: int
    submit_step: int
    seq: int
    state: str = PENDING
    group: object | None = None
    """The finished group (rlpipe.simulate.replica.Group) once its samples are back."""


@dataclass
class SimBuffer:
    """Prompt states, staleness-bounded sampling and refill accounting (see the module docstring)."""

    groups_per_step: int
    threshold: int
    strategy: Literal["drop", "wait"]
    capacity_steps: int
    step: int = 0
    consumed_at_step: int = 0
    prompts: dict[int, Prompt] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("submitted", "consumed", "evicted_stale", "late", "not_ready", "blocked"), 0))
    evicted: list = field(default_factory=list)
    """The groups evicted as stale, in order (their lengths tell whether long rollouts starve)."""
    _heap: list = field(default_factory=list)
    _seq: int = 0

    @property
    def capacity(self) -> int:
        return self.capacity_steps * self.groups_per_step

    # -- prompts in ------------------------------------------------------------------------
    def add_prompts(self, count: int, submit_step: int) -> list[Prompt]:
        if count <= 0:
            return []
        if self.strategy == "wait" and count > (room := self._room(submit_step)):
            raise BufferRefused(f"strategy wait: {count} prompts submitted at step {submit_step} could not all be "
                                f"consumed within max_off_policy_threshold={self.threshold} steps (room for {room})")
        made = []
        for _ in range(count):
            p = Prompt(self._seq, submit_step, self._seq)
            self.prompts[p.uid] = p
            heapq.heappush(self._heap, (submit_step, p.seq, p.uid))
            self._seq += 1
            made.append(p)
        self.counts["submitted"] += count
        return made

    def refill_needed(self, submit_step: int | None = None) -> int:
        need = max(0, self.capacity - len(self.prompts))
        if self.strategy == "wait":
            need = min(need, self._room(self.step if submit_step is None else submit_step))
        return need

    def next_pending(self, k: int) -> list[Prompt]:
        picked: list[Prompt] = []
        while self._heap and len(picked) < k:
            _, seq, uid = heapq.heappop(self._heap)
            p = self.prompts.get(uid)
            if p is not None and p.state == PENDING and p.seq == seq:
                p.state = RUNNING
                picked.append(p)
        return picked

    @property
    def pending(self) -> int:
        return sum(p.state == PENDING for p in self.prompts.values())

    # -- groups in ---------------------------------------------------------------------------
    def add_group(self, uid: int, group: object) -> bool:
        """A prompt's finished group; False (counted late) when the prompt is no longer running."""
        p = self.prompts.get(uid)
        if p is None or p.state != RUNNING:
            self.counts["late"] += 1
            return False
        p.state, p.group = FINISHED, group
        return True

    # -- sampling -------------------------------------------------------------------------------
    def sample(self, num_groups: int, consuming_step: int) -> list[Prompt] | None:
        """The oldest ``num_groups`` finished prompts for ``consuming_step``, or None (not ready / blocked)."""
        self._at_step(consuming_step)
        if self.strategy == "drop":
            stale = [u for u, p in self.prompts.items() if p.state == FINISHED and self._age(p) > self.threshold]
            for uid in stale:
                self.evicted.append(self.prompts.pop(uid).group)
            self.counts["evicted_stale"] += len(stale)
        ready = sorted((p for p in self.prompts.values() if p.state == FINISHED), key=lambda p: (p.submit_step, p.seq))
        if len(ready) < num_groups:
            self.counts["not_ready"] += 1
            return None
        chosen = ready[:num_groups]
        if self.strategy == "wait" and not self._schedule_holds(chosen):
            self.counts["blocked"] += 1
            return None
        if any(self._age(p) > self.threshold for p in chosen):  # only when a schedule skipped a step under wait
            raise BufferRefused(f"strategy wait: a group submitted at step {chosen[0].submit_step} is consumed at "
                                f"step {self.step}, beyond max_off_policy_threshold={self.threshold}")
        for p in chosen:
            del self.prompts[p.uid]
        self.consumed_at_step += num_groups
        self.counts["consumed"] += num_groups
        return chosen

    def _age(self, p: Prompt, step: int | None = None) -> int:
        return (self.step if step is None else step) - p.submit_step + 1

    def _at_step(self, step: int) -> None:
        if step < self.step:
            raise ValueError(f"sample at step {step} after step {self.step}")
        if step > self.step:
            self.step, self.consumed_at_step = step, 0

    def _schedule_holds(self, chosen: list[Prompt]) -> bool:
        taken = {p.uid for p in chosen}
        left = np.array([p.submit_step for p in self.prompts.values() if p.uid not in taken], dtype=np.int64)
        remaining = max(0, self.groups_per_step - self.consumed_at_step - len(chosen))
        return wait_slack(left, remaining, self.step, self.step, self.threshold, self.groups_per_step) >= 0

    def _room(self, submit_step: int) -> int:
        live = np.array([p.submit_step for p in self.prompts.values()], dtype=np.int64)
        remaining = max(0, self.groups_per_step - self.consumed_at_step)
        return wait_room(live, remaining, submit_step, self.step, self.threshold, self.groups_per_step)
