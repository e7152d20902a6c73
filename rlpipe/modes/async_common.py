"""What both async modes share: the plan split, the replay-buffer role, the rollout pool driver.

The step DAG is cut in two. The *generation side* — ``generate`` and the nodes
up to the staleness guard (reward) — runs continuously: prompts go to the
rollout replicas' background services (see rlpipe.engine.state.rollout_service),
finished groups are scored and land in the replay buffer (a Ray actor, role
``sampler``). The *training side* — from the ``staleness_guard`` on — runs once
per global step on a batch the buffer serves. The guard proves the bound the
buffer enforces.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, ValidationError

from rlpipe.engine.evaluation import BackgroundEval
from rlpipe.engine.execution.executor import StepRun
from rlpipe.engine.rollout_calls import collect_scored, submit_to_replicas
from rlpipe.engine.state.roles import WORKER_ROLES, RoleSpec
from rlpipe.engine.state.sampler import SharedSampler
from rlpipe.errors import ConfigError, PlanError, RlpipeError
from rlpipe.modes.base import Mode
from rlpipe.modes.feasibility import progress_blockers, refusing
from rlpipe.modes.sync import check_batch_arithmetic
from rlpipe.registry import registry
from rlpipe.schemas.batch import SAMPLE_INDEX, UID
from rlpipe.stage import StageParams
from rlpipe.stage_kinds import step_role_of
from rlpipe.stages.algos.batch_io import groups_by_appearance

log = logging.getLogger(__name__)

ALL_PENDING = 1 << 30
"""next_pending() argument meaning "every pending prompt"."""


class AsyncParams(StageParams):
    """Params shared by the async modes."""

    sampler: str = "replay_buffer"
    """Registered sampler (kind `sampler`) holding prompts and finished groups."""
    max_off_policy_threshold: int = Field(8, ge=1)
    """Largest staleness a consumed group may have: consuming step − submission step + 1."""
    strategy: Literal["drop", "wait"] = "drop"
    """drop: evict stale finished groups and refill; wait: block sampling instead (nothing dropped)."""
    capacity_steps: int = Field(2, ge=1)
    """Prompts kept in flight = capacity_steps × prompts_per_step (more overlap, more staleness)."""
    sampler_params: dict = Field(default_factory=dict)
    """Extra params of a custom sampler."""
    poll_s: float = Field(0.02, gt=0)
    """How long one collection round waits for finished groups."""


def split_plan(plan) -> tuple[list, list]:
    """(generation-side nodes after generate, training-side nodes from the staleness guard on)."""
    guard = plan.anchor("guards_staleness")
    if guard is None:
        raise PlanError(
            f"mode {plan.mode_name!r} needs a staleness_guard stage between generation and training; "
            "add `- {kind: staleness_guard, impl: max_staleness}` to stages"
        )
    cut = plan.nodes.index(guard)
    head = [n for n in plan.nodes[:cut] if n.step_role not in ("generates", "selects_groups")]
    return head, plan.nodes[cut:]


class RolloutStalled(RlpipeError):
    """The rollout side made no progress for ``mode_params.stall_timeout_s`` while the trainer waited."""


def check_async(config, plan) -> None:
    """Constraints common to the async modes, with what to change."""
    check_batch_arithmetic(config)
    split_plan(plan)
    check_progress(config, plan)
    for node in plan.nodes:
        if node.step_role == "scores" and node.spec.placement == "worker" and node.spec.role in ("actor", "rollout"):
            raise ConfigError(
                f"{plan.mode_name}: the reward model of stage {node.name!r} runs on the {node.spec.role!r} workers; "
                "an async mode needs it in its own pool (a task or a separate role) so grading stays off the "
                "rollout's and trainer's critical paths"
            )


def sampler_settings(config, mode_params=None):
    """The registered sampler class of the mode's params and the params the ``sampler`` role builds it with."""
    params = mode_params or registry("mode").get(config.mode).Params.model_validate(config.mode_params)
    generate = next(s for s in config.stages if step_role_of(s.kind) == "generates")
    cls = registry("sampler").get(params.sampler)
    filter_groups = any(step_role_of(s.kind) == "selects_groups" for s in config.stages)
    return cls, cls.Params.model_validate({
        "max_off_policy_threshold": params.max_off_policy_threshold, "strategy": params.strategy,
        "capacity_steps": params.capacity_steps, "filter_groups": filter_groups,
        "group_size": generate.params.get("n", 8), "groups_per_step": config.data.prompts_per_step,
        **params.sampler_params,
    })


