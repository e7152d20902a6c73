"""Evaluation during training (``eval:``): the eval DAG on the validation prompts, between steps.

The mode asks :meth:`Evaluator.due_after` after each step and calls :meth:`Evaluator.run` once the step's
weight push is done: the planned eval nodes (rlpipe.engine.planning.eval_plan) run through the run's own
executor on every batch of validation prompts, where their training nodes run, with their own lineage
records (``eval.<node>``); nothing they produce reaches the trainer. The result is metrics only:

* ``eval/reward/mean`` over the valid rows, ``eval/response_length/mean``, ``eval/failed_rows``,
  ``eval/prompts``, ``eval/policy_version`` (the weights evaluated);
* per data source ``eval/<source>/mean@k`` (the mean over prompts of their k samples' mean reward) and
  ``eval/<source>/pass@k`` (the share of prompts with a sample whose reward reaches ``eval.pass_threshold``),
  k being the eval generate node's ``n``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlpipe.engine.state.data import PromptLoader
from rlpipe.schemas.batch import REWARD, STATUS, STATUS_FAILED, UID
from rlpipe.jagged import lengths

EVAL_SEED_OFFSET = 1
"""The eval prompts' seed is the run seed plus this: a generated source draws other prompts than training."""


class Evaluator:
    """Runs the eval DAG of a run (``runtime.plan.eval``)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.spec = runtime.config.eval
        self.plan = runtime.plan.eval

    def due_after(self, step: int) -> bool:
        """Whether an evaluation follows ``step`` (every ``eval.every`` steps, and after the last one)."""
        every, last = self.spec.every, step + 1 == self.runtime.config.trainer.total_steps
        return bool(every and (step + 1) % every == 0) or (self.spec.at_end and last)

    def run(self, step: int, prefix: str = "eval") -> dict[str, float]:
        """Evaluate the rollout's current weights on the validation prompts; metrics named ``<prefix>/...``."""
        rt = self.runtime
        data = self.spec.data.model_copy(update={"shuffle": False})
        loader = PromptLoader(data, rt.tokenizer, rt.config.seed + EVAL_SEED_OFFSET)
        total = loader.size if self.spec.max_prompts is None else min(self.spec.max_prompts, loader.size)
        extras = {"temperature": self.plan.temperature, "sleep_after_generate": False, "eval": True}
        parts = []
        for start in range(0, total, data.prompts_per_step):
            prompts = loader.next_batch(step, min(data.prompts_per_step, total - start),
                                        uid_prefix=f"{prefix}{step}.{start}:")
            table, _ = rt.executor.run(step, prompts, self.plan.nodes, extras=extras)
            parts.append(table)
            for uid in prompts.column(UID).to_pylist():  # never consumed by a step: forget where they went
                rt.executor.replica_of.pop(uid, None)
        metrics = eval_metrics(pa.concat_tables(parts, promote_options="default"), self.plan.samples_per_prompt,
                               self.spec.pass_threshold, prefix)
        metrics[f"{prefix}/policy_version"] = float(rt.executor.policy_version)
        return metrics


def eval_metrics(table: pa.Table, k: int, pass_threshold: float, prefix: str = "eval") -> dict[str, float]:
    """The eval metrics of the evaluated rows ``table`` (module docstring); failed rows count in no mean."""
    failed = np.zeros(table.num_rows, dtype=bool)
    if STATUS in table.column_names:
        failed = np.asarray(table.column(STATUS).to_pylist(), dtype=object) == STATUS_FAILED
    out = {f"{prefix}/prompts": float(len(pc.unique(table.column(UID)))), f"{prefix}/failed_rows": float(failed.sum())}
    if failed.all():
        return out
    valid = table.filter(pa.array(~failed))
    rewards = valid.column(REWARD).to_numpy().astype(np.float64)
    out[f"{prefix}/reward/mean"] = float(rewards.mean())
    out[f"{prefix}/response_length/mean"] = float(lengths(valid.column("response_ids")).mean())
    uids = np.asarray(valid.column(UID).to_pylist(), dtype=object)
    sources = np.asarray(valid.column("data_source").to_pylist(), dtype=object)
    for source in sorted(set(sources.tolist())):
        mine = sources == source
        per_prompt = [rewards[mine & (uids == uid)] for uid in dict.fromkeys(uids[mine].tolist())]
        out[f"{prefix}/{source}/mean@{k}"] = float(np.mean([r.mean() for r in per_prompt]))
        out[f"{prefix}/{source}/pass@{k}"] = float(np.mean([bool((r >= pass_threshold).any()) for r in per_prompt]))
    return out
