"""The ``bypass_mode`` policy loss (verl 0.9.1 ``compute_policy_loss_bypass_mode``).

In bypass mode π_old *is* π_rollout (the ``old_log_prob`` impl ``bypass`` writes the
rollout's logprobs as ``old_logprobs``), so only two policies are in play. Inside the
loss, with ``log ρ_t = sg[log π_t] − log π_rollout,t`` (the current policy against the
rollout's, no gradient):

* IS weights ``w`` (``bypass.rollout_is``: token ``ρ_t`` or sequence ``exp(Σ_t log ρ_t)``,
  truncated / IcePop-banded / batch-normalized exactly as the ``rollout_correction``
  stage does, :func:`rlpipe.stages.algos.rollout_correction.is_weights`);
* a rejection mask ``m' ≤ m`` (``bypass.rollout_rs``, same options and thresholds as
  that stage); every term below is aggregated over ``m'`` with the step's global
  denominators (counted from the original mask, as verl's ``global_batch_info``);
* ``bypass.loss_type``:
  ``ppo_clip`` — the ``vanilla`` PPO-clip loss with ratio π/π_rollout (the ratio already
  is the IS correction, so ``w`` is **not** applied — it is only reported);
  ``reinforce`` — ``−A·log π·w`` (``w = 1`` without IS), metric
  ``ppo_kl = mean_m'(−(log π − log π_rollout))``.

IS/RS diagnostics are reported as ``rollout_corr/<verl name>``. The ``is_weights`` column
(a ``rollout_correction`` stage) is ignored here, as verl ignores its argument.
"""

from __future__ import annotations

import torch

from rlpipe.stages.algos.aggregation import Aggregator
from rlpipe.stages.algos.ops import masked_mean
from rlpipe.stages.algos.pg_losses import POLICY_LOSSES, vanilla
from rlpipe.stages.algos.rollout_correction import is_weights as compute_is_weights
from rlpipe.stages.algos.rollout_correction import rejection_mask


@POLICY_LOSSES.register("bypass_mode")
def bypass_mode(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    bypass = cfg.bypass
    with torch.no_grad():
        log_ratio = log_prob.detach() - old_log_prob
        weights, metrics = None, {}
        if bypass.rollout_is:
            weights, metrics = compute_is_weights(log_ratio, mask, bypass.rollout_is, bypass.rollout_is_threshold,
                                                  bypass.rollout_is_batch_normalize)
        kept = mask
        if bypass.rollout_rs:
            kept, rs_metrics = rejection_mask(log_ratio, mask, bypass.rollout_rs, bypass.rollout_rs_threshold)
            metrics.update(rs_metrics)
    kept_agg = Aggregator(kept, agg.den, agg.mode, agg.loss_scale_factor)
    if bypass.loss_type == "ppo_clip":
        loss, pg_metrics = vanilla(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, mask=kept,
                                   cfg=cfg, agg=kept_agg, is_weights=None)
    else:
        pg_losses = -advantages * log_prob * (1.0 if weights is None else weights)
        loss = kept_agg(pg_losses)
        pg_metrics = {"actor/ppo_kl": float(masked_mean(-(log_prob.detach() - old_log_prob), kept))}
    return loss, {**pg_metrics, **{f"rollout_corr/{k}": float(v) for k, v in metrics.items()}}
