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

In the async modes (:class:`BackgroundEval`) the evaluation does not stop training: once a step's push is
done and loaded (the mode settles a deferred one first) its prompts go to the rollout replicas' services on
a lane of their own (``eval``: never the replay buffer, never a training batch), generated beside the
training prompts (a later push aborts and resumes them like any request), and are scored here as they come
back (rlpipe.engine.rollout_calls, as the training prompts are).
Once its last group is back its metrics are logged at the step whose push it evaluates, as in sync mode
(``Observer.on_metrics``: later than that step's own metrics), with ``<prefix>/policy_version`` the oldest
weight version in its tokens and ``<prefix>/policy_version_max`` the newest.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlpipe.engine.rollout_calls import collect_scored, submit_to_replicas
from rlpipe.engine.state.data import PromptLoader
from rlpipe.errors import RlpipeError
from rlpipe.jagged import lengths
from rlpipe.schemas.batch import REWARD, STATUS, STATUS_FAILED, TOKEN_VERSIONS, UID

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

    def prompt_batches(self, step: int, prefix: str) -> list[pa.Table]:
        """The validation prompts of an evaluation after ``step``, in ``data.prompts_per_step`` batches; uids
        ``<prefix><step>.<first row>:...`` (never a training uid)."""
        data = self.spec.data.model_copy(update={"shuffle": False})
        loader = PromptLoader(data, self.runtime.tokenizer, self.runtime.config.seed + EVAL_SEED_OFFSET)
        total = loader.size if self.spec.max_prompts is None else min(self.spec.max_prompts, loader.size)
        return [loader.next_batch(step, min(data.prompts_per_step, total - start), uid_prefix=f"{prefix}{step}.{start}:")
                for start in range(0, total, data.prompts_per_step)]

    @property
    def extras(self) -> dict:
        """What the eval nodes' contexts carry: the eval temperature, no sleep after generating, ``eval``."""
        return {"temperature": self.plan.temperature, "sleep_after_generate": False, "eval": True}

    def metrics(self, table: pa.Table, prefix: str) -> dict[str, float]:
        """:func:`eval_metrics` of the evaluated rows, with this evaluation's k and pass threshold."""
        return eval_metrics(table, self.plan.samples_per_prompt, self.spec.pass_threshold, prefix)

    def run(self, step: int, prefix: str = "eval") -> dict[str, float]:
        """Evaluate the rollout's current weights on the validation prompts; metrics named ``<prefix>/...``."""
        rt = self.runtime
        parts = []
        for prompts in self.prompt_batches(step, prefix):
            table, _ = rt.executor.run(step, prompts, self.plan.nodes, extras=self.extras)
            parts.append(table)
            for uid in prompts.column(UID).to_pylist():  # never consumed by a step: forget where they went
                rt.executor.replica_of.pop(uid, None)
        metrics = self.metrics(pa.concat_tables(parts, promote_options="default"), prefix)
        metrics[f"{prefix}/policy_version"] = float(rt.executor.policy_version)
        return metrics


EVAL_LANE = "eval"
"""The rollout services' lane of an async run's evaluation (rlpipe.engine.state.rollout_service)."""
END_WAIT_S = 600.0
"""How long the end of an async run waits for an evaluation still in flight before failing, naming it."""
POLL_S = 0.5
"""How long each wait for an evaluation's groups lasts at the end of a run (between checks of the bound)."""


class BackgroundEval:
    """The evaluations of an async run, on the rollout replicas beside training (module docstring)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.evaluator = Evaluator(runtime)
        nodes = self.evaluator.plan.nodes
        self.generate = next(n for n in nodes if n.step_role == "generates")
        self.scorers = [n for n in nodes if n is not self.generate]
        self.in_flight: dict | None = None
        """The evaluation whose groups are out: its prefix, uids still out, scored parts."""
        self.skipped = 0
        """Evaluations not started because the one before was still in flight."""

    def start(self, step: int, prefix: str = "eval") -> None:
        """Send the validation prompts of the evaluation after ``step`` to the replicas (split evenly)."""
        if self.in_flight is not None:  # one at a time: a slower evaluation than its period skips the next
            self.skipped += 1
            return
        uids = set()
        params = self.generate.params.model_dump()  # the eval copy's: eval.params.generate merged in
        for prompts in self.evaluator.prompt_batches(step, prefix):
            uids.update(prompts.column(UID).to_pylist())
            submit_to_replicas(self.runtime, step, prompts, params, EVAL_LANE)
        self.in_flight = {"prefix": prefix, "step": step, "out": uids, "parts": []}

    def poll(self, step: int, wait_s: float = 0.0) -> None:
        """Score the evaluation's groups that came back (waiting up to ``wait_s`` for one); once the last is
        back, log its metrics at the step it evaluates."""
        if self.in_flight is None:
            return
        flight = self.in_flight
        scored = collect_scored(self.runtime, step, self.generate, self.scorers, 1 if wait_s else 0, wait_s,
                                EVAL_LANE, self.evaluator.extras)
        if scored is not None:
            flight["parts"].append(scored)
            flight["out"].difference_update(scored.column(UID).to_pylist())
        if flight["out"]:
            return
        self.in_flight, prefix = None, flight["prefix"]
        done = pa.concat_tables(flight["parts"], promote_options="default")
        metrics = self.evaluator.metrics(done, prefix)
        versions = pc.list_flatten(done.column(TOKEN_VERSIONS))
        metrics[f"{prefix}/policy_version"] = float(pc.min(versions).as_py())
        metrics[f"{prefix}/policy_version_max"] = float(pc.max(versions).as_py())
        metrics[f"{prefix}/skipped"] = float(self.skipped)
        self.runtime.observer.on_metrics(flight["step"], metrics)

    def after_step(self, step: int) -> None:
        """At the end of ``step``, its push done: the groups that came back scored, the next evaluation started
        when due; after the last step, every evaluation waited for (within :data:`END_WAIT_S`), the one before
        the final first, so that the final weights are never skipped."""
        self.poll(step)
        last = step + 1 == self.runtime.config.trainer.total_steps
        due = self.evaluator.due_after(step)
        if last and due:
            self._wait(step)
        if due:
            self.start(step)
        if last:
            self._wait(step)

    def _wait(self, step: int) -> None:
        deadline = time.monotonic() + END_WAIT_S
        while self.in_flight is not None:
            if time.monotonic() > deadline:
                raise RlpipeError(f"eval: {len(self.in_flight['out'])} validation prompt(s) of the evaluation after "
                                  f"step {self.in_flight['step']} did not come back from the rollout replicas within "
                                  f"{END_WAIT_S:.0f} s of the last step; lower eval.max_prompts or look for a hung "
                                  "replica in its log")
            self.poll(step, POLL_S)


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
