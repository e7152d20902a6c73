"""The ``rollout_correction`` stage (impl ``default``): IS weights, rejection masks, off-policy metrics.

verl's ``compute_rollout_correction_and_add_to_batch`` (math in
:mod:`rlpipe.stages.algos.rollout_correction` and
:mod:`rlpipe.stages.algos.offpolicy_metrics`). Runs after ``old_log_prob``,
with ``log ρ = old_logprobs − rollout_logprobs``:

* ``rollout_is`` set → writes ``is_weights`` (detached; the update multiplies the
  policy loss by them when its ``use_is_weights`` is on);
* ``rollout_rs`` set → rewrites ``response_mask`` with rejected tokens set to 0
  (a token is never un-masked);
* always reports kl, k3_kl, ppl_ratio, log_ppl_diff, chi2_token, chi2_seq, and the IS
  effective sample size / RS masked fractions when those are on.

Bypass mode (π_old := π_rollout, verl's ``bypass_mode``) is the ``old_log_prob``
impl ``bypass``; it validates its input with
:func:`rlpipe.stages.algos.batch_io.require_rollout_logprobs`. Under bypass the
PPO ratio already is π/π_rollout, so this stage is not needed (verl applies no IS
weights to its ppo_clip bypass loss either). verl's in-loss IS/RS and its ``reinforce``
loss type are the ``bypass_mode`` policy loss (:mod:`rlpipe.stages.algos.pg_losses_bypass`).
"""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
import torch
from pydantic import model_validator

from rlpipe.errors import ConfigError
from rlpipe.jagged import from_padded
from rlpipe.schemas.batch import IS_WEIGHTS, OLD_LOGPROBS, RESPONSE_MASK, ROLLOUT_LOGPROBS
from rlpipe.stage import StageContext, StageParams, StageResult, cols, stage
from rlpipe.stages.algos import batch_io as io
from rlpipe.stages.algos.offpolicy_metrics import offpolicy_metrics
from rlpipe.stages.algos.rollout_correction import is_weights, parse_is_threshold, parse_rs, rejection_mask


class RolloutCorrectionParams(StageParams):
    """verl's ``algorithm.rollout_correction`` (without bypass, which is ``old_log_prob: bypass``)."""

    rollout_is: Literal["token", "sequence"] | None = "sequence"
    """IS weight level: token (ρ_t) or sequence (Π ρ_t); null = no IS weights (metrics only)."""
    rollout_is_threshold: str | float = 2.0
    """A number: truncate weights at it (TIS). 'lower_upper' (e.g. '0.5_5.0'): zero weights outside (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their batch mean (token level: over tokens; sequence level: over sequences)."""
    rollout_rs: str | None = None
    """Rejection options, comma-separated (AND): token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3."""
    rollout_rs_threshold: str | float | None = None
    """One threshold for all options or one per option (comma-separated);
    *_k1 options take 'lower_upper' ratio bounds (a single u means 1/u_u)."""

    @model_validator(mode="after")
    def _check(self) -> "RolloutCorrectionParams":
        try:
            parse_is_threshold(self.rollout_is_threshold)
            if self.rollout_rs is not None:
                parse_rs(self.rollout_rs, self.rollout_rs_threshold)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self


def _writes(p: RolloutCorrectionParams) -> dict[str, pa.DataType]:
    return cols(*([IS_WEIGHTS] if p.rollout_is else []), *([RESPONSE_MASK] if p.rollout_rs else []))


@stage(
    "rollout_correction", "default", params=RolloutCorrectionParams, writes=_writes,
    reads=cols(OLD_LOGPROBS, ROLLOUT_LOGPROBS, RESPONSE_MASK),
)  # fmt: skip
def rollout_correction(batch: pa.Table, params: RolloutCorrectionParams, ctx: StageContext) -> StageResult:
    """Off-policy correction of rollout vs trainer logprobs: IS weights, rejection masks and mismatch metrics."""
    lens = io.response_lengths(batch)
    mask = io.mask_tensor(batch)
    rollout = io.require_rollout_logprobs(batch, mask.shape[1])
    old = io.padded(batch, OLD_LOGPROBS, mask.shape[1])
    log_ratio = old - rollout
    metrics = offpolicy_metrics(old, rollout, mask)
    columns: dict[str, pa.Array] = {}
    if params.rollout_is:
        weights, is_metrics = is_weights(
            log_ratio, mask, params.rollout_is, params.rollout_is_threshold, params.rollout_is_batch_normalize
        )
        columns[IS_WEIGHTS] = io.jagged(weights, lens)
        metrics.update(is_metrics)
    if params.rollout_rs:
        kept, rs_metrics = rejection_mask(log_ratio, mask, params.rollout_rs, params.rollout_rs_threshold)
        columns[RESPONSE_MASK] = from_padded(kept.to(torch.int8), lens, pa.int8())
        metrics.update(rs_metrics)
    return StageResult(columns=columns, metrics={f"rollout_correction/{k}": v for k, v in metrics.items()})
