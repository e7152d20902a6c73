"""``separate_async`` mode: a standalone rollout pool feeds a replay buffer; the trainer consumes.

The rollout replicas generate continuously (their background services) from
prompts the buffer admits; finished groups are scored and stored. Each global
step the trainer takes ``prompts_per_step`` groups through the staleness guard
and runs ``prompts_per_step / ppo_mini_batch_size = parameter_sync_step`` local
updates, all with the same π_old (old_log_prob runs once, before the first),
then pushes weights: the pool pauses, in-flight requests are aborted, the new
version is loaded and the aborted requests resume on it (partial rollout). The
buffer bounds staleness (drop or wait); the guard proves it. Left out: the
hybrid "borrow" of the trainer as a rollout engine when the pool starves.
"""

from __future__ import annotations

import time

from rlpipe.errors import ConfigError
from rlpipe.modes.async_common import AsyncMode, check_async
from rlpipe.registry import registry


@registry("mode").register("separate_async")
class SeparateAsyncMode(AsyncMode):
    """Continuous generation into a replay buffer, bounded by the staleness guard."""

    @classmethod
    def check(cls, config, plan) -> None:
        check_async(config, plan)
        trainer, data = config.trainer, config.data
        mini = trainer.ppo_mini_batch_size or data.prompts_per_step
        if data.prompts_per_step != trainer.parameter_sync_step * mini:
            raise ConfigError(
                f"separate_async needs data.prompts_per_step (train batch) == trainer.parameter_sync_step × "
                f"trainer.ppo_mini_batch_size, got {data.prompts_per_step} != {trainer.parameter_sync_step} × {mini}; "
                f"set trainer.ppo_mini_batch_size={data.prompts_per_step // trainer.parameter_sync_step}"
                if data.prompts_per_step % trainer.parameter_sync_step == 0 else
                f"separate_async needs data.prompts_per_step == trainer.parameter_sync_step × "
                f"trainer.ppo_mini_batch_size; {data.prompts_per_step} is not a multiple of "
                f"parameter_sync_step={trainer.parameter_sync_step}"
            )

    def run(self) -> None:
        rt = self.runtime
        groups = rt.config.data.prompts_per_step
        bound = self.params.max_off_policy_threshold
        try:
            for step in range(rt.start_step, rt.config.trainer.total_steps):
                waited = time.time()
                while True:
                    self.submit(step, self.sampler("refill_needed", step))
                    batch = self.sampler("sample", groups, step)
                    if batch is not None:
                        break
                    # wait only for the groups still missing (not a whole batch) before scoring
                    missing = groups - self.sampler("counts").get("finished", 0)
                    self.collect(step, self.params.poll_s, max(1, -(-missing // self.replicas)))
                # replace the consumed groups before training, so the pool has work while the driver is busy
                self.submit(step, self.sampler("refill_needed", step))
                self.train(step, batch, time.time() - waited, bound)
        finally:
            self.stop_pool()
