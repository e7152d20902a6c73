"""``sync`` mode: generation and training strictly alternate (staleness 0).

Per global step: draw prompts, run the whole step DAG, end the step. The
rollout engine sleeps (releases its memory) from the end of generation until
the weight push wakes it, as verl's hybrid engine does on shared devices.
Every local update of the step uses the same π_old: the old_log_prob node
runs once, before any update.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from rlpipe.errors import ConfigError, RlpipeError
from rlpipe.modes.base import Mode
from rlpipe.registry import registry
from rlpipe.schemas.batch import UID
from rlpipe.stage import StageParams
from rlpipe.stages.algos.batch_io import groups_by_appearance


class SyncParams(StageParams):
    """Params of the sync mode."""

    max_refill_rounds: int = Field(8, ge=0)
    """With a filter_groups stage: extra generation rounds per step to replace evicted groups
    (verl's max_num_gen_batches); the step fails with advice when they are not enough."""


@registry("mode").register("sync")
class SyncMode(Mode):
    """Strict alternation of rollout and training."""

    Params = SyncParams

    @classmethod
    def check(cls, config, plan) -> None:
        check_batch_arithmetic(config)

    def run(self) -> None:
        rt = self.runtime
        rt.executor.after_node.append(self._sleep_after_generate)
        nodes = rt.plan.nodes
        kinds = [n.kind for n in nodes]
        cut = kinds.index("filter_groups") + 1 if "filter_groups" in kinds else 0
        for step in range(rt.start_step, rt.config.trainer.total_steps):
            metrics: dict[str, float] = {}
            table = rt.loader.next_batch(step)
            if cut:
                table, metrics = self._collect_informative_groups(step, table, nodes[:cut])
            table, rest = rt.executor.run(step, table, nodes[cut:])
            rt.end_step(step, table, {**metrics, **rest})

    def _collect_informative_groups(self, step: int, prompts: pa.Table, head) -> tuple[pa.Table, dict[str, float]]:
        """DAPO dynamic sampling: run generate..filter_groups, refilling 2× the evicted groups until
        the step has ``prompts_per_step`` informative groups; extra groups are trimmed."""
        rt = self.runtime
        wanted = rt.config.data.prompts_per_step
        table, metrics = rt.executor.run(step, prompts, head)
        parts, rounds, evicted = [table], 0, metrics.get("filter_groups/evicted_groups", 0.0)
        kept = _num_groups(table)  # refill rounds draw fresh uids, so the counts add up
        while kept < wanted:
            if rounds == self.params.max_refill_rounds:
                raise RlpipeError(
                    f"step {step}: filter_groups kept {kept} of {wanted} groups "
                    f"after {rounds} refill rounds; raise mode_params.max_refill_rounds, raise generate.n "
                    "(more samples per prompt → more reward variance), or drop the filter_groups stage"
                )
            rounds += 1
            refill = max(1, int(metrics.get("filter_groups/refill_groups", 0)))
            more = rt.loader.next_batch(step, refill, uid_prefix=f"refill{rounds}:")
            rt.workers.call("rollout", "wake")  # it went to sleep after the previous generate
            table, metrics = rt.executor.run(step, more, head)
            evicted += metrics.get("filter_groups/evicted_groups", 0.0)
            kept += _num_groups(table)
            parts.append(table)
        merged = _first_groups(pa.concat_tables(parts), wanted)
        return merged, {"filter_groups/refill_rounds": float(rounds), "filter_groups/evicted_groups_step": evicted}

    def _sleep_after_generate(self, node, step) -> None:
        if node.kind == "generate":
            self.runtime.workers.call("rollout", "sleep")


def _num_groups(table: pa.Table) -> int:
    return len(pc.unique(table.column(UID)))


def _first_groups(table: pa.Table, count: int) -> pa.Table:
    """The rows of the first ``count`` groups (in order of first appearance)."""
    _, rank = groups_by_appearance(table)
    return table.filter(pa.array(rank < count))


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
