"""Aggregation modes and KL estimators against hand-computed values."""

import math

import pytest
import torch

from rlpipe.errors import RlpipeError
from rlpipe.stages.algos.aggregation import LossDenominators, aggregate, single_batch_denominators
from rlpipe.stages.algos.kl import KLControlConfig, kl_in_reward, kl_penalty, next_kl_coef

# row 0: one token of loss 1; row 1: three tokens of loss 3 (unequal lengths); row 2: fully masked
LOSS = torch.tensor([[1.0, 9.0, 9.0], [3.0, 3.0, 3.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 9) / 4),  # every token weighs the same
        ("token-sum", 1 + 9),
        ("seq-mean-token-sum", (1 + 9) / 2),  # the empty row is not a sequence
        ("seq-mean-token-mean", (1 + 3) / 2),  # every sequence weighs the same
    ],
)
def test_modes_hand_values(mode, expected):
    assert aggregate(LOSS, MASK, mode, single_batch_denominators(MASK)).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_divides_by_the_constant_or_the_width():
    den = single_batch_denominators(MASK)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", den, 10.0).item() == pytest.approx(5 / 10)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", den).item() == pytest.approx(5 / 3)


def test_seq_mean_and_token_mean_differ_on_unequal_lengths_only():
    den = single_batch_denominators(MASK)
    assert aggregate(LOSS, MASK, "token-mean", den) > aggregate(LOSS, MASK, "seq-mean-token-mean", den)
    equal = torch.ones(2, 3)
    loss = torch.tensor([[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]])
    den = single_batch_denominators(equal)
    assert aggregate(loss, equal, "token-mean", den).item() == pytest.approx(
        aggregate(loss, equal, "seq-mean-token-mean", den).item()
    )


def test_global_denominators_make_a_share():
    den = LossDenominators(global_tokens=8, global_seqs=4)
    assert aggregate(LOSS, MASK, "token-mean", den).item() == pytest.approx(10 / 8)
    assert aggregate(LOSS, MASK, "seq-mean-token-mean", den).item() == pytest.approx(4 / 4)


LOGP, REF = torch.tensor([0.0]), torch.tensor([math.log(2.0)])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("kl", -math.log(2)), ("k1", -math.log(2)), ("abs", math.log(2)),
        ("mse", 0.5 * math.log(2) ** 2), ("k2", 0.5 * math.log(2) ** 2),
        ("low_var_kl", 2 - math.log(2) - 1), ("k3", 2 - math.log(2) - 1),  # r = π_ref/π = 2: r - log r - 1
        ("k3+", 2 - math.log(2) - 1), ("k1+", -math.log(2)),
    ],
)  # fmt: skip
def test_kl_estimators_hand_values(name, expected):
    assert kl_penalty(LOGP, REF, name).item() == pytest.approx(expected)


@pytest.mark.parametrize("name", ["k1+", "k3+", "low_var_kl+", "abs+"])
def test_plus_variants_take_the_k2_gradient(name):
    logp = torch.tensor([0.3], requires_grad=True)
    kl_penalty(logp, torch.tensor([-0.2]), name).sum().backward()
    assert logp.grad.item() == pytest.approx(0.5)  # d/dlogπ ½(logπ - logπ_ref)² = logπ - logπ_ref


def test_k3_is_clamped_like_verl():
    assert kl_penalty(torch.tensor([-50.0]), torch.tensor([0.0]), "k3").item() == 10.0


def test_full_kl_over_the_vocabulary():
    p = torch.tensor([[[0.5, 0.5]]]).log()
    q = torch.tensor([[[0.25, 0.75]]]).log()
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_penalty(p, q, "full").item() == pytest.approx(expected)
    with pytest.raises(RlpipeError, match="full-vocabulary"):
        kl_penalty(LOGP, REF, "full")


def test_kl_in_reward_subtracts_the_penalty_on_valid_tokens():
    rewards = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    old = torch.tensor([[0.5, 0.5], [1.0, 9.0]])
    ref = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    new, current = kl_in_reward(rewards, old, ref, mask, "k1", 0.1)
    assert new.tolist() == [pytest.approx([-0.05, 0.95]), pytest.approx([1.9, 0.0])]
    assert current == pytest.approx((0.5 + 1.0) / 2)  # mean over sequences of per-sequence means


def test_kl_controllers():
    fixed = KLControlConfig(kl_coef=0.2)
    assert next_kl_coef(fixed, 0.2, current_kl=5.0, n_steps=100) == 0.2
    adaptive = KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.1, horizon=1000)
    assert next_kl_coef(adaptive, 0.2, current_kl=0.11, n_steps=100) == pytest.approx(0.2 * (1 + 0.1 * 0.1))
    assert next_kl_coef(adaptive, 0.2, current_kl=1.0, n_steps=100) == pytest.approx(0.2 * (1 + 0.2 * 0.1))
