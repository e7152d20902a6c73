"""What ``rlpipe simulate`` simulates: the recorded config changed by ``-o`` overrides, checked as ``rlpipe run``
would check it, and the few numbers and nodes the event model needs from it.

The overrides are the ``rlpipe run`` ones (``-o mode=separate_async``,
``-o mode_params.max_off_policy_threshold=2``, ``-o resources.rollout_replicas=2``,
``-o data.prompts_per_step=32``, ``-o stages.generate.params.max_tokens=64``), applied to the run's
resolved config and validated by the same config classes and plan check: what is simulated is
a config ``rlpipe run`` takes as is (``--write-config`` saves it). One convenience: an async mode
needs a ``staleness_guard`` stage, which an override cannot add to the stage list; when the mode
becomes async and the pipeline has none, one is added after the last scoring node (where the
shipped async pipelines have it) and the change is reported.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import Field

from rlpipe.engine.planning.config_io import apply_override, validate_config
from rlpipe.schemas.config import PipelineConfig, Strict
from rlpipe.stage_kinds import step_role_of

GUARD_STAGE = {"kind": "staleness_guard", "impl": "max_staleness"}


class SimNode(Strict):
    """One node of the step DAG as the event model runs it."""

    name: str
    """Node name."""
    kind: str
    """Stage kind."""
    step_role: str | None = None
    """The kind's step role (updates_policy, pushes_weights ...)."""
    resource: str | None = None
    """The worker it occupies (None: a Ray task, which waits for nothing)."""
    depends_on: list[str] = Field(default_factory=list)
    """Nodes of the same list it waits for."""


class SimSetup(Strict):
    """The simulated configuration, reduced to what the event model needs."""

    mode: str
    """sync, colocate_async or separate_async."""
    groups_per_step: int = Field(ge=1)
    """data.prompts_per_step: groups one step trains on."""
    group_size: int = Field(1, ge=1)
    """The generate stage's n."""
    replicas: int = Field(1, ge=1)
    """resources.rollout_replicas."""
    max_tokens: int = Field(1, ge=1)
    """The generate stage's max_tokens (the response-length cap)."""
    threshold: int = Field(1, ge=1)
    """mode_params.max_off_policy_threshold (1 in sync)."""
    strategy: Literal["drop", "wait"] = "wait"
    """The replay buffer's strategy."""
    capacity_steps: int = Field(2, ge=1)
    """mode_params.capacity_steps."""
    overlap: bool = True
    """colocate_async: generate step k+1 during step k."""
    release_during_update: bool = True
    """colocate_async: the engine stops generating from the update to the push."""
    poll_s: float = Field(0.02, gt=0)
    """mode_params.poll_s: how long the feeders' and collections' polls wait."""
    env_latency_s: float = Field(0.0, ge=0)
    """The generate stage's env_latency_s (Pareto minimum; 0 = none)."""
    env_latency_max_s: float = Field(10.0, gt=0)
    """The generate stage's env_latency_max_s."""
    pareto_alpha: float = Field(1.2, gt=0)
    """The generate stage's pareto_alpha (of the environment latency draw)."""
    guard_bound: int | None = None
    """The staleness guard's own params.max_staleness (None: the mode's bound)."""
    head: list[SimNode] = Field(default_factory=list)
    """Async modes: the generation-side nodes after generate (the rollout replicas run them)."""
    train: list[SimNode] = Field(default_factory=list)
    """The nodes after generation in DAG order (sync: everything after generate; async: from the guard on)."""
    total_steps: int = Field(10, ge=1)
    """trainer.total_steps of the simulated config."""
    seed: int = Field(0, ge=0)
    """The config's seed (the simulator's draws use it)."""
    unmodeled: list[str] = Field(default_factory=list)
    """Parts of the config the event model leaves out (said in the prediction's notes)."""
    checkpoint_every: int | None = None
    """trainer.checkpoint_every (checkpoints take no simulated time)."""


