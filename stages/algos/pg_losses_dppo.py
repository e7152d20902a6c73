"""DPPO-Binary trust-region losses: ``dppo_tv`` and ``dppo_kl`` (https://arxiv.org/abs/2602.04879).

Instead of clipping the ratio, DPPO masks out tokens whose probability moved too
far from π_old, measured on the binary (token vs rest) distribution:

* ``dppo_tv``: ``π - π_old`` above ``clip_ratio_high`` (A > 0) or below ``-clip_ratio_low`` (A ≤ 0);
* ``dppo_kl``: binary KL above the threshold in the direction the advantage pushes.

Kept tokens get ``-A · sg[min(ratio, clip_ratio_c)] · logπ`` (truncated IS instead of
dual-clip). Here ``clip_ratio``/``_low``/``_high`` are divergence thresholds, not
ratio bounds. verl reads ``clip_ratio_c`` with a fallback of 20.0 that never
applies (the actor config always carries 3.0); rlpipe uses ``clip_ratio_c`` as set.
"""

from __future__ import annotations

import torch

from rlpipe.stages.algos.ops import masked_mean
from rlpipe.stages.algos.pg_losses import POLICY_LOSSES, _metrics, log_ratio_and_kl, weighted


def _dppo(log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights, keep_pos, keep_neg):
    _, ratio, ppo_kl = log_ratio_and_kl(log_prob, old_log_prob, mask)
    truncated = torch.clamp(ratio, max=cfg.clip_ratio_c).detach()
    keep = torch.where(advantages > 0, keep_pos, keep_neg).detach().float()
    pg_losses = -advantages * truncated * log_prob * keep
    clipfrac = masked_mean(1.0 - keep, mask)
    clipfrac_lower = masked_mean((ratio > cfg.clip_ratio_c).float() * keep, mask)
    return agg(weighted(pg_losses, is_weights)), _metrics(clipfrac, ppo_kl, clipfrac_lower)


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    delta = log_prob.exp() - old_log_prob.exp()
    keep_pos = delta <= cfg.clip_high
    keep_neg = delta >= -cfg.clip_low
    return _dppo(log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights, keep_pos, keep_neg)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    prob, old_prob = log_prob.exp(), old_log_prob.exp()
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    keep_pos = (binary_kl <= cfg.clip_high) | (prob <= old_prob)
    keep_neg = (binary_kl <= cfg.clip_low) | (prob >= old_prob)
    return _dppo(log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights, keep_pos, keep_neg)
