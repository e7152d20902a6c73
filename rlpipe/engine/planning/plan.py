"""The planner: pipeline config → checked logical DAG.

The edges come from the column contracts and the YAML (:mod:`rlpipe.engine.planning.wiring`); the
nodes run in an order those edges allow, the YAML's wherever it is one. Everything is checked here,
before any process starts: unknown kinds and impls, bad params, missing required kinds, two nodes in
one step role (two generators), a read with no writer, a cycle, two writers of one column, type
mismatches, and the mode's constraints.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ValidationError

from rlpipe.engine.planning import preflight
from rlpipe.engine.planning.config_io import message, shown
from rlpipe.engine.planning.eval_plan import EvalPlan, plan_eval
from rlpipe.engine.planning.wiring import SOURCE, wire
from rlpipe.engine.tracking.lineage import params_hash
from rlpipe.engine.tracking.metric_loggers import check_loggers
from rlpipe.errors import ConfigError, PlanError
from rlpipe.plugin_files import PluginFile, import_plugin_files
from rlpipe.registry import registry
from rlpipe.schemas.batch import PROMPT_COLUMNS, column_type
from rlpipe.schemas.config import PipelineConfig
from rlpipe.stage import StageSpec, stage_registry
from rlpipe.stage_kinds import SINGLE_ROLES, StepRole, get_kind, known_kinds
from rlpipe.stages.datasets import validate_params as validate_dataset_params

@dataclass
class PlannedNode:
    """One checked node of the logical DAG."""

    name: str
    kind: str
    impl: str
    spec: StageSpec
    params: BaseModel
    reads: dict[str, pa.DataType]
    writes: dict[str, pa.DataType]
    providers: dict[str, str] = field(default_factory=dict)
    """Read column → name of the node (or SOURCE) that provides it."""
    timeout_s: float | None = None
    """Longest one execution may take (the stage config's ``timeout_s``; None: unbounded)."""
    after: tuple[str, ...] = ()
    """Nodes the YAML says this one runs after (``after:``), besides what its reads imply."""
    depends_on: dict[str, str] = field(default_factory=dict)
    """Every node this one waits for → why (a column it reads, a row set or state it replaces, ``after:``)."""

    @property
    def step_role(self) -> StepRole | None:
        """What the modes use this node for (its kind's step role)."""
        return get_kind(self.kind).step_role

    @property
    def params_dict(self) -> dict[str, Any]:
        return self.params.model_dump(mode="json")

    @functools.cached_property
    def params_hash(self) -> str:
        """Hash of the resolved params (fixed once planned; every lineage record asks)."""
        return params_hash(self.params_dict)

    @property
    def upstream(self) -> set[str]:
        return {p for p in self.providers.values() if p != SOURCE}


@dataclass
class Plan:
    """The checked logical DAG of one RL step, plus the validated mode."""

    nodes: list[PlannedNode]
    mode_name: str
    mode_params: BaseModel
    plugins: tuple[PluginFile, ...] = ()
    """The pipeline's plugin files, imported wherever a stage runs (StageContext.plugins)."""
    eval: EvalPlan | None = None
    """The eval DAG (``eval:``; None: no evaluation during training)."""
    data_checked: list[str] = field(default_factory=list)
    """What the preflight read of each dataset (every row, or which files in part), for ``rlpipe validate``."""

    def node(self, kind: str) -> PlannedNode | None:
        """The first node of ``kind`` (None when the pipeline has none)."""
        return next((n for n in self.nodes if n.kind == kind), None)

    def anchor(self, step_role: StepRole) -> PlannedNode | None:
        """The node playing ``step_role`` (one of SINGLE_ROLES; None when no node does)."""
        return next((n for n in self.nodes if n.step_role == step_role), None)

    def with_role(self, step_role: StepRole) -> list[PlannedNode]:
        """Every node playing ``step_role``, in run order."""
        return [n for n in self.nodes if n.step_role == step_role]

    def roles(self) -> set[str]:
        """Worker roles that host at least one node."""
        return {n.spec.role for n in self.nodes if n.spec.role}

    def summary(self) -> dict[str, Any]:
        def described(n: PlannedNode) -> dict[str, Any]:
            return {"name": n.name, "kind": n.kind, "impl": n.impl, "placement": n.spec.placement,
                    "role": n.spec.role, "reads": sorted(n.reads), "writes": sorted(n.writes),
                    "upstream": sorted(n.upstream), "depends_on": dict(sorted(n.depends_on.items()))}

        out = {"mode": self.mode_name, "nodes": [described(n) for n in self.nodes]}
        if self.eval is not None:
            out["eval_nodes"] = [described(n) for n in self.eval.nodes]
        return out


def build_plan(config: PipelineConfig) -> Plan:
    """Check ``config`` and return its logical DAG; raises PlanError/ConfigError with the fix."""
    import_plugin_files(config.plugins)  # before anything looks a kind or impl up
    validate_dataset_params(config.data.source, config.data.params)
    preflight.check_config(config)
    nodes = [_plan_node(i, stage_cfg) for i, stage_cfg in enumerate(config.stages)]
    required = [k for k in known_kinds() if get_kind(k).required]
    missing = [k for k in required if not any(n.kind == k for n in nodes)]
    if missing:
        raise PlanError(
            f"the pipeline has no stage of kind {', '.join(missing)}; every step needs "
            f"{', '.join(required)} (see pipelines/quickstart.yaml)"
        )
    for step_role in SINGLE_ROLES:
        playing = [n for n in nodes if n.step_role == step_role]
        if len(playing) > 1:
            raise PlanError(f"stages {', '.join(n.name for n in playing)} all play the step role {step_role!r} "
                            f"(kinds {', '.join(sorted({n.kind for n in playing}))}); a step has one: remove all "
                            "but one")
    source = {c: column_type(c) for c in PROMPT_COLUMNS}
    nodes = wire(nodes, source, _registered_writers)
    mode_cls = registry("mode").get(config.mode)
    mode_params = _validate_params(mode_cls.Params, config.mode_params, "mode_params")
    plan = Plan(nodes, config.mode, mode_params, tuple(config.plugins))
    from rlpipe.engine.state.roles import check_colocation  # torch and the engines: only when the plan is checked

    sync = next((n for n in nodes if n.kind == "weight_sync"), None)
    check_colocation(config, sync.impl if sync else None)
    mode_cls.check(config, plan)
    registry("trainer_backend").get(config.trainer.backend).check(config)
    check_loggers(config)
    for role in config.resources.placement:  # an unknown role raises, listing the known ones
        registry("worker_role").get(role)
    for node in nodes:
        if node.spec.check is not None:
            node.spec.check(node.params, config, plan)
    preflight.check_plan(config, plan)
    if config.eval is not None:
        validate_dataset_params(config.eval.data.source, config.eval.data.params)
        plan.eval = plan_eval(config, plan, _validate_params)
    return plan


def _plan_node(index: int, stage_cfg) -> PlannedNode:
    where = f"stages[{index}:{stage_cfg.node_name}]"
    try:
        get_kind(stage_cfg.kind)
    except Exception as exc:
        raise PlanError(f"{where}: {exc} (a plugin registers new kinds: rlpipe.stage_kinds.stage_kind)") from None
    try:
        spec: StageSpec = stage_registry(stage_cfg.kind).get(stage_cfg.impl)
    except Exception as exc:
        raise PlanError(f"{where}: {exc}") from None
    params = _validate_params(spec.params_model, stage_cfg.params, f"{where}.params")
    return PlannedNode(
        stage_cfg.node_name, stage_cfg.kind, stage_cfg.impl, spec, params,
        spec.read_columns(params), spec.write_columns(params), timeout_s=stage_cfg.timeout_s,
        after=tuple(stage_cfg.after),
    )


def _validate_params(model: type[BaseModel], raw: dict[str, Any], where: str) -> BaseModel:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in (where, *err["loc"]))
            if err["type"] == "extra_forbidden":
                allowed = ", ".join(model.model_fields) or "(none)"
                close = difflib.get_close_matches(str(err["loc"][-1]), list(model.model_fields), n=1)
                hint = f" did you mean {close[0]!r}?" if close else ""
                lines.append(f"{loc}: unknown param;{hint} allowed: {allowed}")
            elif err["type"] == "finite_number":
                lines.append(f"{loc}: must be a finite number, got {err.get('input')!r}; write a finite value")
            else:
                lines.append(f"{loc}: {message(err)} (got {shown(err.get('input'))})")
        raise ConfigError("invalid params:\n  " + "\n  ".join(lines)) from None


def _registered_writers(column: str) -> list[str]:
    out = []
    for kind in known_kinds():
        for impl, spec in stage_registry(kind).items():
            try:
                writes = spec.write_columns(spec.params_model())
            except ValidationError:  # params without defaults: fall back to static contracts
                writes = {} if callable(spec.writes) else spec.writes
            if column in writes:
                out.append(f"{kind}/{impl}")
    return sorted(out)
