"""The ``filter_groups`` stage (impl ``dapo``): drop the groups that carry no gradient.

DAPO dynamic sampling (https://arxiv.org/abs/2503.14476), classifier in
:mod:`rlpipe.stages.algos.dapo`: a group whose valid trajectories all got the
same ``metric`` value, or that has fewer than two valid trajectories, is evicted
(all its rows dropped). Rows with ``status == "failed"`` are excluded from the
decision and, with ``drop_failed``, dropped from the kept groups too. The
metrics say how many groups were evicted and how many the engine should refill
(``refill_factor`` × evicted, 2× in verl's sync DAPO); the refill itself is the
engine's job.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from rlpipe.schemas.batch import COLUMN_TYPES, REWARD, STATUS, UID
from rlpipe.stage import StageContext, StageParams, StageResult, cols, stage
from rlpipe.stages.algos import batch_io as io
from rlpipe.stages.algos.dapo import classify_groups


class FilterGroupsParams(StageParams):
    """verl's ``algorithm.filter_groups``."""

    metric: str = REWARD
    """Scalar numeric column whose within-group variance decides (verl: acc / score / seq_reward)."""
    drop_failed: bool = True
    """Also drop infra-failure rows (status "failed") of the kept groups: they carry no learning signal."""
    refill_factor: int = Field(2, ge=1)
    """Groups the engine should sample per evicted group (reported as `refill_groups`)."""


def _reads(p: FilterGroupsParams) -> dict[str, pa.DataType]:
    return {**cols(UID, STATUS), p.metric: COLUMN_TYPES.get(p.metric, pa.float32())}


@stage("filter_groups", "dapo", reads=_reads, writes={}, params=FilterGroupsParams)
def filter_groups(batch: pa.Table, params: FilterGroupsParams, ctx: StageContext) -> StageResult:
    """DAPO dynamic sampling: drop the groups whose valid samples all scored the same (no gradient)."""
    group = io.groups(batch)
    failed = torch.from_numpy(io.failed_rows(batch))
    metric = io.scalar(batch, params.metric)
    verdict = classify_groups(group, metric, ~failed & ~metric.isnan())  # a null score is not a valid trajectory
    keep = verdict.informative[group] & ~(failed if params.drop_failed else torch.zeros_like(failed))
    evicted = int((~verdict.informative).sum())
    metrics = {
        "groups": float(verdict.informative.numel()),
        "evicted_groups": float(evicted),
        "evicted_no_variance": float(verdict.no_variance.sum()),
        "evicted_single_valid": float(verdict.single_valid.sum()),
        "refill_groups": float(params.refill_factor * evicted),
        "dropped_rows": float(batch.num_rows - int(keep.sum())),
    }
    return StageResult(keep=np.flatnonzero(keep.numpy()), metrics={f"filter_groups/{k}": v for k, v in metrics.items()})
