"""Off-policy diagnostics between the trainer's π_old and the rollout engine's π_rollout.

verl's ``compute_offpolicy_metrics``: with ``log ρ = log π_old − log π_rollout``
per valid token,

* ``kl`` = mean(−log ρ) (KL(π_rollout‖π_old), direct estimator), ``k3_kl`` = mean(ρ − log ρ − 1);
* ``training_ppl`` / ``rollout_ppl``: batch mean of per-sequence perplexities (and their logs);
* ``log_ppl_diff`` = mean over sequences of (mean log π_rollout − mean log π_old),
  with abs/max/min; ``ppl_ratio`` = mean of exp(log_ppl_diff) per sequence;
* ``chi2_token`` = mean(ρ²) − 1; ``chi2_seq`` = mean over sequences of exp(2 Σ log ρ) − 1
  (exponents clamped at ±20).
"""

from __future__ import annotations

import torch

from rlpipe.stages.algos.ops import masked_mean, masked_sum

SAFETY_BOUND = 20.0


def offpolicy_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The diagnostics above (empty when no token is valid)."""
    if not mask.bool().any():
        return {}
    log_ratio = old_logprobs - rollout_logprobs
    seq_old = masked_mean(old_logprobs, mask, dim=-1)
    seq_rollout = masked_mean(rollout_logprobs, mask, dim=-1)
    log_ppl_diff = seq_rollout - seq_old
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-seq_old).mean()),
        "training_log_ppl": float((-seq_old).mean()),
        "rollout_ppl": float(torch.exp(-seq_rollout).mean()),
        "rollout_log_ppl": float((-seq_rollout).mean()),
        "kl": float(masked_mean(rollout_logprobs - old_logprobs, mask)),
        "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "log_ppl_diff_max": float(log_ppl_diff.max()),
        "log_ppl_diff_min": float(log_ppl_diff.min()),
        "ppl_ratio": float(torch.exp(log_ppl_diff).mean()),
        "chi2_token": float(masked_mean(rho.square(), mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log_ratio).mean() - 1.0),
    }
