"""Group-wise advantage redistribution (the ``grpo_gar`` advantage impl).

MiMo-style GAR: a group-wise judge (:mod:`rlpipe.stages.judge`, ``mode: groupwise``) reads
all responses of a prompt together, scores their quality and flags the ones that game
the checker ("hacked"). GRPO's advantages are then redistributed *among the passing
trajectories only*. For one group with GRPO sequence advantages ``A_i``:

* passing set ``P = {i : A_i > 0}``; failures ``F = {i : A_i <= 0}``;
* hacked set ``H ⊆ P`` (the judge's flags; a flagged failure stays a failure);
* honest passing set ``Q = P \\ H`` with judge quality ``q_i >= 0`` (NaN → 0);
* the group's total positive advantage ``S = Σ_{i∈P} A_i`` is kept::

      A'_i = A_i                                   i ∈ F      (failures untouched)
      A'_i = 0                                     i ∈ H      (hacked: no credit)
      A'_i = S · q_i / Σ_{j∈Q} q_j                 i ∈ Q      (Σ_{j∈Q} q_j > 0)
      A'_i = S / |Q|                               i ∈ Q      (all q_j = 0)

  so ``Σ_{i∈Q} A'_i = S`` whenever ``Q`` is non-empty (if every passing trajectory is
  hacked, the positive mass is dropped: nothing honest earns it).

Token advantages are the sequence value on every ``response_mask == 1`` token, as GRPO's.
Failed rows (status "failed") are excluded as by every estimator. Left out: MiMo's
exact quality-to-weight mapping (we use proportional weights).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from rlpipe.schemas.batch import ADVANTAGES, RESPONSE_MASK, RETURNS
from rlpipe.stage import StageContext, StageResult, cols, stage, stage_registry
from rlpipe.stages.advantage import IMPLS
from rlpipe.stages.algos import batch_io as io
from rlpipe.stages.algos.ops import group_ids

JUDGE_SCORE = "judge_score"
"""The judge's quality score of a row (float32; NaN where it gave none)."""
JUDGE_HACKED = "judge_hacked"
"""1 where the group-wise judge flagged the row as reward hacking (int8)."""


def redistribute(adv: np.ndarray, group: np.ndarray, quality: np.ndarray, hacked: np.ndarray) -> np.ndarray:
    """GAR on sequence advantages ``adv`` (see the module docstring for the formula)."""
    out = adv.astype(np.float64).copy()
    quality = np.nan_to_num(np.maximum(quality, 0.0), nan=0.0)
    for g in np.unique(group):
        rows = np.flatnonzero(group == g)
        passing = rows[adv[rows] > 0]
        if passing.size == 0:
            continue
        total = adv[passing].sum(dtype=np.float64)
        honest = passing[~hacked[passing]]
        out[passing[hacked[passing]]] = 0.0
        if honest.size:
            q = quality[honest]
            out[honest] = total * (q / q.sum() if q.sum() > 0 else np.full(honest.size, 1.0 / honest.size))
    return out.astype(np.float32)


_grpo = stage_registry("advantage").get("grpo")


def _reads(params) -> dict[str, pa.DataType]:
    return {**_grpo.read_columns(params), JUDGE_SCORE: pa.float32(), JUDGE_HACKED: pa.int8()}


@stage("advantage", "grpo_gar", reads=_reads, writes=cols(ADVANTAGES, RETURNS), params=_grpo.params_model,
       check=_grpo.check)
def grpo_gar(batch: pa.Table, params, ctx: StageContext) -> StageResult:
    """GRPO advantages, then redistributed among each group's passing trajectories by the judge."""
    result = IMPLS["grpo"](batch, params, ctx)
    mask = io.mask_tensor(batch)
    adv = io.padded(pa.table({ADVANTAGES: result.columns[ADVANTAGES], RESPONSE_MASK: batch.column(RESPONSE_MASK)}),
                    ADVANTAGES, mask.shape[1])
    seq = (adv * mask).sum(1) / mask.sum(1).clamp(min=1)
    group = group_ids(io.uids(batch)).numpy()
    hacked = batch.column(JUDGE_HACKED).to_numpy(zero_copy_only=False).astype(bool)
    quality = batch.column(JUDGE_SCORE).to_numpy(zero_copy_only=False).astype(np.float64)
    new = torch.from_numpy(redistribute(seq.numpy(), group, quality, hacked))
    failed = torch.from_numpy(io.failed_rows(batch)) if params.exclude_failed else torch.zeros(len(new), dtype=bool)
    new[failed] = 0.0
    token_adv = new[:, None] * mask
    lens = io.response_lengths(batch)
    metrics = {**result.metrics, "advantage/gar_hacked": float(hacked.sum()),
               "advantage/gar_moved": float((new - seq).abs().sum())}
    return StageResult(columns={ADVANTAGES: io.jagged(token_adv, lens), RETURNS: io.jagged(token_adv, lens)},
                       metrics=metrics)
