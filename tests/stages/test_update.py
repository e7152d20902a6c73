"""update/ppo on a real TrainState against a hand-written PPO step.

The reference loop below is written out with torch on a copy of the model: one
unpadded forward per row, the token-mean PPO loss -Σ(A·mask·ratio)/Σmask,
backward, the global-norm clip, and AdamW's update written out by hand. AdamW's
``eps`` is set to 1 so an update is nearly proportional to the gradient (with a
tiny eps the first Adam step is ≈ lr·sign(g), blind to the gradient's scale, so
a wrong loss denominator would go unnoticed).
"""

import copy
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from rlpipe.engine.state.train_state import TrainState
from rlpipe.schemas.config import (
    ArchitectureConfig, DataConfig, LRScheduleConfig, ModelConfig, OptimizerConfig, PipelineConfig, ResourcesConfig,
    TokenizerConfig, TrainerConfig,
)
from rlpipe.stage import StageContext, stage_registry

I32, I8, F32 = pa.list_(pa.int32()), pa.list_(pa.int8()), pa.list_(pa.float32())
LR, BETAS, EPS, WD = 0.01, (0.9, 0.999), 1.0, 0.1
PROMPTS = [[5, 6], [7, 8, 9, 10, 11], [12, 13, 4], [9], [4, 4, 5, 6], [13, 12], [6, 7, 8], [10, 11, 12, 13]]
RESPONSES = [[6, 7, 8, 9], [4], [10, 14, 5], [5, 5, 6, 7, 8], [9, 10], [11, 12, 13], [14], [4, 5, 6]]
MASKS = [[1, 1, 1, 0], [1], [1, 0, 1], [1, 1, 1, 1, 1], [0, 1], [1, 1, 1], [1], [1, 1, 0]]
ADVANTAGES = [[0.5, -1.0, 2.0, 0.3], [-0.7], [1.5, 0.2, -0.4], [0.9, 0.1, -1.2, 0.6, 0.4], [0.0, -2.0],
              [1.1, 1.3, -0.6], [0.8], [-1.5, 0.7, 0.25]]
CTX = StageContext(step=0, seed=0)


def config(*, prompts=8, mini=None, epochs=1, micro=64, clip=None, total_steps=1, schedule=None,
           device="cpu") -> PipelineConfig:
    arch = ArchitectureConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                              max_position_embeddings=64)
    trainer = TrainerConfig(total_steps=total_steps, ppo_mini_batch_size=mini, ppo_epochs=epochs,
                            micro_batch_size=micro, grad_clip=clip,
                            optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
                            lr_schedule=schedule or LRScheduleConfig())
    return PipelineConfig(model=ModelConfig(architecture=arch), tokenizer=TokenizerConfig(chars="0123456789="),
                          data=DataConfig(prompts_per_step=prompts), trainer=trainer,
                          resources=ResourcesConfig(device=device), stages=[])


def row_logprobs(model, rows) -> list[torch.Tensor]:
    """Per row, unpadded: log_softmax(logits)[token] of each response token (keeps the graph)."""
    out = []
    for i in rows:
        ids = torch.tensor([PROMPTS[i] + RESPONSES[i]])
        logits = model(input_ids=ids).logits[0]
        p = len(PROMPTS[i])
        logp = torch.log_softmax(logits[p - 1 : p - 1 + len(RESPONSES[i])], dim=-1)
        out.append(logp[torch.arange(len(RESPONSES[i])), torch.tensor(RESPONSES[i])])
    return out


def batch(model, old_shift: float = 0.0) -> pa.Table:
    """The 8-row batch with old_logprobs = the model's own logprobs (+ old_shift: ratio = e^-old_shift)."""
    with torch.no_grad():
        old = [(lp + old_shift).tolist() for lp in row_logprobs(model, range(len(PROMPTS)))]
    return pa.table({
        "prompt_ids": pa.array(PROMPTS, I32), "response_ids": pa.array(RESPONSES, I32),
        "response_mask": pa.array(MASKS, I8), "old_logprobs": pa.array(old, F32),
        "advantages": pa.array(ADVANTAGES, F32),
    })  # fmt: skip


