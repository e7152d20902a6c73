"""DAPO dynamic sampling: which groups carry a gradient (Yu et al. 2025, https://arxiv.org/abs/2503.14476).

A group (rows sharing a uid) is *informative* when it has at least two valid
trajectories whose rewards are not all equal: with equal rewards every
group-relative advantage is zero, and a single valid trajectory has no
baseline. Infrastructure failures (``status == "failed"``) are not valid: they
take no part in the decision. Uninformative groups are evicted and, in sync
mode, the engine refills ``refill_factor`` (2) × as many groups.

Difference from verl's DAPO recipe: verl keeps groups of size 1 (``std > 0 or
len == 1``); rlpipe evicts them (SPEC R3: one valid trajectory ⇒ no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.stages.algos.ops import group_sum


@dataclass
class GroupVerdict:
    """Per-group classification (index = dense group id)."""

    informative: torch.Tensor
    """Bool ``[G]``: keep the group."""
    single_valid: torch.Tensor
    """Bool ``[G]``: fewer than two valid trajectories."""
    no_variance: torch.Tensor
    """Bool ``[G]``: at least two valid trajectories, all with the same reward."""


def classify_groups(group: torch.Tensor, reward: torch.Tensor, valid: torch.Tensor) -> GroupVerdict:
    """Classify groups from per-row group ids, rewards and validity (vectorized scatter-min/max)."""
    num_groups = int(group.max()) + 1 if group.numel() else 0
    n_valid = group_sum(valid.to(torch.float64), group) if num_groups else torch.zeros(0)
    reward = reward.to(torch.float64)
    inf = torch.full((num_groups,), float("inf"), dtype=torch.float64)
    lo = inf.scatter_reduce(0, group[valid], reward[valid], reduce="amin")
    hi = (-inf).scatter_reduce(0, group[valid], reward[valid], reduce="amax")
    single = n_valid < 2
    flat = ~single & (hi == lo)
    return GroupVerdict(informative=~single & ~flat, single_valid=single, no_variance=flat)
