"""``sync`` mode: generation and training strictly alternate (staleness 0).

Per global step: draw prompts, run the whole step DAG, end the step. The
rollout engine sleeps (releases its memory) from the end of generation until
the weight push wakes it, as verl's hybrid engine does on shared devices.
Every local update of the step uses the same π_old: the old_log_prob node
runs once, before any update.
"""

from __future__ import annotations

from rlpipe.errors import ConfigError
from rlpipe.modes.base import Mode
from rlpipe.registry import registry


@registry("mode").register("sync")
class SyncMode(Mode):
    """Strict alternation of rollout and training."""

    @classmethod
    def check(cls, config, plan) -> None:
        check_batch_arithmetic(config)

    def run(self) -> None:
        rt = self.runtime
        rt.executor.after_node.append(self._sleep_after_generate)
        for step in range(rt.start_step, rt.config.trainer.total_steps):
            prompts = rt.loader.next_batch(step)
            table, metrics = rt.executor.run(step, prompts)
            rt.end_step(step, table, metrics)

    def _sleep_after_generate(self, node, step) -> None:
        if node.kind == "generate":
            self.runtime.workers.call("rollout", "sleep")


def check_batch_arithmetic(config) -> None:
    """Mini-batches must tile the global batch, rows must tile the DP ranks."""
    trainer, data = config.trainer, config.data
    mini = trainer.ppo_mini_batch_size or data.prompts_per_step
    if data.prompts_per_step % mini:
        raise ConfigError(
            f"data.prompts_per_step={data.prompts_per_step} is not a multiple of "
            f"trainer.ppo_mini_batch_size={mini}; make it one (one local update per mini-batch)"
        )
    updates = data.prompts_per_step // mini
    if trainer.parameter_sync_step not in (1, updates):
        raise ConfigError(
            f"trainer.parameter_sync_step={trainer.parameter_sync_step} must equal "
            f"data.prompts_per_step / trainer.ppo_mini_batch_size = {updates} (local updates per weight push); "
            "set ppo_mini_batch_size = prompts_per_step / parameter_sync_step"
        )
