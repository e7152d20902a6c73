"""The actor's loss for one micro-batch: policy-gradient loss + KL loss − entropy bonus.

This is verl's ``ppo_loss`` (``verl/workers/utils/losses.py``) over
``core_algos``: the policy loss picked by name from the ``policy_loss`` registry
(:mod:`pg_losses`, :mod:`pg_losses_cov`, :mod:`pg_losses_dppo`), aggregated under
the global denominators of :mod:`aggregation`, plus ``kl_loss_coef`` × the KL to
the reference policy (:mod:`kl`) when ``use_kl_loss``, minus ``entropy_coeff`` ×
the aggregated entropy. Every term uses the same aggregation mode and
denominators, so the sum of the returned shares over all micro-batches and all
data-parallel ranks is the mini-batch loss, whatever the split.

Config names and defaults are verl's actor config (``actor_rollout_ref.actor.*``
and ``actor.policy_loss.*`` flattened). One difference: ``clip_ratio_low`` and
``clip_ratio_high`` default to ``None`` (= ``clip_ratio``) where verl's YAML sets
them to 0.2 explicitly; the effective defaults are equal.
Left out: ``use_prefix_grouper``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from rlpipe.errors import ConfigError, RlpipeError
from rlpipe.stage import StageParams
from rlpipe.stages.algos import pg_losses_bypass, pg_losses_cov, pg_losses_dppo  # noqa: F401  (register their losses)
from rlpipe.stages.algos.aggregation import AGG_MODES, Aggregator, LossDenominators, local_counts
from rlpipe.stages.algos.kl import check_kl_name, kl_penalty
from rlpipe.stages.algos.ops import known_name, lookup, masked_mean
from rlpipe.stages.algos.pg_losses import POLICY_LOSSES
from rlpipe.stages.algos.rollout_correction import parse_is_threshold, parse_rs

__all__ = ["ActorLossConfig", "LossDenominators", "SUMMED_METRICS", "actor_loss", "local_counts"]

SUMMED_METRICS = frozenset({"actor/pg_loss", "actor/kl_loss", "actor/entropy_loss"})
"""Metrics that are a micro-batch's *share* of a mini-batch quantity: sum them over
micro-batches and ranks. Every other ``actor/*`` metric is a per-micro-batch mean: average it."""


class BypassModeConfig(StageParams):
    """``bypass_mode`` loss settings (verl's ``actor.policy_loss.rollout_correction``)."""

    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """ppo_clip: PPO clip with ratio π/π_rollout (IS weights only reported); reinforce: −A·log π·w."""
    rollout_is: Literal["token", "sequence"] | None = "sequence"
    """IS weight level of w = π/π_rollout: token or sequence; null = none (reinforce: w = 1)."""
    rollout_is_threshold: str | float = 2.0
    """A number: truncate w at it (TIS). 'lower_upper' (e.g. '0.5_5.0'): zero w outside (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Divide w by its batch mean."""
    rollout_rs: str | None = None
    """Rejection options, comma-separated (AND): token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3."""
    rollout_rs_threshold: str | float | None = None
    """One threshold for all options or one per option (comma-separated); *_k1 take 'lower_upper'."""

    @model_validator(mode="after")
    def _check(self) -> "BypassModeConfig":
        try:
            parse_is_threshold(self.rollout_is_threshold)
            if self.rollout_rs is not None:
                parse_rs(self.rollout_rs, self.rollout_rs_threshold)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self


class ActorLossConfig(StageParams):
    """How the actor's loss is computed (verl's actor config, flattened)."""

    policy_loss: str = "vanilla"
    """Registered policy loss: vanilla, gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, cispo, dppo_tv, dppo_kl,
    dro, bypass_mode."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    (sapo always aggregates seq-mean-token-mean, as in verl; gspo uses this mode, as verl 0.9.1 —
    the GSPO paper's sequence-level mean is seq-mean-token-mean)."""
    clip_ratio: float = Field(0.2, ge=0)
    """PPO clip ε (dppo_*: the divergence threshold)."""
    clip_ratio_low: float | None = Field(None, ge=0)
    """Lower clip ε (ratio ≥ 1-ε); None = clip_ratio."""
    clip_ratio_high: float | None = Field(None, ge=0)
    """Upper clip ε (ratio ≤ 1+ε, DAPO's clip-higher); None = clip_ratio."""
    clip_ratio_c: float = Field(3.0, gt=1.0)
    """Dual-clip bound on the loss of negative-advantage tokens (dppo_*: truncation of the IS ratio); must be > 1."""
    clip_cov_ratio: float = Field(0.0002, gt=0)
    """clip_cov: fraction of tokens whose gradient is dropped."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance window."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance window."""
    kl_cov_ratio: float = Field(0.0002, gt=0)
    """kl_cov: fraction of tokens (top covariance) that get the KL penalty."""
    ppo_kl_coef: float = Field(0.1, ge=0)
    """kl_cov: coefficient of |log ratio| on the selected tokens."""
    tau_pos: float = Field(1.0, gt=0)
    """sapo: gate temperature for positive advantages."""
    tau_neg: float = Field(1.05, gt=0)
    """sapo: gate temperature for non-positive advantages."""
    dro_beta: float | None = Field(None, gt=0)
    """dro: coefficient β of the quadratic log-ratio penalty ½·β·(log π − log π_old)²; required by dro."""
    bypass: BypassModeConfig = Field(default_factory=BypassModeConfig)
    """bypass_mode: in-loss IS/RS against the rollout policy and the loss type (use with old_log_prob: bypass)."""
    use_kl_loss: bool = False
    """Add kl_loss_coef × KL(π‖π_ref) to the loss (needs ref_logprobs from a `ref` stage)."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """Coefficient of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: kl/k1, abs, mse/k2, low_var_kl/k3, full; a '+' suffix takes k2's gradient."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (the aggregated entropy is subtracted from the loss)."""
    loss_scale_factor: float | None = Field(None, gt=0)
    """seq-mean-token-sum-norm divisor (Dr. GRPO: the max response length); None = padded width of the micro-batch."""

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        return known_name(POLICY_LOSSES, name)

    @field_validator("loss_agg_mode")
    @classmethod
    def _known_agg(cls, name: str) -> str:
        return known_name(AGG_MODES, name)

    @field_validator("kl_loss_type")
    @classmethod
    def _known_kl(cls, name: str) -> str:
        try:
            return check_kl_name(name)
        except RlpipeError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _dro_needs_beta(self) -> "ActorLossConfig":
        if self.policy_loss == "dro" and self.dro_beta is None:
            raise ValueError("policy_loss 'dro' needs dro_beta (the quadratic penalty coefficient, e.g. dro_beta: 0.1)")
        return self

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def actor_loss(
    cfg: ActorLossConfig,
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    denominators: LossDenominators,
    ref_log_prob: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    vocab_log_probs: torch.Tensor | None = None,
    ref_vocab_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the actor loss, and its metrics.

    Tensors are padded ``[B, R]`` for ONE micro-batch (``vocab_log_probs`` /
    ``ref_vocab_log_probs``: ``[B, R, V]``, only for ``kl_loss_type='full'``).
    Summing the returned loss over all micro-batches and all data-parallel ranks
    (gradients summed by all-reduce) gives the mini-batch loss. Metrics in
    :data:`SUMMED_METRICS` are shares (sum them); the others are micro-batch means.
    """
    mask = response_mask.to(log_prob.dtype)
    agg = Aggregator(mask, denominators, cfg.loss_agg_mode, cfg.loss_scale_factor)
    weights = None if rollout_is_weights is None else rollout_is_weights.detach()
    pg_loss, metrics = lookup(POLICY_LOSSES, cfg.policy_loss)(
        log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages,
        mask=mask, cfg=cfg, agg=agg, is_weights=weights,
    )  # fmt: skip
    metrics = {**metrics, "actor/pg_loss": pg_loss.detach().item()}
    loss = pg_loss
    if entropy is not None:
        entropy_loss = agg(entropy)
        loss = loss - cfg.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = entropy_loss.detach().item()
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask).detach().item()
    if cfg.use_kl_loss:
        kl_loss = agg(_kl_matrix(cfg, log_prob, ref_log_prob, vocab_log_probs, ref_vocab_log_probs))
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach().item()
        metrics["actor/kl_coef"] = cfg.kl_loss_coef
    return loss, metrics


def _kl_matrix(cfg, log_prob, ref_log_prob, vocab_log_probs, ref_vocab_log_probs) -> torch.Tensor:
    if cfg.kl_loss_type == "full":
        if vocab_log_probs is None or ref_vocab_log_probs is None:
            raise RlpipeError(
                "kl_loss_type 'full' needs the full-vocabulary log-probs of the policy and the reference "
                "(vocab_log_probs, ref_vocab_log_probs); pick k1/k2/k3 for sampled-token estimates"
            )
        return kl_penalty(vocab_log_probs, ref_vocab_log_probs, "full")
    if ref_log_prob is None:
        raise RlpipeError(
            "use_kl_loss is on but no ref_logprobs were given: add a `ref` stage to the pipeline "
            "or set use_kl_loss: false"
        )
    return kl_penalty(log_prob, ref_log_prob, cfg.kl_loss_type)
