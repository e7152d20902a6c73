"""Advantage estimators against hand-computed values and direct formulas written here."""

import math

import pytest
import torch

from rlpipe.errors import RlpipeError
from rlpipe.stages.algos.advantages import BUILTIN_ESTIMATORS, DiscountParams, GAEParams, GroupNormParams

EPS = 1e-6


def outcome(scores, lengths=None):
    """Token rewards with each score on the last token of a row of the given length."""
    lengths = lengths or [3] * len(scores)
    width = max(lengths)
    rewards = torch.zeros(len(scores), width)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    rewards[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores, dtype=torch.float32)
    return rewards, mask


def run(name, scores, group, lengths=None, params=None, **extra):
    rewards, mask = outcome(scores, lengths)
    adv, ret = BUILTIN_ESTIMATORS[name](rewards, mask, torch.tensor(group), params, **extra)
    return adv, ret, mask


def row_values(adv):
    return adv[:, 0].tolist()


def test_grpo_hand_values():
    adv, ret, mask = run("grpo", [1.0, 0.0, 0.0, 2.0, 4.0], [0, 0, 0, 1, 1])
    std_a = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0]
    expected = [(2 / 3) / (std_a + EPS), (-1 / 3) / (std_a + EPS), (-1 / 3) / (std_a + EPS)]
    expected += [-1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)]
    assert row_values(adv) == pytest.approx(expected, rel=1e-5)
    assert torch.equal(adv, ret)
    assert torch.equal(adv, adv * mask)  # the scalar is broadcast over valid tokens only


def test_dr_grpo_does_not_divide_by_std():
    adv, _, _ = run("dr_grpo", [1.0, 0.0, 0.0, 2.0, 4.0], [0, 0, 0, 1, 1])
    assert row_values(adv) == pytest.approx([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0])
    adv2, _, _ = run("grpo", [1.0, 0.0, 0.0], [0, 0, 0], params=GroupNormParams(norm_adv_by_std_in_grpo=False))
    assert row_values(adv2) == pytest.approx([2 / 3, -1 / 3, -1 / 3])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_advantages_sum_to_zero(name):
    g = torch.Generator().manual_seed(3)
    group = torch.arange(6).repeat_interleave(5)
    scores = torch.randint(0, 3, (30,), generator=g).float().tolist()
    adv, _, _ = run(name, scores, group.tolist())
    per_group = torch.zeros(6).index_add_(0, group, adv[:, 0])
    if name == "reinforce_plus_plus_baseline":  # whitening shifts by the batch mean: groups sum to the same value
        per_group = per_group - per_group.mean()
    assert per_group.abs().max() < 1e-4


def test_singleton_group_follows_verl():
    adv, _, _ = run("grpo", [5.0], [0])
    assert row_values(adv) == pytest.approx([5.0 / (1 + EPS)])  # mean 0, std 1


def test_grpo_passk_rewards_only_the_best():
    adv, _, _ = run("grpo_passk", [1.0, 3.0, 2.0, 0.0, 0.0], [0, 0, 0, 1, 1])
    assert row_values(adv) == pytest.approx([0.0, 1.0 / (1.0 + EPS), 0.0, 0.0, 0.0])  # (3-2)/std([1,3,2])
    adv, _, _ = run("grpo_passk", [1.0, 3.0, 2.0], [0, 0, 0], params=GroupNormParams(norm_adv_by_std_in_grpo=False))
    assert row_values(adv) == pytest.approx([0.0, 1.0, 0.0])
    with pytest.raises(RlpipeError, match="at least 2 samples"):
        run("grpo_passk", [1.0, 3.0, 2.0], [0, 0, 1])


def test_rloo_leave_one_out_baseline():
    adv, _, _ = run("rloo", [1.0, 0.0, 0.0, 1.0, 7.0], [0, 0, 0, 0, 1])
    # baseline = mean of the OTHER rows: 1 - 1/3, 0 - 2/3; a singleton keeps its score (verl)
    assert row_values(adv) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 7.0])


def test_opo_length_weighted_baseline():
    adv, _, _ = run("opo", [1.0, 0.0], [0, 0], lengths=[1, 3])
    assert row_values(adv) == pytest.approx([0.75, -0.25])  # baseline (1·1 + 3·0) / 4


def test_gpg_scales_by_nonzero_fraction():
    adv, _, _ = run("gpg", [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])
    assert row_values(adv) == pytest.approx([1.0, -1.0, -1.0, 1.0])  # alpha = 4 rows / 2 non-zero


def test_remax_subtracts_the_greedy_baseline():
    adv, ret, _ = run("remax", [1.0], [0], reward_baselines=torch.tensor([0.4]))
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert adv[0].tolist() == pytest.approx([0.6, 0.6, 0.6])


