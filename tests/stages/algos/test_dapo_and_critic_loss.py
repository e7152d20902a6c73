"""DAPO group classifier and the critic's value loss against hand values."""

import pytest
import torch

from rlpipe.stages.algos.aggregation import Aggregator, LossDenominators, local_counts
from rlpipe.stages.algos.critic_loss import explained_variance, value_loss
from rlpipe.stages.algos.dapo import classify_groups


def test_classifier_cases():
    # group 0: rewards differ -> keep; 1: all equal -> evict; 2: one valid (other failed) -> evict;
    # 3: equal among valid, the differing one failed -> evict; 4: a single row -> evict
    group = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 4])
    reward = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    valid = torch.tensor([True, True, True, True, True, True, False, True, True, False, True])
    verdict = classify_groups(group, reward, valid)
    assert verdict.informative.tolist() == [True, False, False, False, False]
    assert verdict.no_variance.tolist() == [False, True, False, True, False]
    assert verdict.single_valid.tolist() == [False, False, True, False, True]


def test_failed_rows_do_not_make_a_group_informative():
    verdict = classify_groups(torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, 0.0]), torch.tensor([True, True, False]))
    assert verdict.informative.tolist() == [False]


def test_value_loss_clipping_hand_values():
    # V_old = 0, ε = 0.5. token 0: V = 1, R = 2: clipped V = 0.5 -> max((1-2)², (0.5-2)²) = 2.25
    # token 1: V = 0.2, R = 0: unclipped -> 0.04
    vpreds = torch.tensor([[1.0, 0.2]], requires_grad=True)
    returns, values, mask = torch.tensor([[2.0, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2)
    agg = Aggregator(mask, LossDenominators(*local_counts(mask)))
    loss, metrics = value_loss(vpreds, returns, values, 0.5, agg)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.04) / 2)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    assert vpreds.grad.tolist()[0] == pytest.approx([0.0, 0.5 * 2 * 0.2 / 2])  # the clipped branch has no gradient


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    values = torch.tensor([[2.0, 2.0, 2.0, 0.0]])  # Var(R - V) = Var(R) = 1
    assert explained_variance(values, returns, mask) == pytest.approx(0.0, abs=1e-4)
    values = torch.tensor([[1.5, 2.0, 2.5, 0.0]])  # R - V = [-0.5, 0, 0.5]: Var 0.25
    assert explained_variance(values, returns, mask) == pytest.approx(0.75, abs=1e-4)
