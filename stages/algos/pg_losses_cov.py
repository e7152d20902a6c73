"""Covariance-based entropy-preserving PPO losses: ``clip_cov`` and ``kl_cov``.

Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models" (https://arxiv.org/abs/2505.22617). Tokens whose centered
covariance ``(A - mean A)(logπ - mean logπ)`` is large drive entropy collapse:

* ``clip_cov`` drops the gradient of a random ``clip_cov_ratio`` fraction of the
  unclipped tokens whose covariance lies in ``(clip_cov_lb, clip_cov_ub)``;
* ``kl_cov`` adds ``ppo_kl_coef·|log r|`` to the top ``kl_cov_ratio`` fraction by covariance.

As in verl, the covariance statistics and the token selection are computed per
micro-batch (these losses are not micro-batch invariant), and clip_cov's random
choice uses torch's global RNG.
"""

from __future__ import annotations

import torch

from rlpipe.stages.algos.ops import masked_mean
from rlpipe.stages.algos.pg_losses import POLICY_LOSSES, weighted


def _covariance(advantages, log_prob, mask):
    return (advantages - masked_mean(advantages, mask)) * (log_prob.detach() - masked_mean(log_prob.detach(), mask))


@POLICY_LOSSES.register("clip_cov")
def clip_cov(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    valid = mask > 0
    clipped_by_ppo = (loss2 > loss1) & valid
    cov = _covariance(advantages, log_prob, mask)
    candidates = (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub) & valid & ~clipped_by_ppo
    n_drop = max(int(cfg.clip_cov_ratio * float(mask.sum())), 1)
    flat = torch.nonzero(candidates.reshape(-1), as_tuple=True)[0]
    chosen = flat[torch.randperm(flat.numel())[:n_drop]]
    keep = torch.ones(candidates.numel(), dtype=advantages.dtype)
    keep[chosen] = 0
    keep = keep.reshape(candidates.shape)
    pg_losses = torch.maximum(loss1, loss2) * keep
    metrics = {  # verl reports no clipfrac_lower for clip_cov
        "actor/pg_clipfrac": masked_mean((keep == 0).float(), mask).detach().item(),
        "actor/ppo_kl": masked_mean(-log_ratio, mask).detach().item(),
    }
    return agg(weighted(pg_losses, is_weights)), metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.exp()
    plain = -advantages * ratio
    penalized = plain + cfg.ppo_kl_coef * log_ratio.abs()
    valid = (mask > 0).reshape(-1)
    valid_idx = torch.nonzero(valid, as_tuple=True)[0]
    adv = advantages.detach().reshape(-1)[valid_idx]
    logp = log_prob.detach().reshape(-1)[valid_idx]
    chosen = torch.zeros(valid.numel(), dtype=torch.bool)
    if valid_idx.numel():
        cov = (adv - adv.mean()) * (logp - logp.mean())
        k = max(1, int(valid_idx.numel() * cfg.kl_cov_ratio))
        chosen[valid_idx[torch.topk(cov, k, largest=True).indices]] = True
    pg_losses = torch.where(chosen.reshape(mask.shape), penalized, plain)
    metrics = {"actor/ppo_kl": masked_mean(log_ratio.abs(), mask).detach().item()}
    return agg(weighted(pg_losses, is_weights)), metrics
