"""Log-probability stages: π_old recomputation, bypass, and the reference policy.

``old_log_prob/trainer`` recomputes the response tokens' logprobs with the
training engine, forward only (verl's ``compute_log_prob``), so the PPO ratio's
denominator is the trainer's own numerics. ``old_log_prob/bypass`` takes the
rollout engine's logprobs instead — valid only when rollout and trainer run the
same model precision. ``ref/reference`` scores with the frozen reference model
for the KL term. With ``sum_pi_squared: true`` the trainer impl also writes
``sum_pi_squared`` = Σ_v π_old(v)² per response token (the softmax of the temperature-scaled
logits, squared and summed over the vocabulary; verl's ``calculate_sum_pi_squared``), which the
``optimal_token_baseline`` estimators read. Sampling temperature comes from the generate node (one source
of truth), handed over in ``ctx.extras.temperature``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from rlpipe.backends.lean_forward import LeanForward, lean_forward_for
from rlpipe.jagged import SequenceInputs, entropy_from_logits, from_padded
from rlpipe.schemas.batch import (
    OLD_LOGPROBS, PROMPT_IDS, REF_LOGPROBS, RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOGPROBS, SUM_PI_SQUARED,
)
from rlpipe.stage import StageParams, StageResult, cols, stage
from rlpipe.stages.algos.batch_io import require_rollout_logprobs


class LogProbParams(StageParams):
    """Forward-only scoring."""

    micro_batch_size: int | None = Field(None, ge=1)
    """Rows per forward pass; None = the trainer's micro_batch_size."""


class OldLogProbParams(LogProbParams):
    """Forward-only scoring with the trainer's weights (π_old)."""

    sum_pi_squared: bool = False
    """Also write `sum_pi_squared` (Σ_v π(v)² per response token), needed by the optimal_token_baseline estimators."""


def model_logprobs(model: torch.nn.Module, batch: pa.Table, pad_token_id: int, temperature: float,
                   with_entropy: bool = False, with_sum_pi_squared: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor | None, SequenceInputs]:
    """``[B, R]`` response-token logprobs of ``batch`` under ``model``, and their entropies (``with_entropy``)
    or Σ_v π(v)² (``with_sum_pi_squared``) in the second slot."""
    seq = SequenceInputs(batch.column(PROMPT_IDS), batch.column(RESPONSE_IDS), pad_token_id)
    seq.to(next(model.parameters()).device)
    logp, second = logprobs_from_logits(seq, eager_logits(model, seq), temperature, with_entropy, with_sum_pi_squared)
    return logp, second, seq


def autocast_dtype(config) -> torch.dtype | None:
    """The dtype the trainer's forward passes compute in under autocast (``trainer.mixed_precision``), or None."""
    return torch.bfloat16 if config.trainer.mixed_precision == "bf16" else None


