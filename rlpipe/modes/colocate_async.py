"""``colocate_async`` mode: generation of step k+1 overlaps the tail of step k.

As soon as step k's batch is complete, the prompts of step k+1 are submitted to
the rollout engine, which generates them with version k while step k's reward,
old_log_prob, ref and advantage nodes run. Rollout and training share the
devices, so before the update the engine aborts its in-flight requests (keeping
their partial tokens) and releases its memory; at step k's weight push version
k+1 is loaded and they resume (partial rollout): a trajectory can carry tokens
of versions k and k+1, never older. So the version lag is ≤ 1 and, with
prompts submitted during step k and consumed at step k+1, the staleness
(consuming − submission step + 1) is ≤ 2 — checked by the guard each step.
``overlap: false`` submits step k's prompts only at step k, which is the sync
schedule exactly (the zero-staleness invariant).
"""

from __future__ import annotations

import time

from pydantic import Field

from rlpipe.modes.async_common import AsyncMode, AsyncParams, RolloutStalled, check_async, group_order
from rlpipe.registry import registry


class ColocateAsyncParams(AsyncParams):
    """Params of colocate_async (the buffer's threshold is fixed by the mode's structure)."""

    overlap: bool = True
    """Generate step k+1 during the training of step k (False: strict alternation, equals sync)."""
    max_off_policy_threshold: int = Field(2, ge=1, le=2)
    """Structural: 2 with overlap (prompts of step k+1 are submitted during step k), 1 without."""
    strategy: str = "wait"
    """Nothing is ever dropped: every submitted batch is consumed at the next step."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """Fail the run when, while the trainer waits for a batch, no finished group has come from the rollout
    engine for this many seconds (a hung engine or environment)."""
    release_memory_during_update: bool = True
    """Shared devices: before the update, abort in-flight generation (resumed after the push) and
    free the engine's weights, so generation overlaps only the tail before the update (reward,
    old_log_prob, ref, advantage). False keeps generating through the update (more overlap,
    which only separate devices can afford)."""


@registry("mode").register("colocate_async")
class ColocateAsyncMode(AsyncMode):
    """One-step overlap with partial rollout at every weight push."""

    Params = ColocateAsyncParams

    @classmethod
    def check(cls, config, plan) -> None:
        check_async(config, plan)

    def __init__(self, runtime, params: ColocateAsyncParams):
        super().__init__(runtime, params)
        if params.overlap and params.release_memory_during_update:
            runtime.executor.before_role.setdefault("updates_policy", []).append(self._release_before_update)

    def _release_before_update(self, node, step) -> None:
        self.runtime.workers.call("rollout", "release_for_training")

    def run(self) -> None:
        rt = self.runtime
        groups = rt.config.data.prompts_per_step
        bound = 2 if self.params.overlap else 1
        total = rt.config.trainer.total_steps
        try:
            self.start_evaluations()
            in_buffer = sum(self.sampler("counts").values())  # > 0 after a resume: re-issued prompts
            self.submit(rt.start_step, max(0, groups - in_buffer))
            for step in range(rt.start_step, total):
                waited = time.time()
                arrived = time.monotonic()
                while (batch := self.sampler("sample", groups, step)) is None:
                    if self.collect(step, self.params.poll_s):
                        arrived = time.monotonic()
                    elif time.monotonic() - arrived > self.params.stall_timeout_s:
                        raise RolloutStalled(
                            f"colocate_async: no finished group came from the rollout engine for "
                            f"{time.monotonic() - arrived:.0f} s while step {step} waits for {groups} groups "
                            f"(buffer: {self.sampler('counts')}); an engine or environment that never answers is "
                            "hung: see the rollout worker's log. If generation is only this slow, raise "
                            "mode_params.stall_timeout_s")
                last = step + 1 == total
                if self.params.overlap and not last:
                    self.submit(step, groups)  # generated now, on version `step`, during this step's tail
                self.train(step, group_order(batch), time.time() - waited, bound)
                if not self.params.overlap and not last:
                    self.submit(step + 1, groups)  # strict alternation: after this step's push
        finally:
            self.stop_pool()
