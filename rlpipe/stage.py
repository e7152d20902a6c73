"""The stage contract: what a DAG node is, independent of how it runs.

A stage implementation is registered under its kind (``stage.<kind>``; the kind itself is
registered in :mod:`rlpipe.stage_kinds`) with

* a pydantic ``Params`` model (``extra="forbid"``; defaults live there),
* the columns it ``reads`` and ``writes`` (name → Arrow type), possibly
  depending on its params,
* where it runs: ``placement="task"`` (a pure function over the batch, run as a
  Ray task), ``placement="worker"`` with a ``role`` (a function of the worker
  state that holds a model, run inside every worker of that role on its shard),
  or ``placement="driver"`` (an orchestration stage that calls worker methods
  through ``ctx.workers``; weight_sync is one).

A stage never imports Ray or MLflow and never mutates its input: it returns a
:class:`StageResult` with only the columns it adds or replaces (or, for a
stage that creates or selects rows, a whole new table / the rows to keep).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Protocol

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from rlpipe.registry import registry
from rlpipe.schemas.batch import column_type
from rlpipe.stage_kinds import Placement, get_kind


class StageParams(BaseModel):
    """Base of every stage's params model: unknown keys are errors; field docstrings are descriptions;
    ``inf``/``nan`` are refused in float params."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        from rlpipe.schemas.config import refuse_bool_for_number

        return refuse_bool_for_number(cls, value, info)


class NoParams(StageParams):
    """A stage without parameters."""


Columns = Mapping[str, pa.DataType]
ColumnsFn = Callable[[Any], Columns]


def cols(*names: str, **custom: pa.DataType) -> dict[str, pa.DataType]:
    """Column contract from well-known names (typed by the batch schema) plus custom ones."""
    out = {name: column_type(name) for name in names}
    out.update(custom)
    return out


@dataclass
class StageResult:
    """What a stage returns.

    columns: added or replaced columns (same row count and order as the input).
    table: a whole new table (stages that create rows, e.g. generate).
    keep: row indices of the input to keep (stages that select rows, e.g. filter_groups);
        applied before ``columns``, which are then aligned with the kept rows.
    metrics: scalar metrics, named ``<kind>/<metric>`` by the stage itself.
    """

    columns: dict[str, pa.Array] = field(default_factory=dict)
    table: pa.Table | None = None
    keep: Any = None
    metrics: dict[str, float] = field(default_factory=dict)
    carry: dict[str, Any] = field(default_factory=dict)
    """State handed to this node's next execution as ``ctx.carry`` (e.g. an adaptive KL
    coefficient); the engine keeps it between steps, so stages stay stateless."""
    counts: frozenset[str] = frozenset()
    """Names in ``metrics`` that count rows or events: a worker stage's per-worker values are summed,
    not averaged (e.g. ``reward/infra_failures`` over the reward pool's workers)."""
    policy_version: int | None = None
    """The policy version a weight push made current (a stage playing the step role ``pushes_weights``); the
    contexts of the nodes after it carry it. None from such a stage: the engine asks the trainer."""


