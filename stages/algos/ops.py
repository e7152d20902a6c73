"""Masked and grouped tensor primitives shared by the RL math modules.

Masked reductions follow verl's ``verl.utils.torch_functional`` semantics (the
``+1e-8`` in masked means, the Bessel-corrected variance of ``masked_whiten``),
so values match number for number. Group reductions work on integer group ids
(``group_ids(uid)``) with scatter-adds: no Python loop over rows or groups.
"""

from __future__ import annotations

import numpy as np
import torch

from rlpipe.errors import RlpipeError


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero (NaNs outside the mask are ignored)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``masked_sum / (count + 1e-8)`` — zero, not NaN, when nothing is masked in."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance over the masked-in elements (needs at least two of them)."""
    count = mask.sum()
    if count < 2:
        raise RlpipeError(
            f"whitening needs at least 2 valid tokens in the batch, got {int(count)}; use a larger batch"
        )
    centered = values - masked_mean(values, mask)
    return masked_mean(centered.square(), mask) * count / (count - 1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with batch statistics over the masked-in elements."""
    mean = masked_mean(values, mask)
    return (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)


def group_ids(uid: np.ndarray | list) -> torch.Tensor:
    """Dense int64 group ids (0..G-1) of rows sharing a uid."""
    _, inverse = np.unique(np.asarray(uid, dtype=object).astype(str), return_inverse=True)
    return torch.from_numpy(inverse.reshape(-1).astype(np.int64))


def group_count(group: torch.Tensor, num_groups: int | None = None) -> torch.Tensor:
    """Rows per group, ``[G]``."""
    return torch.bincount(group, minlength=num_groups or 0)


def group_sum(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per-group sum of a per-row vector, ``[G]``."""
    num_groups = int(group.max()) + 1 if group.numel() else 0
    return torch.zeros(num_groups, dtype=x.dtype).index_add_(0, group, x)


def group_mean_std(x: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (mean, unbiased std, count) of the row's group.

    Matches verl: a singleton group has mean 0 and std 1.
    """
    count = group_count(group).to(x.dtype)
    mean = group_sum(x, group) / count
    centered = x - mean[group]
    var = group_sum(centered.square(), group) / (count - 1).clamp(min=1)
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(var), var.sqrt())
    return mean[group], std[group], count[group]


def sequence_scores(token_rewards: torch.Tensor) -> torch.Tensor:
    """Outcome score of each row: the sum of its token rewards."""
    return token_rewards.sum(dim=-1)


def lookup(reg, name: str):
    """``reg.get(name)``, resolving already-registered names without loading every plugin first.

    The RL math resolves names on the hot path (every micro-batch) and in worker
    processes; only a miss goes through ``Registry.get``, which loads the plugins
    and raises listing the known names.
    """
    found = reg._items.get(name)  # noqa: SLF001 - read-only fast path
    return found if found is not None else reg.get(name)


def known_name(reg, name: str) -> str:
    """For pydantic validators: ``name`` if ``reg`` knows it, else a ValueError listing the known names."""
    try:
        lookup(reg, name)
    except RlpipeError as exc:  # a ValueError lets pydantic name the field
        raise ValueError(str(exc)) from None
    return name
