"""Rollout correction: importance-sampling weights and rejection masks (verl's ``rollout_corr_helper``).

The rollout engine and the trainer disagree (precision, kernels, staleness), so
the data comes from π_rollout while the loss assumes π_old. With
``log ρ = log π_old − log π_rollout`` per token:

* **IS** (Yao et al., "Your efficient RL framework secretly brings you off-policy RL
  training", https://fengyao.notion.site/off-policy-rl): weights ``ρ`` per token or
  ``exp(Σ log ρ)`` per sequence (``exp`` clamped at ±20), truncated at the upper
  threshold (TIS) or, for a ``"lower_upper"`` threshold, zeroed outside
  ``[lower, upper]`` (IcePop); optionally divided by their batch mean; always detached.
* **RS**: a token (``token_k1/k2/k3``) or a whole sequence (``seq_sum_*``,
  ``seq_mean_*``, ``seq_max_k2/k3``) is masked out when its divergence leaves the
  threshold; options are comma-separated and combined with AND. ``*_k1`` options
  take ``"lower_upper"`` ratio bounds (a single ``u`` means ``1/u_u``) and, like verl,
  test ``-log ρ`` against ``[log lower, log upper]``; the others take one upper bound.

RS only ever removes tokens from ``response_mask``; IS only produces a weight
column that the policy loss multiplies in.

Diagnostics (verl 0.9.1 ``compute_is_metrics`` / ``compute_rs_metrics``), with ``w`` the
applied weights, ``w̃`` the raw ones (before truncation), ``m`` the mask, ``mean_m`` the
masked mean, ``u``/``l`` the bounds (``l = 1/u`` for TIS):

* ``rollout_is_std = sqrt(max(0, mean_m(c²) − mean_m(c)²))`` with ``c = clamp(w, 0, u)``
  (0 with ≤ 1 valid token);
* per row ``s_i = Σ_t w_it m_it / (Σ_t m_it + 1e-8)`` over **all** rows:
  ``rollout_is_seq_{mean,std (unbiased),max,min}``, ``rollout_is_seq_max_deviation = max|s_i − 1|``;
  with ``s̃_i`` the same of ``w̃``: ``rollout_is_seq_fraction_high = mean(s̃_i > u)``,
  ``rollout_is_seq_fraction_low = mean(s̃_i < l)``;
* per RS option with statistic ``x`` (token level: per token; sequence level: the
  sequence's value) and bounds ``(U, L)`` (``*_k1``: ``(log u, log l)``, else ``(u, 0)``):
  ``_fraction_high`` = share of valid tokens (token level) or valid sequences (sequence level)
  with ``x > U``; ``_fraction_low`` likewise ``x < L`` (``*_k1`` only, else 0);
  ``_std = sqrt(max(0, mean_m(c²) − mean_m(c)²))``, ``c = clamp(x, L, U)``; over the valid
  rows' per-sequence values ``v_i`` (sequence statistic, or ``mean_m`` of the token
  statistic): ``_seq_{mean,std,max,min}``, ``_seq_max_deviation = max|v_i|``,
  ``_seq_fraction_high = mean(v_i > U)``, ``_seq_fraction_low = mean(v_i < L)`` (``*_k1`` only).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from rlpipe.errors import ConfigError
from rlpipe.stages.algos.ops import masked_mean, masked_sum

SAFETY_BOUND = 20.0
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """``2.0`` → (2.0, None) = TIS; ``"0.5_5.0"`` → (5.0, 0.5) = IcePop."""
    text = str(spec).strip()
    lower_text, _, upper_text = text.rpartition("_") if "_" in text else ("", "", text)
    try:
        upper, lower = float(upper_text), (float(lower_text) if lower_text else None)
    except ValueError:
        raise ConfigError(
            f"rollout_is_threshold {spec!r} is neither a number nor 'lower_upper' (e.g. 2.0 or '0.5_5.0')"
        ) from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ConfigError(f"rollout_is_threshold {spec!r} needs 0 < lower <= upper")
    return upper, lower


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: Literal["token", "sequence"],
    threshold: str | float, batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """Detached IS weights ``[B, R]`` (0 on padding) and their metrics."""
    upper, lower = parse_is_threshold(threshold)
    log_ratio = log_ratio.detach()
    seq_log_ratio = None
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
    else:
        seq_log_ratio = masked_sum(log_ratio, mask, dim=-1)
        raw = torch.exp(seq_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1).expand_as(log_ratio) * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, mask, upper, lower, seq_log_ratio)
    if batch_normalize:
        weights, metrics["rollout_is_batch_norm_factor"] = _normalize(weights, mask, level)
    return weights, metrics


def _normalize(weights, mask, level) -> tuple[torch.Tensor, float]:
    if level == "token":
        mean = masked_mean(weights, mask)
    else:
        valid = (mask.sum(dim=-1) > 0).to(weights.dtype)
        mean = (masked_mean(weights, mask, dim=-1) * valid).sum() / valid.sum().clamp(min=1e-8)
    return (weights / mean, float(mean)) if mean > 1e-8 else (weights, 1.0)


def _is_metrics(weights, raw, mask, upper, lower, seq_log_ratio=None) -> dict[str, float]:
    """verl's IS metrics; at sequence level max/min and the high/low fractions are per sequence (log space)."""
    low = 1.0 / upper if lower is None else lower
    valid = mask.bool()
    if not valid.any():
        return {}
    clamped = weights.clamp(min=0.0, max=upper)
    normalized = clamped / (masked_mean(clamped, mask) + 1e-8)
    metrics = {"rollout_is_mean": float(masked_mean(weights, mask))}
    if seq_log_ratio is None:
        metrics.update({
            "rollout_is_max": float(weights[valid].max()),
            "rollout_is_min": float(weights[valid].min()),
            "rollout_is_ratio_fraction_high": float(masked_mean((raw > upper).float(), mask)),
            "rollout_is_ratio_fraction_low": float(masked_mean((raw < low).float(), mask)),
        })  # fmt: skip
    else:
        metrics.update({
            "rollout_is_max": math.exp(min(float(seq_log_ratio.max()), SAFETY_BOUND)),
            "rollout_is_min": math.exp(float(seq_log_ratio.min())),
            "rollout_is_ratio_fraction_high": float((seq_log_ratio > math.log(upper)).float().mean()),
            "rollout_is_ratio_fraction_low": float((seq_log_ratio < math.log(low)).float().mean()),
        })  # fmt: skip
    metrics["rollout_is_eff_sample_size"] = float(1.0 / masked_mean(normalized.square(), mask))
    metrics["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    seq, raw_seq = masked_mean(weights, mask, dim=-1), masked_mean(raw, mask, dim=-1)
    metrics.update({
        "rollout_is_seq_mean": float(seq.mean()),
        "rollout_is_seq_std": float(seq.std()) if seq.numel() > 1 else 0.0,
        "rollout_is_seq_max": float(seq.max()),
        "rollout_is_seq_min": float(seq.min()),
        "rollout_is_seq_max_deviation": float((seq - 1.0).abs().max()),
        "rollout_is_seq_fraction_high": float((raw_seq > upper).float().mean()),
        "rollout_is_seq_fraction_low": float((raw_seq < low).float().mean()),
    })  # fmt: skip
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = float(masked_mean(((raw < lower) | (raw > upper)).float(), mask))
    return metrics


def parse_rs(options: str, thresholds: str | float | None) -> list[tuple[str, float | None, float]]:
    """``(option, lower, upper)`` per comma-separated option; one threshold shared or one per option."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    unknown = [o for o in names if o not in RS_OPTIONS]
    if not names or unknown:
        known = ", ".join(sorted(RS_OPTIONS))
        raise ConfigError(f"unknown rollout_rs option(s) {unknown or options!r}; known: {known}")
    if thresholds is None:
        raise ConfigError("rollout_rs needs rollout_rs_threshold (one value, or one per option, comma-separated)")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ConfigError(
            f"rollout_rs_threshold gives {len(specs)} values for {len(names)} rollout_rs options; "
            f"give 1 or {len(names)}"
        )
    return [_rs_bounds(name, spec) for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs)]


def _rs_bounds(option: str, spec: str) -> tuple[str, float | None, float]:
    is_k1 = option.endswith("k1")
    if "_" in spec and not is_k1:
        raise ConfigError(f"rollout_rs_threshold {spec!r} for {option}: only *_k1 options take 'lower_upper'")
    lower_text, _, upper_text = spec.rpartition("_")
    try:
        upper = float(upper_text)
        lower = (float(lower_text) if lower_text else 1.0 / upper) if is_k1 else None
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"rollout_rs_threshold {spec!r} for {option} is not a positive number") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ConfigError(f"rollout_rs_threshold {spec!r} for {option} needs 0 < lower <= upper")
    return option, lower, upper


def _divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}


def _statistic(option: str, div: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Per-token statistic ``[B, R]`` (sequence options broadcast their per-sequence value)."""
    level, kind = option.rsplit("_", 1)
    values = div[kind]
    if level == "token":
        return values
    if level == "seq_sum":
        seq = masked_sum(values, mask, dim=-1)
    elif level == "seq_mean":
        seq = masked_mean(values, mask, dim=-1)
    else:  # seq_max
        seq = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
        seq = torch.where(torch.isinf(seq), torch.zeros_like(seq), seq)
    return seq.unsqueeze(-1).expand_as(values)


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, options: str, thresholds: str | float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``mask`` with rejected tokens set to 0 (never the other way), and the masked fractions."""
    div = _divergences(log_ratio.detach())
    keep_all = torch.ones_like(mask, dtype=torch.bool)
    metrics: dict[str, float] = {}
    for option, lower, upper in parse_rs(options, thresholds):
        stat = _statistic(option, div, mask)
        keep = stat <= upper if lower is None else (stat >= math.log(lower)) & (stat <= math.log(upper))
        keep_all &= keep
        metrics.update(_rs_metrics(f"rollout_rs_{option}", stat, keep, mask))
        bounds = (math.log(upper), math.log(lower)) if lower is not None else (upper, None)
        metrics.update(_rs_diagnostics(f"rollout_rs_{option}", stat, mask, option.startswith("token"), *bounds))
    metrics.update(_rs_metrics("rollout_rs", None, keep_all, mask))
    return mask * keep_all.to(mask.dtype), metrics


def _rs_metrics(prefix: str, stat, keep, mask) -> dict[str, float]:
    """Masked fractions (per option, sequences count over valid ones; overall, over all rows, as verl)."""
    valid = mask.bool()
    seq_hit = (~keep & valid).any(dim=-1).float()
    seq_den = seq_hit.numel() if stat is None else max(int(valid.any(dim=-1).sum()), 1)
    out = {
        f"{prefix}_masked_fraction": float(masked_mean((~keep).float(), mask)),
        f"{prefix}_seq_masked_fraction": float(seq_hit.sum()) / max(seq_den, 1),
    }
    if stat is not None and valid.any():
        out.update({f"{prefix}_mean": float(masked_mean(stat, mask)), f"{prefix}_max": float(stat[valid].max()),
                    f"{prefix}_min": float(stat[valid].min())})  # fmt: skip
    return out


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """``sqrt(max(0, mean_m(c²) − mean_m(c)²))`` of ``c = clamp(values, low, high)``; 0 with ≤ 1 valid token."""
    if mask.sum() <= 1:
        return 0.0
    clamped = values.clamp(min=low, max=high)
    var = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
    return float(var.clamp(min=0.0).sqrt())


def _rs_diagnostics(prefix: str, stat: torch.Tensor, mask: torch.Tensor, token_level: bool,
                    upper: float, lower: float | None) -> dict[str, float]:
    """verl's per-option RS diagnostics (formulas in the module docstring); ``lower`` only for *_k1."""
    valid_rows = mask.sum(dim=-1) > 0
    if not bool(valid_rows.any()):
        return {}
    floor = 0.0 if lower is None else lower
    seq = (masked_mean(stat, mask, dim=-1) if token_level else stat[:, 0])[valid_rows]
    if token_level:
        high, low = masked_mean((stat > upper).float(), mask), masked_mean((stat < floor).float(), mask)
    else:
        high, low = (seq > upper).float().mean(), (seq < floor).float().mean()
    out = {
        f"{prefix}_fraction_high": float(high),
        f"{prefix}_fraction_low": float(low) if lower is not None else 0.0,
        f"{prefix}_std": _clamped_std(stat, mask, floor, upper),
        f"{prefix}_seq_mean": float(seq.mean()),
        f"{prefix}_seq_std": float(seq.std()) if seq.numel() > 1 else 0.0,
        f"{prefix}_seq_max": float(seq.max()),
        f"{prefix}_seq_min": float(seq.min()),
        f"{prefix}_seq_max_deviation": float(seq.abs().max()),
        f"{prefix}_seq_fraction_high": float((seq > upper).float().mean()),
    }
    if lower is not None:
        out[f"{prefix}_seq_fraction_low"] = float((seq < lower).float().mean())
    return out