def build_sampler(config, rank: int, world_size: int, dist_address: str | None):
    """The ``sampler`` role: the registered sampler built from the mode's params."""
    cls, params = sampler_settings(config)
    return SharedSampler(cls(params))


def check_progress(config, plan) -> None:
    """Refuse what cannot make progress, decided from the config alone (rlpipe.modes.feasibility)."""
    try:
        _, params = sampler_settings(config, plan.mode_params)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ConfigError(f"mode_params.sampler_params: {'.'.join(map(str, err['loc']))}: "
                          f"{err['msg'].removeprefix('Value error, ')}") from None
    blockers = progress_blockers(config, plan, params)
    if blockers and refusing():
        raise ConfigError("this run could not make progress: " + "; ".join(blockers))


# threads: the driver's sample_wait blocks while the rollout replicas' feeders store groups
WORKER_ROLES.add("sampler", RoleSpec(build_sampler, sharded=False, size=lambda c: 1, max_concurrency=64))


WAIT_METRIC = "async/guard_wait_s"
"""The step metric of the driver's wait for the step's batch (``rlpipe simulate`` takes it out of the step gaps)."""

DECODE_SUMS = {key: f"rollout/{key}" for key in ("decode_steps", "decode_tokens", "decode_s", "decode_tokens_sq",
                                                 "decode_token_s", "decode_cpu_s")}
"""An in-process engine's service stat → the step metric of its sum over the replicas during the step: decode
iterations, the requests they decoded (tokens), their seconds, the sums of requests² and requests × seconds — what
a least-squares fit of an iteration's seconds on its requests needs — and the decode loop's CPU seconds (with the
seconds, the share of a core it got). ``rlpipe simulate`` calibrates its replicas on them."""


def group_order(table: pa.Table) -> pa.Table:
    """Rows grouped in order of first appearance, each group by sample index (the generate stage's order)."""
    _, rank = groups_by_appearance(table)
    order = np.lexsort((table.column(SAMPLE_INDEX).to_numpy(), rank))
    return table.take(pa.array(order))


