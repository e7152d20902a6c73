"""Loss aggregation modes under a global denominator (verl's ``agg_loss``).

A mode turns a per-token loss matrix of ONE micro-batch into that micro-batch's
share of the mini-batch loss. The denominators (valid tokens, valid sequences)
are counted over every micro-batch of the mini-batch on every data-parallel
rank and agreed before the backward pass, so that the shares summed over
micro-batches and ranks (gradients summed by an all-reduce) equal the loss of
the whole mini-batch — independent of how it is split. A local denominator is
exactly the bug that shows up as a grad-norm explosion on a small micro-batch.

Modes (registry kind ``loss_agg_mode``):

* ``token-mean``: Σ masked loss / global tokens.
* ``token-sum``: Σ masked loss.
* ``seq-mean-token-sum``: Σ_seq (Σ_tok loss) / global sequences.
* ``seq-mean-token-mean``: Σ_seq (mean_tok loss) / global sequences.
* ``seq-mean-token-sum-norm``: seq-mean-token-sum / ``loss_scale_factor`` (Dr. GRPO's
  constant; ``None`` falls back to the padded width, as verl does — set a constant
  to keep the loss independent of padding).

Difference from verl: verl multiplies by ``dp_size`` because DDP/FSDP *average*
gradients over ranks; rlpipe's trainer *sums* them, so no factor appears here.
verl's sequence denominator is the mini-batch row count; rlpipe counts only
sequences with at least one valid token (a fully rejected sequence does not
dilute the mean). The two agree whenever no row is fully masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlpipe.registry import registry
from rlpipe.stages.algos.ops import lookup, masked_sum

AggFn = Callable[[torch.Tensor, torch.Tensor, "LossDenominators", "float | None"], torch.Tensor]
AGG_MODES = registry("loss_agg_mode")


@dataclass
class LossDenominators:
    """Counts over ALL micro-batches of one mini-batch on ALL data-parallel ranks."""

    global_tokens: float
    """Σ response_mask over the mini-batch (every micro-batch, every rank)."""
    global_seqs: float
    """Sequences with at least one valid token over the mini-batch (every micro-batch, every rank)."""
    dp_size: int = 1
    """Data-parallel ranks (informational: gradients are summed, not averaged)."""


def local_counts(response_mask: torch.Tensor) -> tuple[float, float]:
    """(valid tokens, valid sequences) of one micro-batch; sum these over micro-batches and ranks."""
    mask = response_mask.float()
    return float(mask.sum()), float((mask.sum(dim=-1) > 0).sum())


def single_batch_denominators(response_mask: torch.Tensor) -> LossDenominators:
    """Denominators when one micro-batch is the whole mini-batch on one rank."""
    tokens, seqs = local_counts(response_mask)
    return LossDenominators(global_tokens=tokens, global_seqs=seqs)


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    den: LossDenominators,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss under aggregation ``mode``."""
    return lookup(AGG_MODES, mode)(loss_mat, mask, den, loss_scale_factor)


def _seq_valid(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(dim=-1) > 0).to(torch.float32)


def _seq_share(seq_losses: torch.Tensor, mask: torch.Tensor, den: LossDenominators) -> torch.Tensor:
    return masked_sum(seq_losses, _seq_valid(mask)) / max(den.global_seqs, 1.0)


@AGG_MODES.register("token-mean")
def token_mean(loss_mat, mask, den, loss_scale_factor=None):
    return masked_sum(loss_mat, mask) / max(den.global_tokens, 1.0)


@AGG_MODES.register("token-sum")
def token_sum(loss_mat, mask, den, loss_scale_factor=None):
    return masked_sum(loss_mat, mask)


@AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat, mask, den, loss_scale_factor=None):
    return _seq_share(masked_sum(loss_mat, mask, dim=-1), mask, den)


@AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat, mask, den, loss_scale_factor=None):
    per_seq = masked_sum(loss_mat, mask, dim=-1) / (mask.sum(dim=-1) + 1e-8)
    return _seq_share(per_seq, mask, den)


@AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_mat, mask, den, loss_scale_factor=None):
    scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return seq_mean_token_sum(loss_mat, mask, den) / scale


@dataclass
class Aggregator:
    """Aggregation bound to one micro-batch: its mask, the global denominators and the configured mode."""

    mask: torch.Tensor
    den: LossDenominators
    mode: str = "token-mean"
    loss_scale_factor: float | None = None

    def __call__(self, loss_mat: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """Share of ``loss_mat`` under ``mode`` (default: the configured mode)."""
        return aggregate(loss_mat, self.mask, mode or self.mode, self.den, self.loss_scale_factor)

    def seq_mean(self, seq_losses: torch.Tensor) -> torch.Tensor:
        """Share of a per-sequence loss vector in the mean over the mini-batch's valid sequences."""
        return _seq_share(seq_losses, self.mask, self.den)
