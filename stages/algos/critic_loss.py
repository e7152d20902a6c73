"""The critic's clipped value loss and explained variance (PPO, Schulman et al. 2017).

verl's ``compute_value_loss``: ``½ · agg(max((V − R)², (clip(V, V_old ± ε) − R)²))``
with ``ε = cliprange_value`` around the values recorded at rollout time, aggregated
like the actor's loss under the global denominators (so the critic's gradient is
also independent of micro-batching and data parallelism).
``explained_variance`` is verl's ``critic/vf_explained_var``:
``1 − Var(R − V) / (Var(R) + 1e-5)`` over valid tokens (unbiased variances).
"""

from __future__ import annotations

import torch

from rlpipe.stages.algos.aggregation import Aggregator
from rlpipe.stages.algos.ops import masked_mean


def value_loss(
    vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, cliprange_value: float, agg: Aggregator
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the value loss, and its clip fraction / mean prediction."""
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss1 = (vpreds - returns).square()
    loss2 = (clipped - returns).square()
    loss = 0.5 * agg(torch.maximum(loss1, loss2))
    return loss, {
        "critic/vf_loss": float(loss.detach()),
        "critic/vf_clipfrac": float(masked_mean(torch.gt(loss2, loss1).float(), agg.mask)),
        "critic/vpred_mean": float(masked_mean(vpreds.detach(), agg.mask)),
    }


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 − Var(R − V) / (Var(R) + 1e-5)`` over the valid tokens (NaN when there are none)."""
    valid = mask.bool()
    if not valid.any():
        return float("nan")
    r, v = returns[valid], values[valid]
    return float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))
