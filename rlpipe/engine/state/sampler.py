"""The sampler contract of the async modes, and the lock that shares one sampler between threads.

Kept apart from :mod:`rlpipe.engine.state.replay_buffer` because neither depends on the replay
buffer's algorithm: any sampler registered under kind ``sampler`` keeps :class:`Sampler`, and the
mode (:func:`rlpipe.modes.async_common.build_sampler`) wraps whichever one it built in
:class:`SharedSampler`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import pyarrow as pa

from rlpipe.stage import StageParams


class Sampler(Protocol):
    """What an async mode needs from a sampler; register an implementation under kind ``sampler``."""

    Params: type[StageParams]

    def add_prompts(self, prompts: pa.Table, submit_step: int) -> None: ...
    def next_pending(self, k: int) -> pa.Table: ...
    def add_trajectories(self, table: pa.Table) -> int: ...
    def sample(self, num_groups: int, consuming_step: int) -> pa.Table | None: ...
    def refill_needed(self, submit_step: int | None = None) -> int: ...
    def requeue(self, uids: list[str]) -> None: ...
    def state(self) -> dict[str, Any]: ...
    def load_state(self, state: dict[str, Any]) -> None: ...
    def metrics(self, consuming_step: int | None = None) -> dict[str, float]: ...
    # optional: room(submit_step) -> int, the prompts add_prompts admits beyond the capacity (separate_async's
    # mode_params.borrow needs it; the plan check says so)


class SharedSampler:
    """A sampler shared by threads — the driver and the rollout feeders storing groups (separate_async).

    Every method of the wrapped sampler runs under one lock (samplers need not be
    thread-safe), and every call wakes :meth:`sample_wait`, which blocks until a
    batch can be served instead of having the driver poll.
    """

    def __init__(self, sampler: Any):
        self.sampler = sampler
        self._cond = threading.Condition()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.sampler, name)
        if not callable(attr):
            return attr

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._cond:
                try:
                    return attr(*args, **kwargs)
                finally:
                    self._cond.notify_all()

        return locked

    def exchange(self, trajectories: pa.Table | None, max_prompts: int, wait_s: float = 0.0) -> tuple[int, pa.Table]:
        """A rollout replica's one round trip: store its finished samples, take up to ``max_prompts``
        pending prompts; returns (groups completed, prompts). With ``wait_s`` > 0 and room for prompts, waits up
        to that long for prompts to arrive (an idle replica's long poll: it wakes when the driver adds prompts
        instead of asking again every few milliseconds, each ask a round trip on the shared cores)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            try:
                completed = self.sampler.add_trajectories(trajectories) if trajectories is not None else 0
                prompts = self.sampler.next_pending(max_prompts)
                while not prompts.num_rows and max_prompts > 0 and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)  # every call on the buffer notifies: re-check
                    prompts = self.sampler.next_pending(max_prompts)
                return completed, prompts
            finally:
                self._cond.notify_all()

    def sample_wait(self, num_groups: int, consuming_step: int, timeout: float) -> pa.Table | None:
        """``sample``, retried whenever another call changed the buffer, for up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                batch = self.sampler.sample(num_groups, consuming_step)
                left = deadline - time.monotonic()
                if batch is not None or left <= 0:
                    return batch
                self._cond.wait(left)
