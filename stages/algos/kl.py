"""KL estimators between the policy and the reference policy, and the KL coefficient controllers.

Estimators (registry kind ``kl_penalty``; J. Schulman, "Approximating KL
divergence", 2020, http://joschu.net/blog/kl-approx.html), on the sampled token,
with ``log r = logπ - logπ_ref``:

* ``kl`` / ``k1``: ``log r`` (unbiased value, wrong-in-expectation gradient);
* ``abs``: ``|log r|``;
* ``mse`` / ``k2``: ``½ (log r)²`` (its gradient is the unbiased KL gradient);
* ``low_var_kl`` / ``k3``: ``exp(-log r) + log r - 1``, with verl's clamps (±20 inside, ±10 outside);
* ``full``: the exact ``Σ_v π(v)(log π(v) - log π_ref(v))`` from full-vocabulary
  log-probabilities ``[..., V]`` (verl names it but raises NotImplementedError).

A ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+`` …) keeps the estimator's value
but takes k2's gradient (straight-through), as verl does. ``full+`` does not exist.

Controllers (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593): ``fixed``
keeps ``kl_coef``; ``adaptive`` multiplies it by ``1 + clip(kl/target - 1, ±0.2)·n/horizon``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from rlpipe.errors import RlpipeError
from rlpipe.registry import registry
from rlpipe.stage import StageParams
from rlpipe.stages.algos.ops import lookup

KL_ESTIMATORS = registry("kl_penalty")


def _register(*names: str):
    def decorate(fn):
        for name in names:
            KL_ESTIMATORS.add(name, fn)
        return fn

    return decorate


@_register("kl", "k1")
def k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


@_register("abs")
def k1_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


@_register("mse", "k2")
def k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@_register("low_var_kl", "k3")
def k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(log_ratio.exp() - log_ratio - 1, min=-10, max=10)


@_register("full")
def full(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """Exact KL(π‖π_ref) per position from log-distributions of shape ``[..., V]``."""
    if logprob.dim() < 3 or logprob.shape != ref_logprob.shape:
        raise RlpipeError(
            "KL type 'full' needs full-vocabulary log-probabilities [B, R, V] of the policy and the "
            f"reference, got shapes {tuple(logprob.shape)} and {tuple(ref_logprob.shape)}; pass them as "
            "vocab_log_probs / ref_vocab_log_probs, or pick a sampled-token estimator (k1, k2, k3)"
        )
    return (logprob.exp() * (logprob - ref_logprob)).sum(dim=-1)


def split_name(name: str) -> tuple[str, bool]:
    """``("k3", True)`` for ``"k3+"``."""
    return (name[:-1], True) if name.endswith("+") else (name, False)


def check_kl_name(name: str) -> str:
    """Validate a KL type name (``+`` variants included); unknown names raise listing the known ones."""
    base, plus = split_name(name)
    lookup(KL_ESTIMATORS, base)
    if plus and base == "full":
        raise RlpipeError("KL type 'full+' does not exist: 'full' is exact already; use 'full'")
    return name


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    """Per-position KL estimate ``name`` (``+``: value of ``name``, gradient of k2)."""
    base, plus = split_name(check_kl_name(name))
    forward = lookup(KL_ESTIMATORS, base)(logprob, ref_logprob)
    if not plus:
        return forward
    backward = k2(logprob, ref_logprob)
    return backward - backward.detach() + forward.detach()


class KLControlConfig(StageParams):
    """How the KL-in-reward coefficient evolves (verl ``algorithm.kl_ctrl``)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: constant kl_coef; adaptive: steer the measured KL toward target_kl."""
    kl_coef: float = Field(0.001, ge=0)
    """Initial (fixed: constant) coefficient of the KL penalty."""
    horizon: int = Field(10000, gt=0)
    """Adaptive: samples over which the coefficient moves by the clipped proportional error."""
    target_kl: float = Field(0.1, gt=0)
    """Adaptive: the KL the controller aims for."""


def next_kl_coef(cfg: KLControlConfig, value: float, current_kl: float, n_steps: int) -> float:
    """The coefficient after observing ``current_kl`` on ``n_steps`` samples."""
    if cfg.type == "fixed":
        return value
    error = float(np.clip(current_kl / cfg.target_kl - 1, -0.2, 0.2))
    return value * (1 + error * n_steps / cfg.horizon)


def kl_in_reward(
    token_rewards: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
    mask: torch.Tensor, name: str, coef: float,
) -> tuple[torch.Tensor, float]:  # fmt: skip
    """verl's ``apply_kl_penalty``: rewards − coef·KL per token, and the batch KL (mean of per-sequence means)."""
    kld = kl_penalty(old_logprobs, ref_logprobs, name) * mask
    per_seq = kld.sum(dim=-1) / (mask.sum(dim=-1) + 1e-8)
    return token_rewards - coef * kld, float(per_seq.mean()) if per_seq.numel() else 0.0
