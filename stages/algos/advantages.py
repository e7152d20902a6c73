"""Advantage estimators, registered by verl's names (registry kind ``advantage_estimator``).

Each :class:`Estimator` maps padded ``[B, R]`` token rewards and response mask,
dense group ids ``[B]`` (rows sharing a uid), its params and, where needed,
critic ``values`` or ReMax ``reward_baselines`` to ``(advantages, returns)``.
Outcome estimators score a row by the sum of its token rewards. Values equal
verl's ``core_algos`` (group statistics with ``torch.std``'s unbiased std; a
singleton group has mean 0 and std 1), computed with scatter ops over group ids.

* ``gae``: Schulman et al. 2016, https://arxiv.org/abs/1506.02438 (whitened advantages).
* ``grpo`` / ``dr_grpo``: Shao et al. 2024, https://arxiv.org/abs/2402.03300; without the
  std division = Dr. GRPO, Liu et al. 2025, https://arxiv.org/abs/2503.20783.
* ``grpo_passk``: only the best row of a group gets ``r_max - r_2nd`` (https://arxiv.org/abs/2503.19595).
* ``rloo``: leave-one-out baseline, Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740.
* ``reinforce_plus_plus`` / ``reinforce_plus_plus_baseline``: Hu 2025, https://arxiv.org/abs/2501.03262.
* ``remax``: greedy-rollout baseline, Li et al. 2023, https://arxiv.org/abs/2310.10505.
* ``opo``: length-weighted group baseline, https://arxiv.org/abs/2505.23585.
* ``gpg``: group baseline scaled by batch/non-zero-score rows, https://arxiv.org/abs/2504.02546.
* ``gdpo``: group reward-decoupled normalization (https://arxiv.org/abs/2601.05242, verl 0.9.1):
  for each reward component k (scalar columns ``reward_keys``; none = the row's score),
  ``A_k = (r_k − μ_g(r_k)) / (σ_g(r_k) + ε)`` within the group (GRPO, with
  ``norm_adv_by_std_in_grpo``), ``A = Σ_k w_k·A_k`` (``reward_weights``, default 1), then
  whitened over the batch's valid tokens: ``(A − mean_m A)/sqrt(var_m A + 1e-8)``, times the mask.
* ``optimal_token_baseline`` / ``tir_optimal_token_baseline``: per-token baselines
  (:mod:`advantages_otb`).

Left out: verl's ``*_vectorized`` aliases (every estimator here is vectorized). GAE and discounted REINFORCE++ are a
reverse scan over positions, vectorized over rows (REINFORCE++ with γ = 1 is a cumulative sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from pydantic import Field, model_validator

from rlpipe.errors import RlpipeError
from rlpipe.registry import registry
from rlpipe.stage import StageParams
from rlpipe.stages.algos.ops import group_count, group_mean_std, group_sum, masked_whiten, sequence_scores

ESTIMATORS = registry("advantage_estimator")
BUILTIN_ESTIMATORS: dict[str, "Estimator"] = {}


class EstimatorParams(StageParams):
    """Params of an estimator without settings."""


class GroupNormParams(EstimatorParams):
    """Group-normalized outcome advantages (verl ``algorithm.norm_adv_by_std_in_grpo``)."""

    epsilon: float = Field(1e-6, gt=0)
    """Added to the group std before dividing."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group std (GRPO); False = Dr. GRPO."""


class DrGRPOParams(GroupNormParams):
    """GRPO without the std division (Dr. GRPO)."""

    norm_adv_by_std_in_grpo: bool = False
    """Divide by the group std; False (the default here) is Dr. GRPO."""


class DiscountParams(EstimatorParams):
    """Discounted returns (verl ``algorithm.gamma``)."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor."""


class GAEParams(DiscountParams):
    """GAE (verl ``algorithm.gamma`` / ``algorithm.lam``)."""

    lam: float = Field(1.0, ge=0, le=1)
    """GAE λ (bias/variance trade-off)."""


class GPGParams(EstimatorParams):
    """GPG's normalization (verl's function default)."""

    f_norm: float = Field(1.0, gt=0)
    """Divisor of the scaled group-centered score."""


