"""Log-probability stages: π_old recomputation, bypass, and the reference policy.

``old_log_prob/trainer`` recomputes the response tokens' logprobs with the
training engine, forward only (verl's ``compute_log_prob``), so the PPO ratio's
denominator is the trainer's own numerics. ``old_log_prob/bypass`` takes the
rollout engine's logprobs instead — valid only when rollout and trainer run the
same model precision. ``ref/reference`` scores with the frozen reference model
for the KL term. Sampling temperature comes from the generate node (one source
of truth), handed over in ``ctx.extras["temperature"]``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from rlpipe.jagged import SequenceInputs, entropy_from_logits, from_padded
from rlpipe.schemas.batch import OLD_LOGPROBS, PROMPT_IDS, REF_LOGPROBS, RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOGPROBS
from rlpipe.stage import StageParams, StageResult, cols, stage
from rlpipe.stages.algos.batch_io import require_rollout_logprobs


class LogProbParams(StageParams):
    """Forward-only scoring."""

    micro_batch_size: int | None = Field(None, ge=1)
    """Rows per forward pass; None = the trainer's micro_batch_size."""


def model_logprobs(model: torch.nn.Module, batch: pa.Table, pad_token_id: int, temperature: float,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, SequenceInputs]:
    """``[B, R]`` response-token logprobs (and entropies) of ``batch`` under ``model``."""
    seq = SequenceInputs(batch.column(PROMPT_IDS), batch.column(RESPONSE_IDS), pad_token_id)
    seq.to(next(model.parameters()).device)
    logits = model(input_ids=seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids).logits
    logp = seq.response_logprobs(logits, temperature)
    entropy = None
    if with_entropy:
        start = seq.prompt_width - 1
        scaled = logits[:, start : start + seq.response_width] / temperature
        entropy = entropy_from_logits(scaled) * seq.response_padding
    return logp, entropy, seq


def micro_batches(num_rows: int, size: int) -> list[np.ndarray]:
    """Contiguous row-index chunks of at most ``size`` rows."""
    return [np.arange(s, min(s + size, num_rows)) for s in range(0, num_rows, size)]


@torch.no_grad()
def score_batch(model: torch.nn.Module, batch: pa.Table, pad_token_id: int, temperature: float,
                micro_batch_size: int) -> pa.ListArray:
    """Logprobs of every response token of ``batch`` as a jagged float32 column."""
    was_training = model.training
    model.eval()
    chunks = []
    for rows in micro_batches(batch.num_rows, micro_batch_size):
        sub = batch.take(pa.array(rows))
        logp, _, seq = model_logprobs(model, sub, pad_token_id, temperature)
        chunks.append(from_padded(logp, seq.response_lengths, pa.float32()))
    model.train(was_training)
    return pa.concat_arrays(chunks) if chunks else pa.array([], type=pa.list_(pa.float32()))


@stage("old_log_prob", "trainer", placement="worker", role="actor", params=LogProbParams,
       reads=cols(PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK), writes=cols(OLD_LOGPROBS))
def recompute_old_logprobs(state, batch: pa.Table, params: LogProbParams, ctx) -> StageResult:
    return StageResult(columns={OLD_LOGPROBS: _score_on(state, batch, params, ctx)})


def _score_on(state, batch: pa.Table, params: LogProbParams, ctx) -> pa.ListArray:
    """``score_batch`` with the worker's model, the params' (or trainer's) micro-batch, the run's temperature."""
    micro = params.micro_batch_size or state.config.trainer.micro_batch_size
    return score_batch(state.model, batch, state.pad_token_id, ctx.extras.get("temperature", 1.0), micro)


@stage("old_log_prob", "bypass", reads=cols(ROLLOUT_LOGPROBS), writes=cols(OLD_LOGPROBS))
def bypass_old_logprobs(batch: pa.Table, params, ctx) -> StageResult:
    """π_old = the rollout's own logprobs (skips a forward pass; same precision required)."""
    require_rollout_logprobs(batch)
    return StageResult(columns={OLD_LOGPROBS: batch.column(ROLLOUT_LOGPROBS).combine_chunks()})


@stage("ref", "reference", placement="worker", role="ref", params=LogProbParams,
       reads=cols(PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK), writes=cols(REF_LOGPROBS))
def reference_logprobs(state, batch: pa.Table, params: LogProbParams, ctx) -> StageResult:
    return StageResult(columns={REF_LOGPROBS: _score_on(state, batch, params, ctx)})