def whiten(x):
    return (x - x.mean()) / math.sqrt(x.var(unbiased=True).item() + 1e-8)


def test_reinforce_plus_plus_discounted_returns_skip_masked_tokens():
    rewards = torch.tensor([[0.0, 5.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    adv, ret = BUILTIN_ESTIMATORS["reinforce_plus_plus"](rewards, mask, torch.tensor([0, 1]), DiscountParams(gamma=0.5))
    # row 0: the masked token's reward is dropped and its return is 0; row 1: [1, 2, 0]
    assert ret.tolist() == [pytest.approx([0.5, 0.0, 1.0]), pytest.approx([1.0, 2.0, 0.0])]
    valid = torch.tensor([0.5, 1.0, 1.0, 2.0, 0.0])
    expected = whiten(valid)
    assert adv[mask.bool()].tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    assert adv[0, 1] == 0


def test_gae_gamma_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = BUILTIN_ESTIMATORS["gae"](rewards, torch.ones(1, 3), torch.tensor([0]), GAEParams(), values=values)
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert adv[0].tolist() == pytest.approx(whiten(torch.tensor([0.5, 0.4, 0.3])).tolist(), abs=1e-5)


def test_gae_discounted_hand_values():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    params = GAEParams(gamma=0.5, lam=0.5)
    _, ret = BUILTIN_ESTIMATORS["gae"](rewards, torch.ones(1, 3), torch.tensor([0]), params, values=values)
    # δ2 = 0.3; δ1 = 0.35-0.6 = -0.25, A1 = -0.25+0.25·0.3; δ0 = 0.3-0.5, A0 = -0.2+0.25·A1
    a1 = -0.25 + 0.25 * 0.3
    a0 = -0.2 + 0.25 * a1
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, 1.0])


def test_gae_carries_through_masked_tokens():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.7]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = BUILTIN_ESTIMATORS["gae"](rewards, mask, torch.tensor([0]), GAEParams(), values=values)
    assert ret[0].tolist() == pytest.approx([1.0, 9.3, 1.0])  # raw advantages [0.5, 0.3, 0.3] + values
    std = math.sqrt(0.02 + 1e-8)  # unbiased var of [0.5, 0.3]
    assert adv[0].tolist() == pytest.approx([0.1 / std, -0.1 / std, -0.1 / std], rel=1e-4)


# --- verl 0.9.1 parity: gdpo and the optimal token baselines (issue 14 part 5) ----------------------

def test_gdpo_without_components_is_grpo_whitened_over_the_batch():
    adv, ret, mask = run("gdpo", [1.0, 0.0], [0, 0], lengths=[2, 2])
    # GRPO gives ±0.5/sqrt(0.5) = ±0.7071 on 4 tokens; whitening (unbiased var 4·0.5/3) scales to ±sqrt(3)/2
    assert adv.tolist() == [pytest.approx([math.sqrt(3) / 2] * 2, rel=1e-5),
                            pytest.approx([-math.sqrt(3) / 2] * 2, rel=1e-5)]
    assert torch.equal(adv, ret)


def test_gdpo_normalizes_each_component_in_its_group_before_the_weighted_sum():
    from rlpipe.stages.algos.advantages import GDPOParams

    rewards, mask = outcome([1.0, 0.0, 3.0], [1, 1, 1])
    components = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 3.0]])
    adv, _ = BUILTIN_ESTIMATORS["gdpo"](rewards, mask, torch.tensor([0, 0, 0]),
                                        GDPOParams(reward_keys=["a", "b"]), reward_components=components)
    # A_a = [2/3, -1/3, -1/3]/sqrt(1/3), A_b = [-1, -1, 2]/sqrt(3); sum [1, -2, 1]/sqrt(3), already mean 0, var 1
    s = 1 / math.sqrt(3)
    assert adv[:, 0].tolist() == pytest.approx([s, -2 * s, s], rel=1e-5)  # grpo on the summed score: [-, -, +]
    weighted = GDPOParams(reward_keys=["a", "b"], reward_weights=[1.0, 0.0])
    adv, _ = BUILTIN_ESTIMATORS["gdpo"](rewards, mask, torch.tensor([0, 0, 0]), weighted, reward_components=components)
    assert adv[:, 0].tolist() == pytest.approx([2 * s, -s, -s], rel=1e-5)  # only A_a: [2/3, -1/3, -1/3]/sqrt(1/3)


def test_gdpo_weights_must_match_the_components():
    from pydantic import ValidationError

    from rlpipe.stages.algos.advantages import GDPOParams

    with pytest.raises(ValidationError, match="reward_weights has 1 entries for 2 reward components"):
        GDPOParams(reward_keys=["a", "b"], reward_weights=[1.0])


