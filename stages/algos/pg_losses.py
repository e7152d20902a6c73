"""Policy-gradient losses, registered by verl's names (registry kind ``policy_loss``).

Every loss has the signature
``fn(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights) -> (loss, metrics)``
over padded ``[B, R]`` tensors of one micro-batch; ``agg`` (an
:class:`~rlpipe.stages.algos.aggregation.Aggregator`) turns a loss matrix into the
micro-batch's share under the global denominators; ``is_weights`` (rollout
correction, detached) multiply the per-token loss before aggregation.

* ``vanilla``: PPO clip (Schulman et al. 2017, https://arxiv.org/abs/1707.06347) with
  asymmetric ``clip_ratio_low/high`` (DAPO's clip-higher) and dual-clip bound
  ``clip_ratio_c`` for negative advantages (Ye et al. 2019, https://arxiv.org/abs/1912.09729).
* ``gspo``: sequence-level ratio (Zheng et al. 2025, https://arxiv.org/abs/2507.18071):
  ``s_i = exp(Σ_t m_t log(π_t/π_old,t) / |y_i|)``, token ratio ``s_i,t = sg[s_i]·π_t/sg[π_t]``
  (log clamped at 10), loss ``max(−A·s_i,t, −A·clip(s_i,t, 1−ε_low, 1+ε_high))`` aggregated
  with the configured ``loss_agg_mode`` (verl 0.9.1; default token-mean — the paper's
  sequence-level mean is ``seq-mean-token-mean``; verl's main branch hard-codes it).
* ``sapo``: soft sigmoid gates instead of clipping (https://arxiv.org/abs/2511.20347);
  always seq-mean-token-mean, as in verl.
* ``gpg``: plain ``-A·logπ`` (https://arxiv.org/abs/2504.02546).
* ``cispo``: clipped, stop-gradient IS weight times ``-A·logπ`` (MiniMax-M1, https://arxiv.org/abs/2506.13585).
* ``geo_mean``: GMPO, geometric mean of token ratios per sequence (https://arxiv.org/abs/2507.20673);
  the mean over sequences uses the global sequence count (verl: ``torch.mean`` over the
  micro-batch rows, which depends on micro-batching; equal for one micro-batch without empty rows).

clip_cov / kl_cov live in :mod:`pg_losses_cov`, dppo_tv / dppo_kl in :mod:`pg_losses_dppo`.
* ``dro``: Direct Reward Optimization with a quadratic log-ratio penalty (verl 0.9.1):
  ``−(A·log π − ½·β·(log π − log π_old)²)`` per token, β = ``dro_beta`` (required),
  aggregated with ``loss_agg_mode``; metric ``ppo_kl`` only.

``bypass_mode`` lives in :mod:`pg_losses_bypass`.
"""

from __future__ import annotations

import torch

from rlpipe.registry import registry
from rlpipe.stages.algos.ops import masked_mean

POLICY_LOSSES = registry("policy_loss")


def log_ratio_and_kl(log_prob, old_log_prob, mask, clamp: bool = True):
    """(log π/π_old clamped to ±20, ratio, ppo_kl metric = mean of -log ratio)."""
    log_ratio = log_prob - old_log_prob
    if clamp:
        log_ratio = torch.clamp(log_ratio, min=-20.0, max=20.0)
    return log_ratio, log_ratio.exp(), masked_mean(-log_ratio, mask).detach().item()


def weighted(pg_losses: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    """Apply rollout-correction IS weights (already detached) to a per-token loss."""
    return pg_losses if is_weights is None else pg_losses * is_weights


def _metrics(clipfrac, ppo_kl, clipfrac_lower) -> dict[str, float]:
    as_float = lambda x: float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)  # noqa: E731
    return {
        "actor/pg_clipfrac": as_float(clipfrac),
        "actor/ppo_kl": as_float(ppo_kl),
        "actor/pg_clipfrac_lower": as_float(clipfrac_lower),
    }