def simulated_raw(raw: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The recorded raw config with ``overrides`` applied (and a guard added for an async mode); the notes."""
    raw = copy.deepcopy(raw)
    recorded_mode = raw.get("mode", "sync")
    for override in overrides:
        apply_override(raw, override)
    notes = _drop_foreign_mode_params(raw, recorded_mode, overrides)
    stages = raw.get("stages") or []
    if _needs_guard(raw.get("mode", "sync")) and not any(s.get("kind") == "staleness_guard" for s in stages):
        scoring = [i for i, s in enumerate(stages) if step_role_of(s.get("kind", "")) in ("generates", "scores")]
        at = scoring[-1] + 1 if scoring else len(stages)
        raw["stages"] = [*stages[:at], dict(GUARD_STAGE), *stages[at:]]
        after = stages[at - 1].get("name") or stages[at - 1].get("kind") if at else "the start"
        notes.append(f"added a staleness_guard stage after {after!r} ({raw['mode']} needs one)")
    return raw, notes


def _drop_foreign_mode_params(raw: dict[str, Any], recorded_mode: str, overrides: list[str]) -> list[str]:
    """When the overrides change the mode, the recorded mode's params the new mode does not take (an async run's
    ``max_off_policy_threshold`` under ``-o mode=sync``) are dropped, with a note; params the overrides set are
    kept (and validated: a wrong one stays an error)."""
    from rlpipe.registry import registry

    mode = raw.get("mode", "sync")
    params = raw.get("mode_params") or {}
    if mode == recorded_mode or not isinstance(params, dict) or not params:
        return []
    allowed = set(registry("mode").get(mode).Params.model_fields)
    given = {o.split("=", 1)[0].split(".")[1] for o in overrides if o.startswith("mode_params.")}
    foreign = sorted(k for k in params if k not in allowed and k not in given)
    if not foreign:
        return []
    raw["mode_params"] = {k: v for k, v in params.items() if k not in foreign}
    return [f"dropped the recorded {recorded_mode} run's mode_params {', '.join(foreign)} ({mode} does not take them)"]


def _needs_guard(mode: str) -> bool:
    """Whether the mode cuts the plan at a staleness guard (the async modes: rlpipe.modes.async_common)."""
    from rlpipe.modes.async_common import AsyncMode
    from rlpipe.registry import registry

    return issubclass(registry("mode").get(mode), AsyncMode)


def simulated_config(raw: dict[str, Any], overrides: list[str]) -> tuple[PipelineConfig, Any, dict, list[str]]:
    """Validate and plan the simulated config as ``rlpipe run`` would: (config, plan, raw, notes)."""
    from rlpipe.engine.planning.plan import build_plan

    changed, notes = simulated_raw(raw, overrides)
    config = validate_config(changed, source="the simulated config")
    return config, build_plan(config), changed, notes


def resource_of(node, recorded_worker: str | None, colocate: list[list[str]]) -> str | None:
    """The worker a node occupies: where the recording ran it (a task inside a worker's call occupies that
    worker), else its placement (a worker role, the driver, or None for a task)."""
    if recorded_worker:
        inside = recorded_worker.split(" in ", 1)[1] if " in " in recorded_worker else recorded_worker
        if inside != "task":
            role = inside.split("@", 1)[0].split("×", 1)[0].split("[", 1)[0]
            return _group_of(role, colocate)
        return None
    if node.spec.placement == "worker":
        return _group_of(node.spec.role, colocate)
    return "driver" if node.spec.placement == "driver" else None


def _group_of(role: str, colocate: list[list[str]]) -> str:
    for group in colocate:
        if role in group:
            return "+".join(group)
    return role


def build_setup(config: PipelineConfig, plan, workers: dict[str, str],
                overlapped: list[tuple[str, str]] | None = None) -> SimSetup:
    """The :class:`SimSetup` of a validated config and its plan; ``workers``: node → recorded worker;
    ``overlapped``: node pairs the recording ran at the same time (every other node waits for the one before it
    in run order, as the executor runs them)."""
    beside = {tuple(sorted(p)) for p in overlapped or []}
    mp = plan.mode_params
    gen = plan.anchor("generates")
    gp = gen.params
    colocate = config.resources.colocate
    guard = plan.anchor("guards_staleness")
    nodes = [n for n in plan.nodes if n is not gen]
    if _needs_guard(config.mode) and guard is not None:
        cut = plan.nodes.index(guard)
        head = [n for n in plan.nodes[:cut] if n.step_role not in ("generates", "selects_groups")]
        nodes = plan.nodes[cut:]
    else:
        head = []

    def sim(n, among) -> SimNode:
        names = {m.name for m in among}
        deps = {d for d in n.depends_on if d in names}
        i = among.index(n)
        if i and tuple(sorted((among[i - 1].name, n.name))) not in beside:
            deps.add(among[i - 1].name)
        return SimNode(name=n.name, kind=n.kind, step_role=n.step_role,
                       resource=resource_of(n, workers.get(n.name), colocate), depends_on=sorted(deps))

    unmodeled = []
    if plan.anchor("selects_groups") is not None:
        name = plan.anchor("selects_groups").name
        unmodeled.append(f"{name} (dynamic sampling): every group counts as informative")
    if config.eval is not None:
        unmodeled.append("evaluations during training (eval:) take no time")
    return SimSetup(
        unmodeled=unmodeled, checkpoint_every=config.trainer.checkpoint_every, mode=config.mode,
        groups_per_step=config.data.prompts_per_step, group_size=getattr(gp, "n", 1),
        replicas=config.resources.rollout_replicas, max_tokens=getattr(gp, "max_tokens", 1),
        threshold=getattr(mp, "max_off_policy_threshold", 1), strategy=getattr(mp, "strategy", "wait"),
        capacity_steps=getattr(mp, "capacity_steps", 2), overlap=getattr(mp, "overlap", True),
        release_during_update=getattr(mp, "release_memory_during_update", True), poll_s=getattr(mp, "poll_s", 0.02),
        env_latency_s=getattr(gp, "env_latency_s", 0.0), env_latency_max_s=getattr(gp, "env_latency_max_s", 10.0),
        pareto_alpha=getattr(gp, "pareto_alpha", 1.2),
        guard_bound=getattr(guard.params, "max_staleness", None) if guard is not None else None,
        head=[sim(n, head) for n in head], train=[sim(n, nodes) for n in nodes],
        total_steps=config.trainer.total_steps, seed=config.seed,
    )
