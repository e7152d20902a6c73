"""What the run report shows, gathered from a run's lineage: plain models, pure functions, no store access.

Every function here takes tables or records already read (by :mod:`.read`, from the store or from the
observer's memory) and returns the models :mod:`.page` draws, so each figure of the report is checked on
hand-built tables without MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.schemas import batch as B

MAX_TIMELINE_STEPS = 20
"""The timeline draws at most the last this many steps: more would make each bar thinner than a pixel."""
MAX_TRAJECTORIES = 20
"""Sampled trajectories shown (the report must stay cheap to build and to open)."""
MAX_SAMPLE_STEPS = 5
"""Steps the trajectories are drawn from, spread over the run (first to last): versions change across them."""
MAX_TOKENS = 256
"""Response tokens shown per trajectory; the rest is counted, not drawn."""
MAX_MISMATCH_POINTS = 2000
"""Points of the engine-vs-trainer scatter (evenly thinned past this); the summary uses every token."""
VERSION_CLASSES = 8
"""Distinct token colours (``ver-0`` .. ``ver-7``); the sample's versions take them in order, then wrap."""


class _Model(BaseModel):
    # not schemas' Strict: a log-prob of -inf is data to show, not a config error
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TimelineBar(_Model):
    """One node execution on the timeline."""

    worker: str
    """Where it ran (the lineage's ``worker``: ``task``, ``driver``, ``actor×1``, ``rollout[0]`` ...)."""
    node: str
    """The node's name."""
    step: int
    """The step it belongs to."""
    start_s: float
    """Seconds from the start of the timeline's first shown execution."""
    duration_s: float = Field(ge=0)
    """Its wall time."""
    error: bool = False
    """It ended with an error."""


class Timeline(_Model):
    """Node executions per worker across the shown steps."""

    workers: list[str] = Field(default_factory=list)
    """One row per worker, in the order they first ran."""
    bars: list[TimelineBar] = Field(default_factory=list)
    """Every shown execution."""
    step_starts: list[tuple[int, float]] = Field(default_factory=list)
    """(step, seconds) where each shown step's first execution starts."""
    span_s: float = 0.0
    """Seconds from the first shown start to the last shown end."""
    nodes: list[str] = Field(default_factory=list)
    """Node names in the order they first ran (their colours)."""
    note: str | None = None
    """What was left out (the warm-up step, early steps), said on the page."""


class Series(_Model):
    """One curve over steps."""

    name: str
    """Its label (``reward/mean``, ``staleness max`` ...)."""
    points: list[tuple[int, float]] = Field(default_factory=list)
    """(step, value), by step."""


class Token(_Model):
    """One response token of a sampled trajectory."""

    text: str
    """The token decoded alone (its id in brackets when the run's tokenizer was not found)."""
    version: int | None = None
    """Policy version that produced it (None: not stamped)."""
    masked: bool = False
    """``response_mask`` 0: not trained on (a tool observation, a chat template's tokens)."""
    engine_logprob: float | None = None
    """The rollout engine's log-prob of the token (``rollout_logprobs``)."""
    trainer_logprob: float | None = None
    """The trainer's recomputed log-prob (``old_logprobs``)."""


class SampledTrajectory(_Model):
    """One trajectory of the run's sampled trajectories (``trajectories/step_*.parquet``)."""

    step: int
    """The step that consumed it."""
    uid: str
    """Its prompt's uid."""
    sample_index: int | None = None
    """Its index in the group."""
    prompt: str = ""
    """The decoded prompt."""
    reward: float | None = None
    """Its sequence reward."""
    status: str = ""
    """ok / truncated / aborted / failed."""
    tokens: list[Token] = Field(default_factory=list)
    """Its first :data:`MAX_TOKENS` response tokens."""
    tokens_left_out: int = Field(0, ge=0)
    """Response tokens past those."""


class Mismatch(_Model):
    """Per-token log-prob of the rollout engine against the trainer's, over the sampled trained-on tokens."""

    tokens: int = Field(ge=0)
    """Tokens compared (mask 1, both log-probs recorded and finite)."""
    mean_abs: float
    """Mean |trainer − engine|."""
    max_abs: float
    """Largest |trainer − engine|."""
    mean: float
    """Mean (trainer − engine): a systematic offset."""
    points: list[tuple[float, float]] = Field(default_factory=list)
    """(engine, trainer) per token, thinned to :data:`MAX_MISMATCH_POINTS`."""


class PredictionRow(_Model):
    """One figure of ``rlpipe simulate``'s table."""

    figure: str
    """What is compared."""
    predicted: str
    """The model's figure."""
    recorded: str
    """What the run measured ('-' where it does not)."""


class Prediction(_Model):
    """``rlpipe simulate RUN`` on the run's own config: the model's figures beside the measured ones."""

    title: str
    """What was simulated."""
    rows: list[PredictionRow] = Field(default_factory=list)
    """The figures."""
    verdict: str = ""
    """ok / starves / no_progress, with its reason."""
    notes: list[str] = Field(default_factory=list)
    """The simulator's notes (what it did not model)."""