class GDPOParams(GroupNormParams):
    """GDPO's reward components (verl ``algorithm.gdpo_reward_keys`` / ``gdpo_reward_weights``)."""

    reward_keys: list[str] = Field(default_factory=list)
    """Scalar float32 columns, one per reward component, each normalized within its group; empty = the row's
    score (the sum of its token rewards) as the only component."""
    reward_weights: list[float] | None = None
    """Weight of each component in the sum (same length as reward_keys); None = all 1."""

    @model_validator(mode="after")
    def _weights_match(self) -> "GDPOParams":
        if self.reward_weights is not None and len(self.reward_weights) != max(len(self.reward_keys), 1):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} entries for "
                             f"{max(len(self.reward_keys), 1)} reward components; give one weight per reward_keys entry")
        return self


@dataclass(frozen=True)
class Estimator:
    """A registered estimator: the function, its params model, the extra inputs it needs."""

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    params: type[EstimatorParams] = EstimatorParams
    needs: tuple[str, ...] = ()
    """Extra inputs beyond rewards/mask/group: ``values`` (critic), ``reward_baselines`` (ReMax),
    ``reward_components`` (GDPO), ``old_log_probs``, ``sum_pi_squared``, ``is_weights`` (optimal token baseline)."""
    grouped: bool = False
    """Its baseline comes from the other samples of the same prompt: it needs generate n ≥ 2."""

    def __call__(self, token_rewards, response_mask, group, params=None, **extra):
        return self.fn(token_rewards, response_mask, group, params or self.params(), **extra)


def estimator(name: str, params: type[EstimatorParams] = EstimatorParams, needs: tuple[str, ...] = (),
              grouped: bool = False):
    def decorate(fn):
        est = Estimator(fn, params, needs, grouped)
        ESTIMATORS.add(name, est)
        BUILTIN_ESTIMATORS[name] = est
        return fn

    return decorate


def _outcome(scalars: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = scalars.unsqueeze(-1) * mask
    return adv, adv


def reverse_scan(x: torch.Tensor, mask: torch.Tensor, decay: float) -> torch.Tensor:
    """``y_t = x_t + decay·y_{t+1}`` over valid positions; masked positions carry ``y`` through unchanged."""
    if decay == 1.0:
        return (x * mask).flip(-1).cumsum(-1).flip(-1)
    out, running = torch.zeros_like(x), torch.zeros_like(x[:, 0])
    for t in reversed(range(x.shape[1])):
        m = mask[:, t]
        running = (x[:, t] + decay * running) * m + running * (1 - m)
        out[:, t] = running
    return out


@estimator("gae", GAEParams, needs=("values",))
def gae(token_rewards, mask, group, p: GAEParams, values):
    """GAE advantages (whitened) and returns from the critic's values (PPO)."""
    adv = torch.zeros_like(values)
    last, next_value = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):  # masked positions (tool tokens) carry both through
        m = mask[:, t]
        delta = token_rewards[:, t] + p.gamma * next_value - values[:, t]
        last = (delta + p.gamma * p.lam * last) * m + last * (1 - m)
        next_value = values[:, t] * m + next_value * (1 - m)
        adv[:, t] = last
    return masked_whiten(adv, mask), adv + values


@estimator("dr_grpo", DrGRPOParams, grouped=True)
@estimator("grpo", GroupNormParams, grouped=True)
def grpo(token_rewards, mask, group, p: GroupNormParams):
    """GRPO: each sample's score minus its group's mean, divided by the group's std (dr_grpo: not divided)."""
    scores = sequence_scores(token_rewards)
    mean, std, _ = group_mean_std(scores, group)
    centered = scores - mean
    return _outcome(centered / (std + p.epsilon) if p.norm_adv_by_std_in_grpo else centered, mask)