def run_update(state, table, **params):
    spec = stage_registry("update").get("ppo")
    return spec.fn(state, table, spec.params_model(**params), CTX).metrics


class HandAdamW:
    """AdamW written out: decoupled decay, bias-corrected moments, eps outside the square root."""

    def __init__(self, params):
        self.params = list(params)
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self, grads, lr):
        self.t += 1
        b1, b2 = BETAS
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            m_hat = m / (1 - b1**self.t)
            v_hat = v / (1 - b2**self.t)
            p.mul_(1 - lr * WD)
            p.sub_(lr * m_hat / (v_hat.sqrt() + EPS))


def hand_step(model, opt: HandAdamW, table: pa.Table, rows, lr: float, clip: float | None):
    """One PPO update on ``rows``: returns (loss value, grad norm before clipping)."""
    old = table.column("old_logprobs").to_pylist()
    numerator = 0.0
    tokens = sum(sum(MASKS[i]) for i in rows)
    for i, logp in zip(rows, row_logprobs(model, rows)):
        ratio = torch.exp(logp - torch.tensor(old[i]))
        assert ((ratio > 0.8) & (ratio < 1.2)).all()  # clipping inactive: -A·ratio is the vanilla loss
        mask = torch.tensor(MASKS[i], dtype=torch.float32)
        numerator = numerator + (torch.tensor(ADVANTAGES[i]) * mask * ratio).sum()
    loss = -numerator / tokens
    grads = torch.autograd.grad(loss, opt.params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(opt.params, grads)]
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    if clip is not None and norm > clip:
        grads = [g * (clip / (norm + 1e-6)) for g in grads]  # torch's clip_grad_norm_ coefficient
    opt.step(grads, lr)
    return float(loss.detach()), norm


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same_params(a, b, atol=1e-6):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize("clip", [None, 0.01])
def test_one_update_equals_the_hand_written_step_and_reports_its_loss_and_norm(clip):
    state = TrainState(config(clip=clip), 0, 1, None)
    table = batch(state.model)
    hand_model = copy.deepcopy(state.model)
    before = params_of(state.model)
    loss, norm = hand_step(hand_model, HandAdamW(hand_model.parameters()), table, range(8), LR, clip)

    metrics = run_update(state, table)

    after = params_of(state.model)
    assert max(float((a - b).abs().max()) for a, b in zip(after, before)) > 1e-4  # it moved
    assert_same_params(after, params_of(hand_model))
    assert metrics["actor/pg_loss"] == pytest.approx(loss, abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert metrics["actor/lr"] == LR
    assert metrics["actor/local_updates"] == 1.0
    if clip is not None:
        assert norm > clip  # the clipped case really clipped


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
def test_micro_batch_size_does_not_change_the_update(mode):
    results = []
    for micro in (1, 3, 64):
        state = TrainState(config(micro=micro), 0, 1, None)
        table = batch(state.model, old_shift=0.05)
        metrics = run_update(state, table, loss_agg_mode=mode, clip_ratio=0.02)  # some tokens clip
        results.append((params_of(state.model), metrics))
    (whole, m_whole) = results[-1]
    for params, metrics in results[:-1]:
        assert_same_params(params, whole)
        assert metrics["actor/pg_loss"] == pytest.approx(m_whole["actor/pg_loss"], abs=1e-6)
        assert metrics["actor/grad_norm"] == pytest.approx(m_whole["actor/grad_norm"], rel=1e-5)
    assert 0 < m_whole["actor/pg_clipfrac"] < 1  # the clip really acted on some tokens


def test_token_mean_denominator_is_the_whole_mini_batch():
    # pg_loss with ratio 1 is -Σ A·mask / Σ mask over all 8 rows: hand-computed from the constants
    numerator = sum(a * m for adv, mask in zip(ADVANTAGES, MASKS) for a, m in zip(adv, mask))
    tokens = sum(map(sum, MASKS))
    assert tokens == 18
    state = TrainState(config(micro=2), 0, 1, None)
    metrics = run_update(state, batch(state.model))
    assert metrics["actor/pg_loss"] == pytest.approx(-numerator / tokens, abs=1e-5)


def reference_factor(name: str, warmup: int, min_ratio: float, total: int, u: int) -> float:
    """The LR multiplier after ``u`` local updates, as the schedule is documented."""
    if u < warmup:
        return (u + 1) / warmup
    if name == "constant":
        return 1.0
    progress = min(1.0, (u - warmup) / (total - warmup))
    shape = 1 - progress if name == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * shape


@pytest.mark.parametrize(
    "schedule",
    [LRScheduleConfig(name="cosine", warmup_updates=2, min_lr_ratio=0.1),
     LRScheduleConfig(name="linear", min_lr_ratio=0.2),
     LRScheduleConfig(name="constant", warmup_updates=3)],
    ids=["cosine-warmup", "linear", "constant-warmup"],
)
def test_mini_batches_and_epochs_count_local_updates_and_drive_the_schedule(schedule):
    # 4 prompts per step, mini-batches of 2 prompts, 2 epochs → 2 × 2 = 4 local updates per step;
    # 3 steps → the schedule spans 12 local updates.
    state = TrainState(config(prompts=4, mini=2, epochs=2, total_steps=3, schedule=schedule), 0, 1, None)
    assert state.total_updates == 12
    table = batch(state.model)

    def factor(u):
        return reference_factor(schedule.name, schedule.warmup_updates, schedule.min_lr_ratio, 12, u)

    for step in range(2):
        metrics = run_update(state, table)
        done = 4 * (step + 1)
        assert state.local_updates == done
        assert metrics["actor/local_updates"] == float(done)
        assert state.scheduler.get_last_lr()[0] == pytest.approx(LR * factor(done), rel=1e-12)
        used = [LR * factor(u) for u in range(done - 4, done)]  # the LR each of this step's updates ran at
        assert metrics["actor/lr"] == pytest.approx(np.mean(used), rel=1e-12)


def test_mini_batches_and_epochs_equal_the_hand_written_loop():
    schedule = LRScheduleConfig(name="cosine", warmup_updates=1, min_lr_ratio=0.1)
    state = TrainState(config(prompts=4, mini=2, epochs=2, total_steps=2, schedule=schedule), 0, 1, None)
    table = batch(state.model)
    hand_model = copy.deepcopy(state.model)
    opt = HandAdamW(hand_model.parameters())
    u = 0
    losses = []
    for _ in range(2):  # epochs
        for rows in (range(0, 4), range(4, 8)):  # mini-batches: contiguous halves of the rows
            lr = LR * reference_factor("cosine", 1, 0.1, 8, u)
            losses.append(hand_step(hand_model, opt, table, rows, lr, None)[0])
            u += 1
    metrics = run_update(state, table)
    assert state.local_updates == 4
    assert_same_params(params_of(state.model), params_of(hand_model))
    assert metrics["actor/pg_loss"] == pytest.approx(np.mean(losses), abs=1e-6)  # mean over the local updates


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("micro", [1, 64])
def test_rows_without_valid_tokens_change_nothing(mode, micro):
    # an empty response and a fully masked one: no tokens, no sequences in the denominators, zero gradient
    params = []
    for extra in (False, True):
        state = TrainState(config(micro=micro), 0, 1, None)
        table = batch(state.model)
        if extra:
            table = pa.concat_tables([table, pa.table({
                "prompt_ids": pa.array([[7, 8], [9]], I32), "response_ids": pa.array([[], [4, 5]], I32),
                "response_mask": pa.array([[], [0, 0]], I8), "old_logprobs": pa.array([[], [-2.0, -2.5]], F32),
                "advantages": pa.array([[], [3.0, 3.0]], F32),
            })])  # fmt: skip
        run_update(state, table, loss_agg_mode=mode)
        params.append(params_of(state.model))
    assert_same_params(params[1], params[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_update_on_cuda_equals_the_update_on_cpu():
    cpu = TrainState(config(micro=3), 0, 1, None)
    gpu = TrainState(config(micro=3, device="cuda"), 0, 1, None)
    table = batch(cpu.model)  # same seed: same initial weights on both devices
    m_cpu, m_gpu = run_update(cpu, table), run_update(gpu, table)
    assert_same_params([p.cpu() for p in params_of(gpu.model)], params_of(cpu.model), atol=1e-5)
    assert m_gpu["actor/pg_loss"] == pytest.approx(m_cpu["actor/pg_loss"], abs=1e-5)


def test_mask_zero_tokens_never_reach_the_gradient():
    """Agent trajectories: tool-observation tokens (mask 0) may carry any advantage and old logprob
    (here absurd ones) without changing the update by a single bit."""
    states = [TrainState(config(), 0, 1, None) for _ in range(2)]
    table = batch(states[0].model, old_shift=0.05)
    garbage = lambda column, value: pa.array(  # noqa: E731
        [[x if m else value for x, m in zip(row, mask)] for row, mask in zip(table.column(column).to_pylist(), MASKS)],
        F32)
    poisoned = table.set_column(table.schema.get_field_index("advantages"), "advantages", garbage("advantages", 1e4))
    poisoned = poisoned.set_column(poisoned.schema.get_field_index("old_logprobs"), "old_logprobs",
                                   garbage("old_logprobs", -80.0))
    metrics = [run_update(s, t) for s, t in zip(states, (table, poisoned))]
    for a, b in zip(params_of(states[0].model), params_of(states[1].model)):
        assert torch.equal(a, b)
    assert metrics[0]["actor/grad_norm"] == metrics[1]["actor/grad_norm"]


def test_mixed_precision_computes_in_bfloat16_and_keeps_float32_master_weights():
    from rlpipe.jagged import SequenceInputs
    from rlpipe.stages.logprobs import eager_logits

    fp32 = TrainState(config(), 0, 1, None)
    mixed_config = config()
    mixed_config.trainer.mixed_precision = "bf16"
    mixed = TrainState(mixed_config, 0, 1, None)
    assert_same_params(params_of(mixed.model), params_of(fp32.model), atol=0)
    table = batch(fp32.model)
    seq = SequenceInputs(table.column("prompt_ids"), table.column("response_ids"))
    assert eager_logits(mixed.model, seq, torch.bfloat16).dtype == torch.bfloat16  # the forward ran in bf16
    before = params_of(fp32.model)
    m_fp32, m_mixed = run_update(fp32, table), run_update(mixed, table)
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in mixed.model.parameters())
    for b, a32, amix in zip(before, params_of(fp32.model), params_of(mixed.model)):
        step32, step_mixed = a32 - b, amix - b
        # the same update up to bf16 rounding of the gradient: within 5% of the fp32 step's size
        assert float((step_mixed - step32).norm()) <= 0.05 * float(step32.norm()) + 1e-7
    assert m_mixed["actor/grad_norm"] == pytest.approx(m_fp32["actor/grad_norm"], rel=0.02)
    assert m_mixed["actor/grad_norm"] != m_fp32["actor/grad_norm"]  # it did compute in bf16


def test_mixed_precision_needs_float32_parameters_and_not_megatron():
    with pytest.raises(ValueError, match="set model.dtype: float32"):
        PipelineConfig.model_validate({**config().model_dump(), "model": {"architecture": {"hidden_size": 32},
                                       "dtype": "bfloat16"}, "trainer": {"mixed_precision": "bf16"}})
    with pytest.raises(ValueError, match="megatron has its own precision settings"):
        PipelineConfig.model_validate({**config().model_dump(), "trainer": {"mixed_precision": "bf16",
                                                                            "backend": "megatron"}})