@dataclass(frozen=True)
class StepExtras:
    """What the engine and the mode tell a step's stages beyond the context's fixed fields: one typed field each
    (a mode passing an unknown name fails where it passes it)."""

    temperature: float = 1.0
    """The generate node's sampling temperature: the log-prob stages score at it (one source of truth)."""
    max_staleness: int | None = None
    """The mode's staleness bound, which a staleness guard checks unless its params set one (None: no bound)."""
    max_version_lag: int | None = None
    """The largest gap between a token's weight version and the trainer's a guard accepts (None: not checked)."""
    sleep_after_generate: bool = False
    """The generate stage puts its engine to sleep once done (sync: training comes next)."""
    defer_weight_push: bool = False
    """The weight push returns once the replicas have the buckets; the driver settles it later (separate_async)."""
    eval: bool = False
    """The nodes run an evaluation (their rows never reach the trainer)."""

    def merged(self, changes: dict[str, Any] | None) -> "StepExtras":
        """These extras with the fields ``changes`` names set (an unknown name is a TypeError naming it)."""
        return replace(self, **changes) if changes else self

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (a replayable batch's JSON context)."""
        return asdict(self)


@dataclass
class StageContext:
    """What the engine tells a stage about the current execution."""

    step: int
    """Global step (0-based) of this execution of the DAG."""
    seed: int
    """Run seed; combine with ``step`` for per-step randomness."""
    policy_version: int = 0
    """Version of the weights the trainer holds when the stage runs."""
    dp_rank: int = 0
    dp_size: int = 1
    workers: "WorkerCalls | None" = None
    """Driver stages only: call methods of worker roles."""
    extras: StepExtras = StepExtras()
    """Run information from the engine and the mode (:class:`StepExtras`)."""

    def __post_init__(self) -> None:
        if isinstance(self.extras, dict):  # a replayed context from JSON, a hand-built one in a test
            self.extras = StepExtras().merged(self.extras)
    carry: dict[str, Any] = field(default_factory=dict)
    """What this node returned as ``StageResult.carry`` at its previous execution."""
    plugins: tuple[Any, ...] = ()
    """The pipeline's plugin files (rlpipe.plugin_files.PluginFile): imported where the stage runs before its
    implementation is looked up, so a Ray task worker knows the kinds and impls they register."""


class WorkerCalls(Protocol):
    """The engine's facade for driver stages (implemented on Ray by the executor)."""

    def call(self, role: str, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every worker of ``role`` (or only ``rank``); returns the results."""
        ...


@dataclass(frozen=True)
class Unreachable:
    """What a worker stage's rows become when a caller that does not wait on it (the separate_async
    rollout feeder calling the reward pool) gets no answer: the call ran past its deadline, or the
    worker died. Without it such a call fails the run; with it the rows are infrastructure failures."""

    timeout_s: Callable[[BaseModel], float]
    """The per-call deadline in seconds, from the stage's params."""
    result: Callable[[pa.Table, BaseModel, str], StageResult]
    """``result(rows, params, why)``: the stage's result for rows no worker answered (status failed)."""


@dataclass(frozen=True)
class StageSpec:
    """A registered stage implementation."""

    kind: str
    impl: str
    fn: Callable[..., StageResult]
    params_model: type[BaseModel]
    reads: Columns | ColumnsFn
    writes: Columns | ColumnsFn
    placement: Placement = "task"
    role: str | None = None
    creates_rows: bool = False
    check: Callable[[BaseModel, Any, Any], None] | None = None
    """Validate-time check of this node against the pipeline: ``check(params, config, plan)`` raises a
    ConfigError naming the field and the fix (e.g. a group estimator needs generate n ≥ 2)."""
    unreachable: Unreachable | None = None
    """Worker stages: per-call deadline and failed result for callers that do not wait (None: none)."""
    calls: tuple[str, ...] = ()
    """Driver stages: the worker roles they call through ``ctx.workers``. Declared, the stage may run inside the
    call of the single worker before it in the plan (resources.task_stages_in_workers), which reaches the roles
    it hosts in memory and the others through their actors: one driver round trip less (a weight push is then
    the trainer's last act of its chain). Empty: always on the driver."""

    def read_columns(self, params: BaseModel) -> dict[str, pa.DataType]:
        return dict(self.reads(params) if callable(self.reads) else self.reads)

    def write_columns(self, params: BaseModel) -> dict[str, pa.DataType]:
        return dict(self.writes(params) if callable(self.writes) else self.writes)

    @property
    def code_hash(self) -> str:
        """Hash of the implementation (its name and source): lineage records which code ran."""
        return _code_hash(self.kind, self.impl, self.fn)


@functools.lru_cache(maxsize=None)
def _code_hash(kind: str, impl: str, fn: Callable) -> str:
    # once per implementation: reading and tokenizing the source cost ~1 ms, and every record asks
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = f"{fn.__module__}.{fn.__qualname__}"
    return hashlib.sha256(f"{kind}/{impl}\n{source}".encode()).hexdigest()[:12]


def stage_registry(kind: str):
    """The registry of implementations of stage ``kind``."""
    return registry(f"stage.{kind}")


def stage(
    kind: str,
    impl: str,
    *,
    reads: Columns | ColumnsFn,
    writes: Columns | ColumnsFn,
    params: type[BaseModel] = NoParams,
    placement: Placement | None = None,
    role: str | None = None,
    creates_rows: bool = False,
    check: Callable[[BaseModel, Any, Any], None] | None = None,
    unreachable: Unreachable | None = None,
    calls: tuple[str, ...] = (),
) -> Callable[[Callable[..., StageResult]], Callable[..., StageResult]]:
    """Register a stage implementation.

    Task stages are ``fn(batch, params, ctx)``; worker stages are
    ``fn(worker_state, batch, params, ctx)``; driver stages are
    ``fn(batch, params, ctx)`` with ``ctx.workers`` set. ``kind`` must be registered
    (:func:`rlpipe.stage_kinds.stage_kind`); ``placement`` and ``role`` default to the kind's.
    """
    declared = get_kind(kind)
    if placement is None:
        placement, role = declared.placement, role or declared.role
    if placement == "worker" and not role:
        raise ValueError(f"worker stage {kind}/{impl} needs a role")
    if calls and placement != "driver":
        raise ValueError(f"stage {kind}/{impl}: only driver stages declare the roles they call")

    def decorate(fn: Callable[..., StageResult]) -> Callable[..., StageResult]:
        spec = StageSpec(kind, impl, fn, params, reads, writes, placement, role, creates_rows, check, unreachable,
                         tuple(calls))
        stage_registry(kind).add(impl, spec)
        return fn

    return decorate