class AsyncMode(Mode):
    """Driver of the rollout pool and the replay buffer; subclasses schedule the steps."""

    generates_while_training = True
    evaluates = True

    Params = AsyncParams

    @classmethod
    def roles(cls, config) -> set[str]:
        return {"sampler"}

    def __init__(self, runtime, params: AsyncParams):
        super().__init__(runtime, params)
        self.head, self.train_nodes = split_plan(runtime.plan)
        self.generate_node = runtime.plan.node("generate")
        self.gen_params = self.generate_node.params.model_dump()
        self.replicas = runtime.backend.group_size("rollout")
        self.draws_at_step: dict[int, int] = {}
        self.last_stats: list[dict] | None = None
        self.train_extras: dict = {}
        """Extra ``ctx.extras`` of the training-side nodes (e.g. ``defer_weight_push``)."""
        self.evaluation = BackgroundEval(runtime) if runtime.plan.eval is not None else None
        """Evaluation during training (``eval:``), on the rollout replicas beside training."""

    def settle_pushes(self) -> None:
        """Wait until the replicas hold the last weight push (a deferred one is settled)."""
        self.runtime.workers.settle()

    def start_evaluations(self) -> None:
        """At the start of a run: the evaluation before training, when ``eval.before_training`` asks for it."""
        rt = self.runtime
        if self.evaluation is not None and rt.start_step == 0 and rt.config.eval.before_training:
            self.evaluation.start(0, prefix="eval_start")

    def sampler(self, method: str, *args):
        return self.runtime.workers.call("sampler", method, *args)[0]

    # --- rollout side ------------------------------------------------------------------------
    def add_prompts(self, step: int, count: int) -> None:
        """Draw ``count`` prompts at ``step`` (their submission step) into the buffer as pending."""
        if count > 0:
            draw = self.draws_at_step.get(step, 0)
            self.draws_at_step[step] = draw + 1
            # the first draw of a step gets the sync mode's uids, so a zero-overlap run equals sync
            prompts = self.runtime.loader.next_batch(step, count, uid_prefix="" if draw == 0 else f"d{draw}:")
            self.sampler("add_prompts", prompts, step)

    def submit(self, step: int, count: int) -> int:
        """Draw ``count`` prompts at ``step`` into the buffer, then dispatch every pending prompt
        (the new ones, and prompts re-issued by a resume) to the replicas; returns how many."""
        self.add_prompts(step, count)
        pending = self.sampler("next_pending", ALL_PENDING)
        uids = pending.column(UID)
        for replica, rows in enumerate(submit_to_replicas(self.runtime, step, pending, self.gen_params)):
            self.runtime.executor.note_replicas(uids.take(pa.array(rows)).to_pylist(), replica)
        return pending.num_rows

    def collect(self, step: int, timeout: float, min_groups: int = 1) -> int:
        """Finished groups from every replica → generation-side nodes (reward) → the buffer.

        Waits up to ``timeout`` for ``min_groups`` per replica, so rewards are computed on
        batches rather than group by group (each round costs a task and a few actor calls)."""
        scored = collect_scored(self.runtime, step, self.generate_node, self.head, min_groups, timeout)
        return self.sampler("add_trajectories", scored) if scored is not None else 0

    def rollout_report(self, step: int) -> Callable[[], dict[str, float]]:
        """Ask the rollout pool for the step's metrics now; the returned call reads them (after training)."""
        futures = self.runtime.workers.call_async("rollout", "service_stats")
        return lambda: self.rollout_stats(self.runtime.workers.resolve(futures))

    def rollout_stats(self, stats: list[dict[str, float]]) -> dict[str, float]:
        """Busy/idle fractions of the rollout pool since the previous call, from each replica's service stats."""
        previous, self.last_stats = self.last_stats, stats
        if previous is None:
            return {}
        busy = sum(s["busy_s"] - p["busy_s"] for s, p in zip(stats, previous))
        idle = sum(s["idle_s"] - p["idle_s"] for s, p in zip(stats, previous))
        out = {"async/rollout_idle_fraction": idle / max(busy + idle, 1e-9)}
        if all(key in s for s in (*stats, *previous) for key in DECODE_SUMS):  # in-process engines' iterations
            out.update({name: float(sum(max(0.0, s[key] - p[key]) for s, p in zip(stats, previous)))  # a restarted
                        for key, name in DECODE_SUMS.items()})  # service counts from 0
        return out

    # --- training side -----------------------------------------------------------------------
    def start_training(self, step: int, batch: pa.Table, max_staleness: int) -> StepRun:
        """Begin the trainer's nodes on ``batch`` (in :func:`group_order`): their first call is submitted now."""
        return self.runtime.executor.start(step, batch, self.train_nodes, extras={
            "max_staleness": max_staleness,
            "max_version_lag": max_staleness - 1,  # a prompt submitted at step s is generated by versions ≥ s
            **self.train_extras})

    def finish_training(self, step: int, run: StepRun, wait_s: float,
                        lent_s: float = 0.0) -> tuple[pa.Table, dict[str, float]]:
        """Wait for the trainer's nodes to end (the push included) and gather the step's metrics; the step's
        records are written by ``end_step``, so a mode can start the next step's training in between.
        ``lent_s``: seconds of ``wait_s`` the trainer spent generating (separate_async's borrow), not idle."""
        rt = self.runtime
        # bookkeeping calls go out before the wait and are read after it: off the trainer's path
        sampler_metrics = rt.workers.call_async("sampler", "metrics", step)
        rollout_metrics = self.rollout_report(step)
        start = time.time()
        table, metrics = rt.executor.finish(run, write_records=False)
        train_s = time.time() - start
        metrics.update(rt.workers.resolve(sampler_metrics)[0])
        metrics.update(rollout_metrics())
        metrics[WAIT_METRIC] = wait_s
        metrics["async/trainer_idle_fraction"] = max(wait_s - lent_s, 0.0) / max(wait_s + train_s, 1e-9)
        if self.evaluation is not None:  # the push is done: an evaluation starts on these weights when due
            if self.evaluation.evaluator.due_after(step):
                self.settle_pushes()  # the replicas hold them before the eval prompts reach the engines
            self.evaluation.after_step(step)
        return table, metrics

    def train(self, step: int, batch: pa.Table, wait_s: float, max_staleness: int) -> None:
        """Train on ``batch`` (in :func:`group_order`) and end the step."""
        run = self.start_training(step, batch, max_staleness)
        self.runtime.end_step(step, *self.finish_training(step, run, wait_s))

    def stop_pool(self, after_failure: bool = False) -> None:
        """Settle a deferred push and clear the replicas' services; ``after_failure``: the run already failed,
        so whatever fails here is a consequence (logged in one line), not news."""
        try:
            self.runtime.workers.settle()  # a deferred weight push still loading
        except Exception as exc:  # noqa: BLE001 - the run is ending; a failure here must not hide the first one
            if after_failure:
                log.info("a deferred weight push failed while the run ended: %s", exc)
            else:
                log.exception("a deferred weight push failed while the run ended")
        self.runtime.workers.call("rollout", "service_clear")