def _otb(name, scores, lengths, pi, sum_sq, mask=None, params=None, **extra):
    rewards, default_mask = outcome(scores, lengths)
    mask = default_mask if mask is None else torch.tensor(mask)
    if mask is not default_mask:  # put each score on the row's last valid token
        last = (mask * torch.arange(mask.shape[1])).argmax(-1)
        rewards = torch.zeros_like(mask)
        rewards[torch.arange(len(scores)), last] = torch.tensor(scores)
    return BUILTIN_ESTIMATORS[name](rewards, mask, torch.zeros(len(scores), dtype=torch.long), params,
                                    old_log_probs=torch.tensor(pi).log(), sum_pi_squared=torch.tensor(sum_sq), **extra)


def test_optimal_token_baseline_hand_values():
    # w = 1 - 2π + Σπ²: row 0 [0.5, 0.5] → W [0.5, 1.0]; row 1 [0.75, 0.5] → W [0.75, 1.25]; G = [1, 1], [2, 2]
    adv, ret = _otb("optimal_token_baseline", [1.0, 2.0], [2, 2], [[0.5, 0.5], [0.25, 0.5]], [[0.5, 0.5], [0.25, 0.5]])
    b0, b1 = (0.5 * 1 + 0.75 * 2) / 1.25, (1.0 * 1 + 1.25 * 2) / 2.25  # 1.6, 1.5556
    assert adv.tolist() == [pytest.approx([1 - b0, 1 - b1], rel=1e-5), pytest.approx([2 - b0, 2 - b1], rel=1e-5)]
    assert ret.tolist() == [[1.0, 1.0], [2.0, 2.0]]
    # with IS weights, w is scaled by ρ̄²: row 0's w becomes 2 → W [2, 4]
    from rlpipe.stages.algos.advantages_otb import OTBParams

    adv, _ = _otb("optimal_token_baseline", [1.0, 2.0], [2, 2], [[0.5, 0.5], [0.25, 0.5]], [[0.5, 0.5], [0.25, 0.5]],
                  params=OTBParams(use_is_weights=True), is_weights=torch.tensor([[2.0, 2.0], [1.0, 1.0]]))
    b0, b1 = (2 * 1 + 0.75 * 2) / 2.75, (4 * 1 + 1.25 * 2) / 5.25
    assert adv[0].tolist() == pytest.approx([1 - b0, 1 - b1], rel=1e-5)


def test_optimal_token_baseline_zero_tail_and_singletons():
    from rlpipe.stages.algos.advantages_otb import OTBParams

    half = [[0.5] * 3, [0.5] * 3]  # w = 0.5 everywhere
    # lengths 3 and 1: G row 0 = [1, 1, 1], row 1 = [3, 0, 0]; B = [2, 1, 1]; the unique longest row's B is 0 from 1 on
    adv, _ = _otb("optimal_token_baseline", [1.0, 3.0], [3, 1], half, half)
    assert adv.tolist() == [pytest.approx([-1.0, 1.0, 1.0]), pytest.approx([1.0, 0.0, 0.0])]
    adv, _ = _otb("optimal_token_baseline", [1.0, 3.0], [3, 1], half, half, params=OTBParams(handle_zero_tail=False))
    assert adv.tolist() == [pytest.approx([-1.0, 0.0, 0.0]), pytest.approx([1.0, 0.0, 0.0])]
    rewards, mask = outcome([1.0], [3])
    adv, ret = BUILTIN_ESTIMATORS["optimal_token_baseline"](
        rewards, mask, torch.tensor([0]), None, old_log_probs=torch.full((1, 3), 0.5).log(),
        sum_pi_squared=torch.full((1, 3), 0.5))
    assert torch.equal(adv, ret)  # a group of one: no baseline


def test_tir_optimal_token_baseline_aligns_model_tokens_not_positions():
    half = [[0.5] * 3, [0.5] * 3]
    mask = [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]  # row 0 has a tool token at position 1
    # G row 0 = [1, 1, 1], row 1 = [3, 3, 0]; W row 0 = [0.5, 0.5, 1.0], row 1 = [0.5, 1.0, 1.0]
    adv, _ = _otb("optimal_token_baseline", [1.0, 3.0], None, half, half, mask=mask)
    assert adv.tolist() == [pytest.approx([-1.0, 0.0, 0.0]), pytest.approx([1.0, 0.0, 0.0])]  # B = [2, 3, 1]
    # packed: row 0 G [1, 1] W [0.5, 1]; row 1 G [3, 3] W [0.5, 1]: B = [2, 2]
    adv, ret = _otb("tir_optimal_token_baseline", [1.0, 3.0], None, half, half, mask=mask)
    assert adv.tolist() == [pytest.approx([-1.0, 0.0, -1.0]), pytest.approx([1.0, 1.0, 0.0])]
    assert ret.tolist() == [[1.0, 1.0, 1.0], [3.0, 3.0, 0.0]]