@estimator("grpo_passk", GroupNormParams, grouped=True)
def grpo_passk(token_rewards, mask, group, p: GroupNormParams):
    """Pass@k GRPO: only each group's best sample gets an advantage, its margin over the second best."""
    scores = sequence_scores(token_rewards)
    counts = group_count(group)
    if bool((counts < 2).any()):
        raise RlpipeError(
            f"grpo_passk needs at least 2 samples per group, got a group of {int(counts.min())}; raise n"
        )
    by_score = torch.argsort(-scores, stable=True)
    order = by_score[torch.argsort(group[by_score], stable=True)]  # grouped, best first
    starts = torch.cumsum(counts, 0) - counts
    best, second = order[starts], order[starts + 1]
    gap = scores[best] - scores[second]
    if p.norm_adv_by_std_in_grpo:
        _, std, _ = group_mean_std(scores, group)
        gap = gap / (std[best] + p.epsilon)
    scalars = torch.zeros_like(scores).index_put_((best,), gap)
    return _outcome(scalars, mask)


@estimator("rloo", grouped=True)
def rloo(token_rewards, mask, group, p):
    """RLOO: each sample's score minus the mean score of the other samples of its prompt."""
    scores = sequence_scores(token_rewards)
    mean, _, n = group_mean_std(scores, group)
    loo = (scores - mean) * n / (n - 1).clamp(min=1)
    return _outcome(torch.where(n > 1, loo, scores), mask)


@estimator("opo", grouped=True)
def opo(token_rewards, mask, group, p):
    """OPO: the group baseline is the length-weighted mean score (optimal baseline for sequence rewards)."""
    scores = sequence_scores(token_rewards)
    lengths = mask.sum(dim=-1).to(scores.dtype)
    baseline = group_sum(lengths * scores, group) / group_sum(lengths, group)
    n = group_count(group)
    baseline = torch.where(n > 1, baseline, torch.zeros_like(baseline))
    return _outcome(scores - baseline[group], mask)


@estimator("reinforce_plus_plus", DiscountParams)
def reinforce_plus_plus(token_rewards, mask, group, p: DiscountParams):
    """REINFORCE++: discounted returns whitened over the whole batch."""
    returns = reverse_scan(token_rewards, mask, p.gamma) * mask
    return masked_whiten(returns, mask) * mask, returns


@estimator("reinforce_plus_plus_baseline", grouped=True)
def reinforce_plus_plus_baseline(token_rewards, mask, group, p):
    """REINFORCE++ with a group-mean baseline, then whitened over the batch."""
    scores = sequence_scores(token_rewards)
    mean, _, _ = group_mean_std(scores, group)
    adv = (scores - mean).unsqueeze(-1) * mask
    adv = masked_whiten(adv, mask) * mask
    return adv, adv


@estimator("remax", needs=("reward_baselines",))
def remax(token_rewards, mask, group, p, reward_baselines):
    """ReMax: each sample's score minus the score of its prompt's greedy response."""
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    return returns - reward_baselines.unsqueeze(-1) * mask, returns


@estimator("gpg", GPGParams, grouped=True)
def gpg(token_rewards, mask, group, p: GPGParams):
    """GPG: group-centered scores times the batch size over its count of nonzero scores, over f_norm."""
    scores = sequence_scores(token_rewards)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    mean, _, _ = group_mean_std(scores, group)
    return _outcome(alpha * (scores - mean) / p.f_norm, mask)


@estimator("gdpo", GDPOParams, needs=("reward_components",), grouped=True)
def gdpo(token_rewards, mask, group, p: GDPOParams, reward_components=None):
    """GDPO: each reward component normalized within its group, then weighted and summed."""
    components = sequence_scores(token_rewards).unsqueeze(-1) if reward_components is None else reward_components
    weights = p.reward_weights or [1.0] * components.shape[1]
    total = torch.zeros_like(components[:, 0])
    for k, weight in enumerate(weights):
        mean, std, _ = group_mean_std(components[:, k], group)
        centered = components[:, k] - mean
        total = total + weight * (centered / (std + p.epsilon) if p.norm_adv_by_std_in_grpo else centered)
    adv = masked_whiten(total.unsqueeze(-1) * mask, mask) * mask
    return adv, adv