class ReportData(_Model):
    """Everything one run report shows."""

    run_id: str
    """The MLflow run id."""
    run_name: str = ""
    """The run's name."""
    status: str = ""
    """RUNNING / FINISHED / FAILED / KILLED."""
    mode: str = ""
    """The run's mode (sync, colocate_async, separate_async)."""
    steps: int = Field(0, ge=0)
    """Steps recorded."""
    timeline: Timeline = Field(default_factory=Timeline)
    """The worker timeline."""
    series: list[Series] = Field(default_factory=list)
    """reward, response length and staleness per step."""
    trajectories: list[SampledTrajectory] = Field(default_factory=list)
    """The sampled trajectories shown."""
    versions: list[int] = Field(default_factory=list)
    """Distinct policy versions of the shown tokens, sorted: their colours (:func:`version_class`)."""
    mismatch: Mismatch | None = None
    """Engine vs trainer log-probs (None: the sample has not both)."""
    prediction: Prediction | None = None
    """simulate's prediction (None: not computed)."""
    notes: list[str] = Field(default_factory=list)
    """What the report could not show, and why."""


# ---------------------------------------------------------------------------------------------------------------


def timeline(records: list[NodeRecord], max_steps: int = MAX_TIMELINE_STEPS) -> Timeline:
    """The executions of the last ``max_steps`` steps per worker; the first (warm-up) step is left out when later
    steps exist (its cold start would squeeze the rest into a sliver)."""
    steps = sorted({r.step for r in records})
    if not steps:
        return Timeline(note="no node execution recorded")
    shown = steps[1:] if len(steps) > 1 else steps
    dropped = []
    if len(steps) > 1:
        dropped.append(f"the warm-up step {steps[0]}")
    if len(shown) > max_steps:
        dropped.append(f"steps {shown[0]}..{shown[-max_steps - 1]}")
        shown = shown[-max_steps:]
    keep = set(shown)
    picked = sorted((r for r in records if r.step in keep), key=lambda r: r.start_time)
    t0 = picked[0].start_time
    workers: list[str] = []
    nodes: list[str] = []
    firsts: dict[int, float] = {}
    bars = []
    for r in picked:
        worker = r.worker or "(not recorded)"
        if worker not in workers:
            workers.append(worker)
        if r.node not in nodes:
            nodes.append(r.node)
        firsts.setdefault(r.step, r.start_time - t0)
        bars.append(TimelineBar(worker=worker, node=r.node, step=r.step, start_s=r.start_time - t0,
                                duration_s=max(r.duration_s, 0.0), error=bool(r.error)))
    span = max(b.start_s + b.duration_s for b in bars)
    note = f"left out: {' and '.join(dropped)}" if dropped else None
    return Timeline(workers=workers, bars=bars, step_starts=sorted(firsts.items()), span_s=span, nodes=nodes,
                    note=note)


def series(rewards: Mapping[int, float], trajectory_lineage: pa.Table | None) -> list[Series]:
    """reward/mean per step; mean response length, mean and largest staleness per consuming step.

    Staleness is consuming step − prompt step + 1, as the staleness guard and ``rlpipe simulate`` count it
    (1 in sync mode)."""
    out = [Series(name="reward/mean", points=[(int(s), float(rewards[s])) for s in sorted(rewards)
                                              if math.isfinite(rewards[s])])]
    t = trajectory_lineage
    if t is None or not t.num_rows:
        return out
    g = t.group_by("consumed_step").aggregate([("num_tokens", "mean")]).sort_by("consumed_step")
    out.append(Series(name="response length (tokens, mean)",
                      points=list(zip(g.column("consumed_step").to_pylist(), g.column("num_tokens_mean").to_pylist()))))
    known = t.filter(pc.is_valid(t.column(B.PROMPT_STEP)))
    if known.num_rows:
        stale = pc.add(pc.subtract(known.column("consumed_step").cast(pa.int64()),
                                   known.column(B.PROMPT_STEP).cast(pa.int64())), 1)
        s = pa.table({"step": known.column("consumed_step"), "staleness": stale})
        g = s.group_by("step").aggregate([("staleness", "mean"), ("staleness", "max")]).sort_by("step")
        steps = g.column("step").to_pylist()
        out.append(Series(name="staleness (mean)", points=list(zip(steps, g.column("staleness_mean").to_pylist()))))
        out.append(Series(name="staleness (max)",
                          points=[(s, float(v)) for s, v in zip(steps, g.column("staleness_max").to_pylist())]))
    return out


def pick_steps(steps: list[int], k: int = MAX_SAMPLE_STEPS) -> list[int]:
    """At most ``k`` of ``steps`` (sorted), spread evenly from the first to the last."""
    steps = sorted(steps)
    if len(steps) <= k:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (k - 1))] for i in range(k)}) if k > 1 else steps[-1:]


def _column(table: pa.Table, name: str) -> list | None:
    return table.column(name).to_pylist() if name in table.column_names else None


