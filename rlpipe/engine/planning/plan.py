"""The planner: pipeline config → checked logical DAG.

Nodes are ordered by the canonical kind order of the step DAG
(:data:`rlpipe.stage.STEP_KINDS`) and, within a kind, by declaration. Each read
column is wired to its provider: the nearest earlier node that writes it (or the
prompt source). Everything is checked here, before any process starts: unknown
kinds and impls, bad params, missing required kinds, a read with no writer, a
read only a later node can satisfy (a cycle), two writers of one column at the
same position, type mismatches, and the mode's constraints.
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
from rlpipe.engine.tracking.lineage import params_hash
from rlpipe.engine.tracking.metric_loggers import check_loggers
from rlpipe.errors import ConfigError, PlanError
from rlpipe.registry import registry
from rlpipe.schemas.batch import PROMPT_COLUMNS, column_type
from rlpipe.schemas.config import PipelineConfig
from rlpipe.stage import REQUIRED_KINDS, STEP_KINDS, StageSpec, stage_registry
from rlpipe.stages.datasets import validate_params as validate_dataset_params

SOURCE = "<prompts>"
"""Provider name of the columns the prompt source (data loader) supplies."""


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

    def node(self, kind: str) -> PlannedNode | None:
        """The first node of ``kind`` (None when the pipeline has none)."""
        return next((n for n in self.nodes if n.kind == kind), None)

    def roles(self) -> set[str]:
        """Worker roles that host at least one node."""
        return {n.spec.role for n in self.nodes if n.spec.role}

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode_name,
            "nodes": [
                {"name": n.name, "kind": n.kind, "impl": n.impl, "placement": n.spec.placement,
                 "role": n.spec.role, "reads": sorted(n.reads), "writes": sorted(n.writes),
                 "upstream": sorted(n.upstream)}
                for n in self.nodes
            ],
        }


def build_plan(config: PipelineConfig) -> Plan:
    """Check ``config`` and return its logical DAG; raises PlanError/ConfigError with the fix."""
    validate_dataset_params(config.data.source, config.data.params)
    preflight.check_config(config)
    nodes = [_plan_node(i, stage_cfg) for i, stage_cfg in enumerate(config.stages)]
    missing = [k for k in REQUIRED_KINDS if not any(n.kind == k for n in nodes)]
    if missing:
        raise PlanError(
            f"the pipeline has no stage of kind {', '.join(missing)}; every step needs "
            f"{', '.join(REQUIRED_KINDS)} (see pipelines/quickstart.yaml)"
        )
    nodes.sort(key=lambda n: STEP_KINDS.index(n.kind))  # stable: declaration order within a kind
    _wire(nodes)
    mode_cls = registry("mode").get(config.mode)
    mode_params = _validate_params(mode_cls.Params, config.mode_params, "mode_params")
    plan = Plan(nodes, config.mode, mode_params)
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
    return plan


def _plan_node(index: int, stage_cfg) -> PlannedNode:
    where = f"stages[{index}:{stage_cfg.node_name}]"
    if stage_cfg.kind not in STEP_KINDS:
        raise PlanError(f"{where}: unknown stage kind {stage_cfg.kind!r}; known kinds: {', '.join(sorted(STEP_KINDS))}")
    try:
        spec: StageSpec = stage_registry(stage_cfg.kind).get(stage_cfg.impl)
    except Exception as exc:
        raise PlanError(f"{where}: {exc}") from None
    params = _validate_params(spec.params_model, stage_cfg.params, f"{where}.params")
    return PlannedNode(
        stage_cfg.node_name, stage_cfg.kind, stage_cfg.impl, spec, params,
        spec.read_columns(params), spec.write_columns(params), timeout_s=stage_cfg.timeout_s,
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


def _wire(nodes: list[PlannedNode]) -> None:
    available: dict[str, tuple[str, pa.DataType, int]] = {
        c: (SOURCE, column_type(c), -1) for c in PROMPT_COLUMNS
    }
    for pos, node in enumerate(nodes):
        for column, wanted in node.reads.items():
            if column not in available:
                raise PlanError(_no_writer_message(node, column, nodes[pos + 1 :]))
            provider, have, _ = available[column]
            if have != wanted:
                raise PlanError(
                    f"type mismatch on column {column!r}: {provider} writes {have} but "
                    f"{node.name} ({node.kind}/{node.impl}) reads {wanted}"
                )
            node.providers[column] = provider
        rank = STEP_KINDS.index(node.kind)
        for column, dtype in node.writes.items():
            previous = available.get(column)
            if previous and previous[2] == rank and previous[0] != node.name:
                raise PlanError(
                    f"two writers of column {column!r} at the same point of the DAG: {previous[0]} and "
                    f"{node.name} (both {node.kind}); remove one or give them different columns"
                )
            available[column] = (node.name, dtype, rank)


def _no_writer_message(node: PlannedNode, column: str, later: list[PlannedNode]) -> str:
    reader = f"{node.name} ({node.kind}/{node.impl}) reads column {column!r}"
    downstream = [n.name for n in later if column in n.writes]
    if downstream:
        return (
            f"cycle: {reader}, which only {', '.join(downstream)} writes, and that runs after it "
            f"in the step DAG; a stage cannot depend on its own downstream"
        )
    writers = _registered_writers(column)
    hint = f"; add a stage that writes it: {', '.join(writers)}" if writers else ""
    return f"{reader} but no stage before it writes it{hint}"


def _registered_writers(column: str) -> list[str]:
    out = []
    for kind in STEP_KINDS:
        for impl, spec in stage_registry(kind).items():
            try:
                writes = spec.write_columns(spec.params_model())
            except ValidationError:  # params without defaults: fall back to static contracts
                writes = {} if callable(spec.writes) else spec.writes
            if column in writes:
                out.append(f"{kind}/{impl}")
    return sorted(out)
