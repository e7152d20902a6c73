"""The ``staleness_guard`` stage (impl ``max_staleness``): prove that no trajectory is too stale.

Staleness of a trajectory consumed at step ``s`` = ``s − prompt_step + 1``
(verl's ``global_steps − prompt_global_steps + 1``, seed 7.2). The async modes
*enforce* the bound (the replay buffer's drop / wait strategies); this stage
*checks* it on the batch the trainer is about to use, from the recorded
``prompt_step`` of every row, and fails the step if any row exceeds it — or was
submitted after the step consuming it. The bound is the mode's
(``ctx.extras["max_staleness"]``) unless the params set one.

It reports the batch's staleness (min / mean / max and a histogram
``hist_<k>`` for k = 1 … bound), the versions each trajectory spans (max − min
+ 1 of its ``token_versions``: 2 when a weight push happened mid-generation)
and the version lag (trainer version − oldest token version).

It writes no column: staleness is one subtraction away from ``prompt_step``
and ``ctx.step``, and lineage already records both per trajectory; a column
would only widen every later table. Left out: failing on the version lag
(versions count weight pushes, whose relation to steps the mode owns).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pydantic import Field

from rlpipe.errors import StageError
from rlpipe.jagged import offsets_and_values
from rlpipe.schemas.batch import PROMPT_STEP, STATUS, TOKEN_VERSIONS, UID
from rlpipe.stage import StageContext, StageParams, StageResult, cols, stage

KIND, IMPL = "staleness_guard", "max_staleness"


class StalenessGuardParams(StageParams):
    """Params of the staleness guard."""

    max_staleness: int | None = Field(None, ge=1)
    """Bound to check; None = the mode's bound (`ctx.extras["max_staleness"]`)."""


@stage(KIND, IMPL, reads=cols(UID, PROMPT_STEP, TOKEN_VERSIONS, STATUS), writes={}, params=StalenessGuardParams)
def staleness_guard(batch: pa.Table, params: StalenessGuardParams, ctx: StageContext) -> StageResult:
    bound = _bound(params, ctx)
    staleness = _staleness(batch, ctx.step)
    _check(batch, staleness, bound, ctx.step)
    metrics: dict[str, float] = {}
    if len(staleness):
        metrics.update({"staleness/min": staleness.min(), "staleness/mean": staleness.mean(),
                        "staleness/max": staleness.max()})
        counts = np.bincount(staleness, minlength=bound + 1)
        metrics.update({f"staleness/hist_{k}": counts[k] for k in range(1, bound + 1)})
    lo, hi = _version_range(batch[TOKEN_VERSIONS])
    if len(lo):
        span = hi - lo + 1
        metrics.update({"versions_spanned/mean": span.mean(), "versions_spanned/max": span.max(),
                        "version_lag/max": ctx.policy_version - lo.min()})
    return StageResult(metrics={f"{KIND}/{k}": float(v) for k, v in metrics.items()})


def _bound(params: StalenessGuardParams, ctx: StageContext) -> int:
    bound = params.max_staleness if params.max_staleness is not None else ctx.extras.get("max_staleness")
    if bound is None:
        raise StageError(KIND, IMPL, ctx.step, "no staleness bound: run under a mode that sets "
                         "`max_staleness` (an async mode), or set params.max_staleness")
    return int(bound)


def _staleness(batch: pa.Table, step: int) -> np.ndarray:
    column = batch[PROMPT_STEP]
    if column.null_count:
        raise StageError(KIND, IMPL, step, f"{column.null_count} rows have no prompt_step; the data loader "
                         "or replay buffer must stamp every prompt with its submit step")
    return step - column.to_numpy().astype(np.int64) + 1


def _check(batch: pa.Table, staleness: np.ndarray, bound: int, step: int) -> None:
    bad = (staleness > bound) | (staleness < 1)
    if not bad.any():
        return
    uids = batch[UID].to_numpy(zero_copy_only=False)[bad]
    worst = int(staleness.max()) if (staleness > bound).any() else int(staleness.min())
    raise StageError(KIND, IMPL, step, (
        f"{int(bad.sum())} trajectories have staleness outside [1, {bound}] (worst {worst}; uids "
        f"{sorted(set(map(str, uids)))[:5]}): the mode's replay buffer let them through. Check its "
        "strategy and max_off_policy_threshold, and that prompts are stamped with their submit step"
    ))


def _version_range(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Per row with at least one stamped token: (min, max) token version (vectorized reduceat)."""
    if column.null_count:
        column = column.filter(column.is_valid())
    offsets, values = offsets_and_values(column)
    lens = np.diff(offsets)
    rows = np.flatnonzero(lens > 0)
    if not len(rows):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    values = values.astype(np.int64)
    starts = offsets[rows]
    return np.minimum.reduceat(values, starts), np.maximum.reduceat(values, starts)