def eager_logits(model: torch.nn.Module, seq: SequenceInputs, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, R, V]``: ``model``'s logits at the positions that predict ``seq``'s response tokens (the prompt's
    other positions never reach the LM head: with a real vocabulary they are most of its memory).

    Rows that share a prompt (GRPO's n samples; :meth:`SequenceInputs.prompt_groups`) run it once: one forward
    over the distinct prompts fills a KV cache, which is repeated per row (an index, differentiable: the
    gradients of a prompt's rows add up in it), then one forward over the responses attends to it. Same
    numbers as the plain forward up to float rounding, with P·(B - U) fewer tokens through the model (16
    prompts × 8 samples, 9 prompt + 8 response tokens: 47% fewer tokens; benchmarks/vs_trl.py's inline update
    node 84 → 49 ms on CPU).
    Not for FSDP-sharded models: their ranks must run equally many forward calls (each all-gathers every
    layer) and whether rows share prompts differs between ranks. ``compute_dtype``: run the forward under
    ``torch.autocast`` in that dtype (``trainer.mixed_precision``); the parameters keep theirs."""
    if compute_dtype is not None:
        with torch.autocast(device_type=next(model.parameters()).device.type, dtype=compute_dtype):
            return eager_logits(model, seq)
    groups = None if seq.response_width == 0 or _sharded(model) else seq.prompt_groups()
    lean = lean_forward_for(model)
    if lean is not None:
        return _lean_logits(lean, seq, groups)
    if groups is None:
        return _plain_logits(model, seq)
    from transformers import DynamicCache  # lazy: transformers costs seconds to import, stage modules load at plan time

    prompt_ids, prompt_mask, prompt_positions, row_to_prompt = groups
    width = seq.prompt_width
    cache = DynamicCache(config=model.config)
    last = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_positions, cache=cache,
                 use_cache=True, logits_to_keep=1).logits
    if cache.get_seq_length() != width:  # a model that kept no cache (HF turns it off under gradient checkpointing)
        return _plain_logits(model, seq)
    cache.batch_select_indices(row_to_prompt)
    rest = model(input_ids=seq.input_ids[:, width:], attention_mask=seq.attention_mask,
                 position_ids=seq.position_ids[:, width:], cache=cache, use_cache=True).logits
    return torch.cat([last[row_to_prompt], rest[:, :-1]], dim=1)


def _lean_logits(lean: LeanForward, seq: SequenceInputs, groups) -> torch.Tensor:
    """:func:`eager_logits` through the lean forward of the Qwen2 / Llama family (rlpipe.backends.lean_forward):
    the same function without transformers' per-call mask and cache objects (the update's forward and backward
    ~25% faster on CPU at the benchmark's size). Logits at padding positions differ from transformers' (a padding
    query attends to itself); no loss reads them."""
    width = seq.prompt_width
    key_mask = seq.attention_mask.bool()
    if groups is None:
        return lean(seq.input_ids, seq.position_ids, key_mask, logits_at=slice(width - 1, width - 1 + seq.response_width))
    prompt_ids, prompt_mask, prompt_positions, row_to_prompt = groups
    cache = lean.growing_cache()
    last = lean(prompt_ids, prompt_positions, prompt_mask.bool(), cache, logits_at=slice(-1, None))
    cache.batch_select_indices(row_to_prompt)
    rest = lean(seq.input_ids[:, width:], seq.position_ids[:, width:], key_mask, cache,
                logits_at=slice(0, seq.response_width - 1))
    return torch.cat([last[row_to_prompt], rest], dim=1)


def _plain_logits(model: torch.nn.Module, seq: SequenceInputs) -> torch.Tensor:
    return model(input_ids=seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids,
                 logits_to_keep=seq.response_width + 1).logits[:, :-1]


def _sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def logprobs_from_logits(seq: SequenceInputs, logits: torch.Tensor, temperature: float, with_entropy: bool = False,
                         with_sum_pi_squared: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The response tokens' logprobs (and entropies or Σ_v π(v)²) from logits laid out as ``seq``."""
    logp = seq.response_logprobs(logits, temperature)
    second = None
    if with_entropy or with_sum_pi_squared:
        scaled = seq.response_positions(logits) / temperature
        per_token = entropy_from_logits(scaled) if with_entropy else torch.softmax(scaled.float(), -1).square().sum(-1)
        second = per_token * seq.response_padding
    return logp, second


def micro_batches(num_rows: int, size: int) -> list[np.ndarray]:
    """Contiguous row-index chunks of at most ``size`` rows."""
    return [np.arange(s, min(s + size, num_rows)) for s in range(0, num_rows, size)]


def keep_in_step(state, count: int, backward: bool) -> None:
    """Before this rank's ``count`` micro-batch passes: run the idle passes a sharded trainer needs so every
    rank runs as many passes as the busiest (FSDP2 all-gathers each layer in every pass). A no-op for
    states without ``lockstep_passes`` (reference, test states) and for unsharded backends."""
    if hasattr(state, "lockstep_passes"):
        for _ in range(state.lockstep_passes(count) - count):
            state.idle_pass(backward=backward)


@torch.no_grad()
def score_batch(model: torch.nn.Module, batch: pa.Table, pad_token_id: int, temperature: float,
                micro_batch_size: int, with_sum_pi_squared: bool = False, forward_passes=None,
                compute_dtype: torch.dtype | None = None):
    """Logprobs of every response token of ``batch`` as a jagged float32 column
    (with ``with_sum_pi_squared``: a pair, logprobs and Σ_v π(v)²).

    ``forward_passes(seqs, consume)`` runs the forward-only passes when the trainer drives them itself (the
    megatron backend: its pipeline schedule with ``forward_only=True``); it returns ``[consume(seq, logits)]``
    in order. None: one eager forward per micro-batch."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    subs = [batch.take(pa.array(rows)) for rows in micro_batches(batch.num_rows, micro_batch_size)]
    seqs = [SequenceInputs(sub.column(PROMPT_IDS), sub.column(RESPONSE_IDS), pad_token_id).to(device) for sub in subs]

    def consume(seq: SequenceInputs, logits: torch.Tensor):
        return logprobs_from_logits(seq, logits, temperature, with_sum_pi_squared=with_sum_pi_squared)

    if forward_passes is None:
        results = [consume(seq, eager_logits(model, seq, compute_dtype)) for seq in seqs]
    else:
        results = forward_passes(seqs, consume)
    model.train(was_training)
    chunks = [from_padded(logp, seq.response_lengths, pa.float32()) for seq, (logp, _) in zip(seqs, results)]
    squares = [from_padded(sq, seq.response_lengths, pa.float32()) for seq, (_, sq) in zip(seqs, results)
               if with_sum_pi_squared]
    empty = pa.array([], type=pa.list_(pa.float32()))
    logps = pa.concat_arrays(chunks) if chunks else empty
    return (logps, pa.concat_arrays(squares) if squares else empty) if with_sum_pi_squared else logps


def _old_writes(params: OldLogProbParams) -> dict[str, pa.DataType]:
    return cols(OLD_LOGPROBS, *([SUM_PI_SQUARED] if params.sum_pi_squared else []))


@stage("old_log_prob", "trainer", placement="worker", role="actor", params=OldLogProbParams,
       reads=cols(PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK), writes=_old_writes)
def recompute_old_logprobs(state, batch: pa.Table, params: OldLogProbParams, ctx) -> StageResult:
    """π_old: the response tokens' logprobs under the trainer's current weights (forward only, verl's compute_log_prob)."""
    if not params.sum_pi_squared:
        return StageResult(columns={OLD_LOGPROBS: _score_on(state, batch, params, ctx)})
    logps, squares = _score_on(state, batch, params, ctx, with_sum_pi_squared=True)
    return StageResult(columns={OLD_LOGPROBS: logps, SUM_PI_SQUARED: squares})


def _score_on(state, batch: pa.Table, params: LogProbParams, ctx, with_sum_pi_squared: bool = False):
    """``score_batch`` with the worker's model, the params' (or trainer's) micro-batch, the run's temperature."""
    micro = params.micro_batch_size or state.config.trainer.micro_batch_size
    keep_in_step(state, len(micro_batches(batch.num_rows, micro)), backward=False)
    return score_batch(state.model, batch, state.pad_token_id, ctx.extras.temperature, micro,
                       with_sum_pi_squared, getattr(state, "forward_passes", None), autocast_dtype(state.config))


@stage("old_log_prob", "bypass", placement="task", reads=cols(ROLLOUT_LOGPROBS), writes=cols(OLD_LOGPROBS))
def bypass_old_logprobs(batch: pa.Table, params, ctx) -> StageResult:
    """π_old = the rollout's own logprobs (skips a forward pass; same precision required)."""
    require_rollout_logprobs(batch)
    return StageResult(columns={OLD_LOGPROBS: batch.column(ROLLOUT_LOGPROBS).combine_chunks()})


@stage("ref", "reference", placement="worker", role="ref", params=LogProbParams,
       reads=cols(PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK), writes=cols(REF_LOGPROBS))
def reference_logprobs(state, batch: pa.Table, params: LogProbParams, ctx) -> StageResult:
    """The response tokens' logprobs under the frozen reference policy (for KL losses and penalties)."""
    return StageResult(columns={REF_LOGPROBS: _score_on(state, batch, params, ctx)})