def sampled_trajectories(tables: Mapping[int, pa.Table], limit: int = MAX_TRAJECTORIES,
                         decode: Callable[[list[int]], list[str]] | None = None,
                         max_tokens: int = MAX_TOKENS) -> list[SampledTrajectory]:
    """Up to ``limit`` trajectories, an even share from each step's table, spread over its rows (its groups);
    ``decode(ids)`` gives each token's text (None: ``[id]``)."""
    if not tables or limit <= 0:
        return []
    per_step = max(1, limit // len(tables))
    out: list[SampledTrajectory] = []
    for step in sorted(tables):
        t = tables[step]
        if not t.num_rows or B.RESPONSE_IDS not in t.column_names:
            continue
        stride = max(1, t.num_rows // per_step)
        t = t.take(list(range(0, t.num_rows, stride))[: min(per_step, limit - len(out))])
        cols = {name: _column(t, name) for name in (B.UID, B.SAMPLE_INDEX, B.RESPONSE_IDS, B.RESPONSE_MASK,
                                                    B.TOKEN_VERSIONS, B.ROLLOUT_LOGPROBS, B.OLD_LOGPROBS, B.REWARD,
                                                    B.STATUS, "prompt_text")}
        for i in range(t.num_rows):
            def at(name, default=None):
                values = cols[name]
                return default if values is None or values[i] is None else values[i]

            ids = at(B.RESPONSE_IDS, [])[:max_tokens]
            texts = decode(ids) if decode is not None and ids else [f"[{t_id}]" for t_id in ids]
            masks, versions = at(B.RESPONSE_MASK, []), at(B.TOKEN_VERSIONS, [])
            engine, trainer = at(B.ROLLOUT_LOGPROBS, []), at(B.OLD_LOGPROBS, [])
            tokens = [Token(text=texts[j], version=_get(versions, j), masked=_get(masks, j, 1) == 0,
                            engine_logprob=_get(engine, j), trainer_logprob=_get(trainer, j)) for j in range(len(ids))]
            out.append(SampledTrajectory(
                step=step, uid=str(at(B.UID, "")), sample_index=at(B.SAMPLE_INDEX), prompt=at("prompt_text", ""),
                reward=at(B.REWARD), status=at(B.STATUS, ""), tokens=tokens,
                tokens_left_out=len(at(B.RESPONSE_IDS, [])) - len(ids)))
        if len(out) >= limit:
            break
    return out


def _get(values: list, j: int, default=None):
    return values[j] if j < len(values) and values[j] is not None else default


def token_versions(trajectories: list[SampledTrajectory]) -> list[int]:
    """The distinct policy versions of the shown tokens, sorted."""
    return sorted({tok.version for t in trajectories for tok in t.tokens if tok.version is not None})


def version_class(version: int | None, versions: list[int]) -> str:
    """The CSS class that colours a token of ``version``: ``ver-<its rank among versions mod 8>``, ``ver-none``
    for an unstamped token."""
    if version is None or version not in versions:
        return "ver-none"
    return f"ver-{versions.index(version) % VERSION_CLASSES}"


def mismatch(tables: Mapping[int, pa.Table], max_points: int = MAX_MISMATCH_POINTS) -> Mismatch | None:
    """trainer − engine log-prob over every trained-on token of the sampled tables that has both (vectorized over
    the flattened lists); None when no table has both columns."""
    engine_parts, trainer_parts = [], []
    for t in tables.values():
        if B.ROLLOUT_LOGPROBS not in t.column_names or B.OLD_LOGPROBS not in t.column_names or not t.num_rows:
            continue
        engine = pc.list_flatten(t.column(B.ROLLOUT_LOGPROBS)).to_numpy(zero_copy_only=False).astype(np.float64)
        trainer = pc.list_flatten(t.column(B.OLD_LOGPROBS)).to_numpy(zero_copy_only=False).astype(np.float64)
        if len(engine) != len(trainer):  # not aligned per token: nothing to compare
            continue
        keep = np.isfinite(engine) & np.isfinite(trainer)
        if B.RESPONSE_MASK in t.column_names:
            mask = pc.list_flatten(t.column(B.RESPONSE_MASK)).to_numpy(zero_copy_only=False)
            if len(mask) == len(keep):
                keep &= mask != 0
        engine_parts.append(engine[keep])
        trainer_parts.append(trainer[keep])
    if not engine_parts:
        return None
    engine, trainer = np.concatenate(engine_parts), np.concatenate(trainer_parts)
    if not len(engine):
        return Mismatch(tokens=0, mean_abs=0.0, max_abs=0.0, mean=0.0)
    delta = trainer - engine
    idx = np.linspace(0, len(engine) - 1, min(len(engine), max_points)).round().astype(int)
    return Mismatch(tokens=len(engine), mean_abs=float(np.abs(delta).mean()), max_abs=float(np.abs(delta).max()),
                    mean=float(delta.mean()), points=list(zip(engine[idx].tolist(), trainer[idx].tolist())))
