"""The actor update: PPO-style policy-gradient steps over mini- and micro-batches.

One global batch (this rank's rows) is split into ``prompts_per_step /
ppo_mini_batch_size`` mini-batches — one optimizer step (local update) each,
``ppo_epochs`` times. Every local update uses the same ``old_logprobs`` column
(π_old, computed once before the first update). Before each mini-batch's
backward passes the ranks agree on the global token and sequence counts; every
micro-batch's loss is normalized by them and gradients are summed across ranks,
so the update equals the full-batch gradient (the seed's "grad_norm 1e4" bug is
a wrong denominator). The loss itself (policy loss, aggregation, KL, entropy)
is ``rlpipe.stages.algos.policy_loss.actor_loss``.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pyarrow as pa
import torch

from rlpipe.jagged import SequenceInputs, to_padded
from rlpipe.schemas.batch import (
    ADVANTAGES, IS_WEIGHTS, OLD_LOGPROBS, PROMPT_IDS, REF_LOGPROBS, RESPONSE_IDS, RESPONSE_MASK,
)
from rlpipe.stage import StageResult, cols, stage
from rlpipe.stages.algos.policy_loss import SUMMED_METRICS, ActorLossConfig, LossDenominators, actor_loss
from rlpipe.stages.logprobs import autocast_dtype, eager_logits, keep_in_step, logprobs_from_logits, micro_batches


class PPOUpdateParams(ActorLossConfig):
    """Loss settings of the update (batch sizes live in `trainer:`)."""

    use_is_weights: bool = False
    """Multiply the policy loss by the rollout-correction `is_weights` column (needs a rollout_correction stage)."""


def _reads(params: PPOUpdateParams) -> dict:
    names = [PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, OLD_LOGPROBS, ADVANTAGES]
    if params.use_kl_loss:
        names.append(REF_LOGPROBS)
    if params.use_is_weights:
        names.append(IS_WEIGHTS)
    return cols(*names)


def _rows(batch: pa.Table, rows: np.ndarray) -> pa.Table:
    """``batch.take(rows)``, or ``batch`` itself when ``rows`` is all of it in order (one mini- and one
    micro-batch per step is the common case; the take copied every column for nothing)."""
    if len(rows) == batch.num_rows and (len(rows) == 0 or (rows[0] == 0 and np.all(np.diff(rows) == 1))):
        return batch
    return batch.take(pa.array(rows))


def _padded(batch: pa.Table, name: str | None, width: int, device: torch.device) -> torch.Tensor | None:
    if name is None or name not in batch.column_names:
        return None
    return to_padded(batch.column(name), 0, torch.float32, width).to(device)


@stage("update", "ppo", placement="worker", role="actor", params=PPOUpdateParams, reads=_reads, writes={})
def ppo_update(state, batch: pa.Table, params: PPOUpdateParams, ctx) -> StageResult:
    """Policy-gradient (PPO-style) optimizer steps of the actor over mini- and micro-batches."""
    trainer = state.config.trainer
    prompts = state.config.data.prompts_per_step
    num_minis = prompts // (trainer.ppo_mini_batch_size or prompts)
    temperature = ctx.extras.temperature
    history: dict[str, list[float]] = {}
    for _ in range(trainer.ppo_epochs):
        for mini_rows in np.array_split(np.arange(batch.num_rows), num_minis):
            mini = _rows(batch, mini_rows)
            stats = _local_update(state, mini, params, temperature, trainer.micro_batch_size)
            for key, value in stats.items():
                history.setdefault(key, []).append(value)
    metrics = {f"actor/{k}" if "/" not in k else k: float(np.mean(v)) for k, v in history.items()}
    metrics = state.all_reduce_mean_metrics(metrics)
    for key in SUMMED_METRICS & metrics.keys():  # each rank holds its share of the global loss
        metrics[key] *= state.world_size
    metrics["actor/local_updates"] = float(state.local_updates)
    metrics.pop("actor/skipped", None)
    metrics["actor/nonfinite_alarm"] = float(sum(history.get("skipped", [0.0])) > 0)
    metrics["actor/skipped_updates"] = float(state.skipped_updates)
    # the alarm before trainer.max_zero_grad_updates fails the run: consecutive zero-norm updates with a learning signal
    metrics["actor/zero_grad_streak"] = float(state.zero_grad_streak)
    return StageResult(metrics=metrics)


def _local_update(state, mini: pa.Table, params: PPOUpdateParams, temperature: float, micro_size: int) -> dict:
    """Forward/backward every micro-batch of ``mini`` under global denominators, then one optimizer step."""
    masks = to_padded(mini.column(RESPONSE_MASK), 0, torch.float32)
    signal = (to_padded(mini.column(ADVANTAGES), 0, torch.float32, masks.shape[1]) * masks).abs().sum().item()
    local = torch.tensor([masks.sum().item(), (masks.sum(1) > 0).sum().item(), signal], dtype=torch.float64)
    global_tokens, global_seqs, global_signal = state.all_reduce_sum(local).tolist()
    denominators = LossDenominators(global_tokens=global_tokens, global_seqs=global_seqs, dp_size=state.world_size)
    micros = [_rows(mini, rows) for rows in micro_batches(mini.num_rows, micro_size)]
    keep_in_step(state, len(micros), backward=True)
    jobs = []
    for micro in micros:
        seq = SequenceInputs(micro.column(PROMPT_IDS), micro.column(RESPONSE_IDS), state.pad_token_id).to(state.device)
        jobs.append((seq, partial(_micro_loss, micro=micro, params=params, temperature=temperature,
                                  denominators=denominators, device=state.device)))
    # the trainer may drive the passes itself (megatron: the loss function injected into its pipeline schedule)
    passes = getattr(state, "train_passes", None) or partial(eager_train_passes, state.model,
                                                             compute_dtype=autocast_dtype(state.config))
    sums: dict[str, float] = {}
    loss_finite = True
    for micro, (loss, metrics) in zip(micros, passes(jobs)):
        loss_finite = loss_finite and bool(torch.isfinite(loss))
        share = micro.num_rows / mini.num_rows
        for key, value in metrics.items():
            # loss terms are this micro-batch's share of the mini-batch loss: sum them; the rest are means
            weight = 1.0 if key in SUMMED_METRICS else share
            sums[key] = sums.get(key, 0.0) + weight * float(value)
    sums.update(state.optimizer_step(loss_finite=loss_finite, expect_grad=global_signal > 0))
    return sums


def _micro_loss(seq: SequenceInputs, logits: torch.Tensor, *, micro: pa.Table, params: PPOUpdateParams,
                temperature: float, denominators: LossDenominators, device) -> tuple[torch.Tensor, dict]:
    """One micro-batch's share of the mini-batch loss (normalized by the global denominators) from its logits."""
    logp, entropy = logprobs_from_logits(seq, logits, temperature, with_entropy=params.entropy_coeff != 0)
    width = seq.response_width
    mask = _padded(micro, RESPONSE_MASK, width, device) * seq.response_padding
    return actor_loss(
        params, log_prob=logp, old_log_prob=_padded(micro, OLD_LOGPROBS, width, device),
        advantages=_padded(micro, ADVANTAGES, width, device), response_mask=mask, denominators=denominators,
        ref_log_prob=_padded(micro, REF_LOGPROBS if params.use_kl_loss else None, width, device),
        entropy=entropy,
        rollout_is_weights=_padded(micro, IS_WEIGHTS if params.use_is_weights else None, width, device),
    )


def eager_train_passes(model: torch.nn.Module, jobs, compute_dtype: torch.dtype | None = None,
                       ) -> list[tuple[torch.Tensor, dict]]:
    """Forward and backward of every ``(seq, loss_of_logits)`` job, one after the other; the detached losses
    and metrics. ``compute_dtype``: the forward under autocast (``trainer.mixed_precision``); the loss from its
    logits in float32, the backward outside autocast."""
    out = []
    for seq, loss_of in jobs:
        loss, metrics = loss_of(seq, eager_logits(model, seq, compute_dtype))
        loss.backward()
        out.append((loss.detach(), metrics))
    return out
