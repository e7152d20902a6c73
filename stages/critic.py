"""The critic for PPO with GAE: ``critic_values/critic`` and ``critic_update/ppo``.

The critic is a causal-LM backbone with a scalar value head (:class:`CriticModel`,
verl's ``AutoModelForTokenClassification(num_labels=1)``). The value of response
token ``j`` is read at the position whose hidden state predicts it (``P − 1 + j``),
like the logprobs. Both stages run on the ``critic`` worker role: a
data-parallel trainer state with ``.model`` (a :class:`CriticModel`),
``.optimizer_step()``, ``.all_reduce_sum()``, ``.all_reduce_mean_metrics()``,
``.pad_token_id`` and ``.config`` (see ``rlpipe.engine.state.train_state.TrainState``).

``critic_update`` mirrors the actor's update: mini-batches × ``ppo_epochs``, each a
local update whose micro-batch losses (:func:`~rlpipe.stages.algos.critic_loss.value_loss`)
are normalized by token / sequence counts agreed across ranks first.
The value head starts at zero (values 0), deterministically. Left out: verl's
separate critic batch sizes / epochs (the trainer's are used) and critic warmup.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, field_validator

from rlpipe.jagged import SequenceInputs, from_padded, to_padded
from rlpipe.schemas.batch import PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, RETURNS, VALUES
from rlpipe.stage import StageParams, StageResult, cols, stage
from rlpipe.stages.algos.aggregation import AGG_MODES, Aggregator, LossDenominators
from rlpipe.stages.algos.critic_loss import value_loss
from rlpipe.stages.algos.ops import known_name
from rlpipe.stages.logprobs import keep_in_step, micro_batches


class CriticModel(torch.nn.Module):
    """Backbone of a causal LM + a zero-initialized linear value head."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.backbone = lm.base_model
        hidden = lm.config.hidden_size
        self.value_head = torch.nn.Linear(hidden, 1, dtype=next(lm.parameters()).dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.value_head(hidden.last_hidden_state).squeeze(-1).float()


def response_values(model: CriticModel, batch: pa.Table, pad_token_id: int) -> tuple[torch.Tensor, SequenceInputs]:
    """``[B, R]`` values of the response tokens of ``batch`` (padding → 0)."""
    seq = SequenceInputs(batch.column(PROMPT_IDS), batch.column(RESPONSE_IDS), pad_token_id)
    values = model(seq.input_ids, seq.attention_mask, seq.position_ids)
    start = seq.prompt_width - 1
    return values[:, start : start + seq.response_width] * seq.response_padding, seq


class CriticValuesParams(StageParams):
    """Forward-only value scoring."""

    micro_batch_size: int | None = Field(None, ge=1)
    """Rows per forward pass; None = the trainer's micro_batch_size."""


@stage("critic_values", "critic", placement="worker", role="critic", params=CriticValuesParams,
       reads=cols(PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK), writes=cols(VALUES))  # fmt: skip
def critic_values(state, batch: pa.Table, params: CriticValuesParams, ctx) -> StageResult:
    """The critic's value of every response token (forward only, on the critic workers): writes ``values``."""
    size = params.micro_batch_size or state.config.trainer.micro_batch_size
    chunks = []
    micros = micro_batches(batch.num_rows, size)
    keep_in_step(state, len(micros), backward=False)
    for rows in micros:
        with torch.no_grad():
            values, seq = response_values(state.model, batch.take(pa.array(rows)), state.pad_token_id)
        chunks.append(from_padded(values, seq.response_lengths, pa.float32()))
    column = pa.concat_arrays(chunks) if chunks else pa.array([], type=pa.list_(pa.float32()))
    return StageResult(columns={VALUES: column})


class CriticLossConfig(StageParams):
    """verl's ``critic.*`` loss settings."""

    cliprange_value: float = Field(0.5, ge=0)
    """Clip range of the value prediction around the rollout-time values."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    loss_scale_factor: float | None = Field(None, gt=0)
    """seq-mean-token-sum-norm divisor; None = padded width of the micro-batch."""

    @field_validator("loss_agg_mode")
    @classmethod
    def _known_agg(cls, name: str) -> str:
        return known_name(AGG_MODES, name)


@stage("critic_update", "ppo", placement="worker", role="critic", params=CriticLossConfig, writes={},
       reads=cols(PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, VALUES, RETURNS))  # fmt: skip
def critic_update(state, batch: pa.Table, params: CriticLossConfig, ctx) -> StageResult:
    """PPO value-loss steps of the critic on the batch's returns (verl's clipped value loss)."""
    trainer = state.config.trainer
    prompts = state.config.data.prompts_per_step
    num_minis = prompts // (trainer.ppo_mini_batch_size or prompts)
    history: dict[str, list[float]] = {}
    for _ in range(trainer.ppo_epochs):
        for rows in np.array_split(np.arange(batch.num_rows), num_minis):
            for key, value in _local_update(state, batch.take(pa.array(rows)), params).items():
                history.setdefault(key, []).append(value)
    metrics = {k if "/" in k else f"critic/{k}": float(np.mean(v)) for k, v in history.items()}
    return StageResult(metrics=state.all_reduce_mean_metrics(metrics))


def _local_update(state, mini: pa.Table, params: CriticLossConfig) -> dict[str, float]:
    mask = to_padded(mini.column(RESPONSE_MASK), 0, torch.float32)
    local = torch.tensor([mask.sum().item(), (mask.sum(1) > 0).sum().item()], dtype=torch.float64)
    tokens, seqs = state.all_reduce_sum(local).tolist()
    den = LossDenominators(global_tokens=tokens, global_seqs=seqs, dp_size=state.world_size)
    sums: dict[str, float] = {}
    micros = micro_batches(mini.num_rows, state.config.trainer.micro_batch_size)
    keep_in_step(state, len(micros), backward=True)
    for rows in micros:
        micro = mini.take(pa.array(rows))
        vpreds, seq = response_values(state.model, micro, state.pad_token_id)
        width = seq.response_width
        m = to_padded(micro.column(RESPONSE_MASK), 0, torch.float32, width) * seq.response_padding
        returns, values = (to_padded(micro.column(c), 0, torch.float32, width) for c in (RETURNS, VALUES))
        loss, metrics = value_loss(vpreds, returns, values, params.cliprange_value,
                                   Aggregator(m, den, params.loss_agg_mode, params.loss_scale_factor))  # fmt: skip
        loss.backward()
        for key, value in metrics.items():  # vf_loss is a share: summed; the rest: row-weighted means
            sums[key] = sums.get(key, 0.0) + (value if key == "critic/vf_loss" else value * len(rows) / mini.num_rows)
    sums.update(state.optimizer_step())
    return sums
