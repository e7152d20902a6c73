"""Optimal token baseline (OTB) advantage estimators (verl 0.9.1 ``core_algos``).

Instead of one baseline per trajectory, every response position t of a prompt group
gets its own, weighted by each trajectory's cumulative path variance:

* ``G_t = Σ_{s ≥ t} r_s·m_s`` — reward-to-go (the returns);
* ``w_t = 1 − 2·π_t + Σ_v π(v)²`` — a proxy of the score function's squared norm at t,
  with ``π_t = exp(old_logprob_t)`` and Σπ² from the ``sum_pi_squared`` column
  (``old_log_prob`` impl ``trainer`` with ``sum_pi_squared: true``); with
  ``use_is_weights`` it is scaled by ``ρ̄_t²`` (the ``is_weights`` column);
* ``W_t = Σ_{j ≤ t} w_j·m_j`` — cumulative path variance;
* ``B_t = Σ_i G_{i,t}·W_{i,t}·m_{i,t} / (Σ_i W_{i,t}·m_{i,t} + ε)`` over the rows i of the group;
  a group of one row gets ``B = 0``; with ``handle_zero_tail`` the unique longest row of a
  group gets ``B = 0`` from the second-longest row's length on;
* ``A_t = (G_t − B_t)·m_t``; returns ``G``.

``optimal_token_baseline`` aligns rows by position in the padded response;
``tir_optimal_token_baseline`` (tool-integrated reasoning, multi-turn) first packs each
row's *valid* tokens to the left (tool tokens with ``m = 0`` removed), so the j-th model
token of every row shares a baseline, and rows without valid tokens leave their groups.
Vectorized with scatter-adds over group ids (verl loops over groups).
"""

from __future__ import annotations

import torch
from pydantic import Field

from rlpipe.stages.algos.advantages import EstimatorParams, estimator
from rlpipe.stages.algos.ops import group_count


class OTBParams(EstimatorParams):
    """Optimal token baseline settings (verl's function defaults)."""

    handle_zero_tail: bool = True
    """Zero the baseline of a group's unique longest row beyond the second-longest row's length."""
    epsilon: float = Field(1e-8, gt=0)
    """Added to the baseline's denominator."""
    use_is_weights: bool = False
    """Scale w_t by the squared rollout-correction `is_weights` (needs a rollout_correction stage)."""


def _group_rows_sum(x: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros((num_groups, *x.shape[1:]), dtype=x.dtype).index_add_(0, group, x)


def _baseline(returns, cumulative, mask, group, lengths, p: OTBParams, members):
    """Per-row, per-position baselines ``[B, R]``; ``members`` marks rows that take part in their group."""
    num_groups = int(group.max()) + 1 if group.numel() else 0
    weight = cumulative * mask * members.unsqueeze(-1)
    numerator = _group_rows_sum(returns * weight, group, num_groups)
    denominator = _group_rows_sum(weight, group, num_groups) + p.epsilon
    count = group_count(group[members], num_groups) if members.any() else torch.zeros(num_groups, dtype=torch.long)
    base = (numerator / denominator)[group] * (count[group] > 1).unsqueeze(-1) * members.unsqueeze(-1)
    if p.handle_zero_tail:
        length_in = torch.where(members, lengths, torch.full_like(lengths, -1))
        longest = torch.full((num_groups,), -1, dtype=lengths.dtype).scatter_reduce(0, group, length_in, "amax")
        at_max = members & (lengths == longest[group])
        unique = group_count(group[at_max], num_groups) == 1
        others = torch.where(at_max, torch.full_like(lengths, -1), length_in)
        second = torch.full((num_groups,), -1, dtype=lengths.dtype).scatter_reduce(0, group, others, "amax")
        tail = at_max & unique[group] & (second[group] >= 0) & (count[group] > 1)
        positions = torch.arange(returns.shape[1]).unsqueeze(0)
        base = torch.where(tail.unsqueeze(-1) & (positions >= second[group].unsqueeze(-1)), 0.0, base)
    return base


def _inputs(token_rewards, mask, old_log_probs, sum_pi_squared, is_weights):
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    if is_weights is not None:
        w = w * is_weights.square()
    return returns, (w * mask).cumsum(-1)


@estimator("optimal_token_baseline", OTBParams, needs=("old_log_probs", "sum_pi_squared", "is_weights"),
           grouped=True)
@torch.no_grad()
def optimal_token_baseline(token_rewards, mask, group, p: OTBParams, old_log_probs, sum_pi_squared, is_weights=None):
    """Optimal token baseline: per position, the group's returns weighted by each row's path variance."""
    returns, cumulative = _inputs(token_rewards, mask, old_log_probs, sum_pi_squared, is_weights)
    lengths = mask.sum(-1).long()
    base = _baseline(returns, cumulative, mask, group, lengths, p, torch.ones_like(lengths, dtype=torch.bool))
    return (returns - base) * mask, returns


@estimator("tir_optimal_token_baseline", OTBParams, needs=("old_log_probs", "sum_pi_squared", "is_weights"),
           grouped=True)
@torch.no_grad()
def tir_optimal_token_baseline(token_rewards, mask, group, p: OTBParams, old_log_probs, sum_pi_squared,
                               is_weights=None):
    """Optimal token baseline over each row's model tokens only (tool tokens removed): for multi-turn rows."""
    returns, cumulative = _inputs(token_rewards, mask, old_log_probs, sum_pi_squared, is_weights)
    lengths = mask.sum(-1).long()
    slot = (mask.cumsum(-1) - 1).clamp(min=0).long()  # j-th valid token of its row

    def pack(x):
        return torch.zeros_like(x).scatter_add_(1, slot, x * mask)

    packed_mask = (torch.arange(mask.shape[1]).unsqueeze(0) < lengths.unsqueeze(-1)).to(mask.dtype)
    base = _baseline(pack(returns), pack(cumulative), packed_mask, group, lengths, p, lengths > 0)
    advantages = (pack(returns) - base).gather(1, slot) * mask
    return advantages, returns
