"""TrainState: the LR schedule, skipping non-finite updates, weight export and the HF save."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import eval_logits
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import load_buckets
from rlpipe.engine.state.train_state import NumericalError, TrainState, lr_lambda, updates_per_step
from rlpipe.schemas.config import (
    ArchitectureConfig, DataConfig, LRScheduleConfig, ModelConfig, OptimizerConfig, PipelineConfig, TokenizerConfig,
    TrainerConfig,
)

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [4, 11, 12, 13, 14, 5]])


def config(**trainer) -> PipelineConfig:
    arch = ArchitectureConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                              max_position_embeddings=64)
    trainer.setdefault("optimizer", OptimizerConfig(lr=0.01))
    return PipelineConfig(model=ModelConfig(architecture=arch), tokenizer=TokenizerConfig(chars="0123456789="),
                          data=DataConfig(prompts_per_step=4), trainer=TrainerConfig(**trainer), stages=[])


def logits(model) -> torch.Tensor:
    return eval_logits(model, IDS)


def some_training(state: TrainState) -> None:
    """One real optimizer step, so the weights are no longer the seed's initialization."""
    loss = logits_with_grad(state.model).logsumexp(-1).mean()
    loss.backward()
    state.optimizer_step()


def logits_with_grad(model):
    return model(input_ids=IDS).logits


# --- the LR schedule: multipliers evaluated by hand --------------------------------------------------

def factors(schedule: LRScheduleConfig, total: int, us) -> list[float]:
    f = lr_lambda(schedule, total)
    return [f(u) for u in us]


def test_constant_schedule():
    assert factors(LRScheduleConfig(), 10, [0, 5, 9, 30]) == [1.0, 1.0, 1.0, 1.0]


def test_constant_with_warmup_ramps_linearly_to_the_peak():
    got = factors(LRScheduleConfig(name="constant", warmup_updates=4), 10, [0, 1, 2, 3, 4, 9])
    assert got == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_with_warmup_and_floor():
    # warmup 2, then 8 updates from 1.0 down to min_lr_ratio 0.2: slope 0.8 / 8 = 0.1 per update
    got = factors(LRScheduleConfig(name="linear", warmup_updates=2, min_lr_ratio=0.2), 10, [0, 1, 2, 3, 6, 10, 14])
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.9, 0.6, 0.2, 0.2], abs=1e-12)


def test_cosine_decay_to_zero():
    # total 4: progress u/4 → 0.5·(1 + cos(π·u/4)): 1, (1 + √2/2)/2, 1/2, (1 − √2/2)/2, 0
    got = factors(LRScheduleConfig(name="cosine"), 4, [0, 1, 2, 3, 4, 7])
    assert got == pytest.approx([1.0, 0.8535533905932737, 0.5, 0.14644660940672624, 0.0, 0.0], abs=1e-12)


def test_cosine_with_warmup_and_min_lr_ratio():
    # warmup 2 (0.5, 1.0), then cosine over 4 updates from 1 to 0.1: 0.1 + 0.9·shape
    got = factors(LRScheduleConfig(name="cosine", warmup_updates=2, min_lr_ratio=0.1), 6, [0, 1, 2, 3, 4, 5, 6])
    expected = [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.8535533905932737, 0.55, 0.1 + 0.9 * 0.14644660940672624, 0.1]
    assert got == pytest.approx(expected, abs=1e-12)


def test_updates_per_step_and_the_schedule_length():
    cfg = config(total_steps=5, ppo_mini_batch_size=1, ppo_epochs=3)  # 4 prompts / 1 per mini × 3 epochs
    assert updates_per_step(cfg) == 12
    assert updates_per_step(config(total_steps=5)) == 1
    state = TrainState(cfg, 0, 1, None)
    assert state.total_updates == 60


def test_the_scheduler_applies_the_multiplier_to_the_peak_lr():
    cfg = config(total_steps=4, optimizer=OptimizerConfig(lr=0.02),
                 lr_schedule=LRScheduleConfig(name="linear", warmup_updates=1, min_lr_ratio=0.0))
    state = TrainState(cfg, 0, 1, None)
    seen = []
    for _ in range(4):
        logits_with_grad(state.model).mean().backward()
        seen.append(state.optimizer_step()["lr"])
    # warmup 1 → 0.02; then linear over 3 updates: 1, 2/3, 1/3 of the peak
    assert seen == pytest.approx([0.02, 0.02, 0.02 * 2 / 3, 0.02 / 3], rel=1e-12)
    assert state.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-15)
    assert state.local_updates == 4


