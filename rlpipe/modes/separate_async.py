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
from concurrent.futures import ThreadPoolExecutor

from rlpipe.engine.rollout_feeder import HeadStage
from rlpipe.errors import ConfigError
from rlpipe.modes.async_common import AsyncMode, check_async
from rlpipe.registry import registry

HEALTH_CHECK_S = 1.0
"""How long the driver waits for a batch before checking that the replicas' feeders are alive."""


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
        try:
            if self.replicas_score:
                self._run_fed()
            else:
                self._run_driver_collected()
        finally:
            self.stop_pool()

    @property
    def replicas_score(self) -> bool:
        """Whether the rollout replicas can run the generation-side stages themselves (all stateless)."""
        return all(node.spec.placement == "task" for node in self.head)

    def _run_fed(self) -> None:
        """The replicas pull prompts and store scored groups (rlpipe.engine.rollout_feeder); the
        driver waits for a batch and trains while a helper thread tops the buffer up with prompts."""
        rt = self.runtime
        groups = rt.config.data.prompts_per_step
        self._start_feeders()
        with ThreadPoolExecutor(1, thread_name_prefix="rlpipe-refill") as refills:  # one: draws stay in order
            for step in range(rt.start_step, rt.config.trainer.total_steps):
                waited = time.time()
                # a new submission step: room under wait, and replacements for groups evicted meanwhile
                self._refill = refills.submit(self._top_up, step)
                while (batch := self.sampler("sample_wait", groups, step, HEALTH_CHECK_S)) is None:
                    self._drain(step)  # raises a replica's failure instead of waiting for it forever
                self._refill.result()
                # replace the consumed groups while the trainer trains (joined before the step ends)
                self._refill = refills.submit(self._top_up, step)
                self.train(step, batch, time.time() - waited, self.params.max_off_policy_threshold)

    def _top_up(self, step: int) -> None:
        self.add_prompts(step, self.sampler("refill_needed", step))

    def _start_feeders(self) -> None:
        rt = self.runtime
        head = [HeadStage(n.name, n.kind, n.impl, n.params_dict, dict(n.writes)) for n in self.head]
        groups = rt.config.data.prompts_per_step
        capacity = self.params.capacity_steps * groups
        # a replica stores a quarter of its share of a step at a time (or what it has after poll_s):
        # few round trips, and the trainer still sees groups soon after they finish
        store = max(1, groups // (4 * self.replicas))
        rt.workers.call("rollout", "feed_start", rt.workers.handle("sampler"), head, self.gen_params,
                        -(-capacity // self.replicas), store, self.params.poll_s, rt.config.seed)

    def _drain(self, step: int, futures: list | None = None) -> list[dict[str, float]]:
        """Hand the replicas' lineage records to the observer (as work of ``step``); their service stats.

        ``futures``: the replicas' ``feed_drain`` already asked for (default: ask now)."""
        workers = self.runtime.workers
        try:
            reports = workers.resolve(futures if futures is not None else workers.call_async("rollout", "feed_drain"))
        except Exception as exc:  # noqa: BLE001 - Ray wraps the replica's exception; its cause is ours
            cause = getattr(exc, "cause", None)
            raise (cause if isinstance(cause, BaseException) else exc) from None
        nodes = {node.name: node for node in [self.generate_node, *self.head]}
        for report in reports:
            for record in report["records"]:
                self.runtime.executor.record_external(step, nodes[record.pop("node")], **record)
        return [report["stats"] for report in reports]

    def rollout_report(self, step: int):
        if not self.replicas_score:
            return super().rollout_report(step)
        futures = self.runtime.workers.call_async("rollout", "feed_drain")

        def read() -> dict[str, float]:
            self._refill.result()  # the step's prompt draws are done before it ends (and is checkpointed)
            return self.rollout_stats(self._drain(step, futures))

        return read

    def _run_driver_collected(self) -> None:
        """Generation-side stages on workers: the driver submits, collects and scores between steps."""
        rt = self.runtime
        groups = rt.config.data.prompts_per_step
        bound = self.params.max_off_policy_threshold
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
            self.submit(step, self.sampler("refill_needed", step))
            self.train(step, batch, time.time() - waited, bound)