@POLICY_LOSSES.register("vanilla")
def vanilla(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    log_ratio, ratio, ppo_kl = log_ratio_and_kl(log_prob, old_log_prob, mask)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * cfg.clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    negative = advantages < 0
    pg_losses = torch.where(negative, dual, clipped)
    clipfrac = masked_mean(torch.gt(loss2, loss1).float(), mask)
    clipfrac_lower = masked_mean((torch.gt(clipped, loss3) & negative).float(), mask)
    loss = agg(weighted(pg_losses, is_weights))
    return loss, _metrics(clipfrac, ppo_kl, clipfrac_lower)


@POLICY_LOSSES.register("gspo")
def gspo(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    # s_i,t = sg[s_i] · π_t / sg[π_t]: the sequence ratio's value, the token's gradient
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.clamp(log_seq_ratio, max=10.0).exp()
    loss1 = -advantages * seq_ratio
    loss2 = -advantages * torch.clamp(seq_ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    pg_losses = torch.maximum(loss1, loss2)
    loss = agg(weighted(pg_losses, is_weights))  # the configured loss_agg_mode, as verl 0.9.1
    clipfrac = masked_mean(torch.gt(loss2, loss1).float(), mask)
    return loss, _metrics(clipfrac, masked_mean(-log_ratio, mask), 0.0)


@POLICY_LOSSES.register("dro")
def dro(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    log_ratio = log_prob - old_log_prob  # not clamped, as verl
    pg_losses = -(log_prob * advantages - 0.5 * cfg.dro_beta * log_ratio.square())
    return agg(weighted(pg_losses, is_weights)), {"actor/ppo_kl": float(masked_mean(-log_ratio.detach(), mask))}


@POLICY_LOSSES.register("sapo")
def sapo(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    _, ratio, ppo_kl = log_ratio_and_kl(log_prob, old_log_prob, mask)
    tau_pos = torch.as_tensor(cfg.tau_pos, dtype=advantages.dtype)
    tau_neg = torch.as_tensor(cfg.tau_neg, dtype=advantages.dtype)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = agg(weighted(-gates * advantages, is_weights), mode="seq-mean-token-mean")
    return loss, _metrics(0.0, ppo_kl, 0.0)


@POLICY_LOSSES.register("gpg")
def gpg(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    return agg(weighted(-log_prob * advantages, is_weights)), {}


@POLICY_LOSSES.register("cispo")
def cispo(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    _, ratio, ppo_kl = log_ratio_and_kl(log_prob, old_log_prob, mask)
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    pg_losses = -clipped.detach() * advantages * log_prob
    clipfrac = masked_mean((ratio != clipped).float(), mask)
    return agg(weighted(pg_losses, is_weights)), _metrics(clipfrac, ppo_kl, 0.0)


@POLICY_LOSSES.register("geo_mean")
def geo_mean(*, log_prob, old_log_prob, advantages, mask, cfg, agg, is_weights=None):
    log_ratio = log_prob - old_log_prob  # GMPO does not clamp at ±20
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -cfg.clip_low, cfg.clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)
    lengths = mask.sum(dim=-1) + 1e-8
    seq_ratio = torch.exp((pessimistic * mask).sum(dim=-1) / lengths)
    seq_adv = (advantages * mask).sum(dim=-1) / lengths
    seq_losses = -seq_adv * seq_ratio
    if is_weights is not None:  # geometric mean of the token weights of each sequence
        seq_losses = seq_losses * torch.exp((torch.log(is_weights + 1e-10) * mask).sum(dim=-1) / lengths)
    clipped = torch.ne(log_ratio, log_ratio_clamped)
    clipfrac = masked_mean((clipped & (advantages > 0)).float(), mask)
    clipfrac_lower = masked_mean((clipped & (advantages < 0)).float(), mask)
    metrics = _metrics(clipfrac, masked_mean(-log_ratio, mask), clipfrac_lower)
    return agg.seq_mean(seq_losses), metrics