# --- non-finite gradients ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("clip", [1.0, None])
def test_a_non_finite_grad_norm_skips_the_update_and_warns(bad, clip, caplog):
    state = TrainState(config(grad_clip=clip, on_nonfinite="skip"), 0, 1, None)
    logits_with_grad(state.model).mean().backward()
    first = next(state.model.parameters())
    first.grad.view(-1)[0] = bad
    before = [p.detach().clone() for p in state.model.parameters()]
    with caplog.at_level(logging.WARNING, logger="rlpipe.engine.state.train_state"):
        out = state.optimizer_step()
    assert not torch.isfinite(torch.tensor(out["grad_norm"]))
    for p, q in zip(state.model.parameters(), before):
        assert torch.equal(p.detach(), q)
        assert p.grad is None  # the bad gradient does not leak into the next update
    assert state.optimizer.state == {} or all(not s for s in state.optimizer.state.values())  # Adam never stepped
    assert any("non-finite grad norm" in r.getMessage() and "update skipped" in r.getMessage()
               and r.levelno == logging.WARNING for r in caplog.records)
    assert state.local_updates == 1  # the schedule still counts the update
    assert out["skipped"] == 1.0 and state.skipped_updates == 1

    # the next finite update works as usual
    logits_with_grad(state.model).mean().backward()
    out = state.optimizer_step()
    assert torch.isfinite(torch.tensor(out["grad_norm"]))
    assert any(not torch.equal(p.detach(), q) for p, q in zip(state.model.parameters(), before))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_grad_norm_fails_by_default_leaving_the_weights_untouched(bad):
    state = TrainState(config(), 0, 1, None)
    logits_with_grad(state.model).mean().backward()
    next(state.model.parameters()).grad.view(-1)[0] = bad
    before = [p.detach().clone() for p in state.model.parameters()]
    with pytest.raises(NumericalError, match=r"local update 0: the gradient norm is (inf|nan); the update was not "
                                             r"applied.*trainer\.on_nonfinite: skip"):
        state.optimizer_step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(state.model.parameters(), before))


def test_non_finite_parameters_after_a_step_always_fail_naming_the_parameter():
    state = TrainState(config(on_nonfinite="skip"), 0, 1, None)
    for group in state.optimizer.param_groups:  # the config refuses inf; the optimizer can still overflow
        group["lr"] = float("inf")
    logits_with_grad(state.model).logsumexp(-1).mean().backward()
    with pytest.raises(NumericalError, match=r"parameter '.+' became non-finite after the optimizer step"):
        state.optimizer_step()


def test_zero_grads_with_a_learning_signal_fail_after_k_updates_but_not_without_one():
    state = TrainState(config(max_zero_grad_updates=2), 0, 1, None)
    for _ in range(5):  # no learning signal (advantages all 0): zero grads are expected
        (next(state.model.parameters()).sum() * 0).backward()
        state.optimizer_step(expect_grad=False)
    (next(state.model.parameters()).sum() * 0).backward()
    state.optimizer_step(expect_grad=True)
    (next(state.model.parameters()).sum() * 0).backward()
    with pytest.raises(NumericalError, match=r"gradient norm was 0 for 2 consecutive updates"):
        state.optimizer_step(expect_grad=True)


def test_a_finite_step_does_not_warn(caplog):
    state = TrainState(config(), 0, 1, None)
    with caplog.at_level(logging.WARNING, logger="rlpipe.engine.state.train_state"):
        some_training(state)
    assert not [r for r in caplog.records if "non-finite" in r.getMessage()]


# --- weights out -------------------------------------------------------------------------------------

def test_exported_weights_load_into_a_fresh_model_with_identical_logits():
    cfg = config()
    state = TrainState(cfg, 0, 1, None)
    some_training(state)
    fresh = build_model(cfg.model, build_tokenizer(cfg.tokenizer), seed=123)
    assert not torch.allclose(logits(fresh), logits(state.model), atol=1e-3)
    loaded = load_buckets(fresh, state.export_weights())
    assert loaded  # names of the loaded tensors
    assert torch.equal(logits(fresh), logits(state.model))


def test_save_hf_writes_a_directory_transformers_loads_with_identical_logits(tmp_path):
    cfg = config()
    state = TrainState(cfg, 0, 1, None)
    some_training(state)
    path = state.save_hf(str(tmp_path / "hf"))
    reloaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert torch.equal(logits(reloaded), logits(state.model))
    tokenizer = build_tokenizer(TokenizerConfig(path=path))
    assert tokenizer.encode("12=3") == state.tokenizer.encode("12=3")


def test_save_hf_writes_only_on_rank_zero(tmp_path):
    state = TrainState(config(), 1, 1, None)  # rank 1 (a single-rank group: no rendezvous)
    state.save_hf(str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
