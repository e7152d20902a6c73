"""IS weights, rejection masks and off-policy metrics against hand values / direct formulas."""

import math

import pytest
import torch

from rlpipe.errors import ConfigError
from rlpipe.stages.algos.offpolicy_metrics import offpolicy_metrics
from rlpipe.stages.algos.rollout_correction import RS_OPTIONS, is_weights, parse_rs, rejection_mask

LN2, LN3, LN4 = math.log(2), math.log(3), math.log(4)
# log ρ = log π_old - log π_rollout
LOG_RATIO = torch.tensor([[LN2, 0.0, LN3], [-LN2, LN4, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def rows(t):
    return [pytest.approx(r, abs=1e-6) for r in t.tolist()]


def test_token_tis_truncates_at_the_threshold():
    w, m = is_weights(LOG_RATIO, MASK, "token", 2.0)
    assert w.tolist() == rows(torch.tensor([[2.0, 1.0, 0.0], [0.5, 2.0, 1.0]]))  # 4 → 2, padding → 0
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    ess = 1 / (((4 + 1 + 0.25 + 4 + 1) / 5) / 1.3**2)  # 1 / mean((w / mean w)²)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-5)


def test_sequence_weights_are_the_product_of_token_ratios():
    w, _ = is_weights(LOG_RATIO, MASK, "sequence", 5.0)
    assert w.tolist() == rows(torch.tensor([[2.0, 2.0, 0.0], [2.0, 2.0, 2.0]]))  # exp(ln2), exp(-ln2 + ln4)
    w, _ = is_weights(LOG_RATIO, MASK, "sequence", 1.5)
    assert w.tolist() == rows(torch.tensor([[1.5, 1.5, 0.0], [1.5, 1.5, 1.5]]))


def test_icepop_zeroes_weights_outside_the_band():
    w, m = is_weights(LOG_RATIO, MASK, "token", "0.6_3.0")
    assert w.tolist() == rows(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 5)


def test_batch_normalization_gives_mean_one():
    w, m = is_weights(LOG_RATIO, MASK, "token", 2.0, batch_normalize=True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(6.5 / 5)
    assert (w * MASK).sum().item() / 5 == pytest.approx(1.0)
    w, _ = is_weights(LOG_RATIO, MASK, "sequence", 5.0, batch_normalize=True)
    assert (w * MASK).tolist() == rows(MASK)  # both sequences weigh 2


def test_is_weights_carry_no_gradient():
    log_ratio = LOG_RATIO.clone().requires_grad_(True)
    for level in ("token", "sequence"):
        w, _ = is_weights(log_ratio, MASK, level, 2.0, batch_normalize=True)
        assert not w.requires_grad


@pytest.mark.parametrize(
    "option, threshold, expected",
    [
        ("token_k1", "2.5", [[1, 1, 0], [1, 0, 1]]),  # keep 1/2.5 ≤ ρ ≤ 2.5: ρ = 4 rejected
        ("token_k2", "0.5", [[1, 1, 0], [1, 0, 1]]),  # ½ ln²4 = 0.96 > 0.5
        ("token_k3", "1.0", [[1, 1, 0], [1, 0, 1]]),  # 4 - 1 - ln 4 = 1.61 > 1
        ("seq_sum_k2", "0.5", [[1, 1, 0], [0, 0, 0]]),  # row 1: 0.24 + 0.96 = 1.2
        ("seq_mean_k3", "0.5", [[1, 1, 0], [0, 0, 0]]),  # row 1: (0.193 + 1.614 + 0) / 3 = 0.60
        ("seq_max_k2", "0.5", [[1, 1, 0], [0, 0, 0]]),  # row 1: 0.96
        ("seq_sum_k1", "0.4_2.5", [[1, 1, 0], [1, 1, 1]]),  # Σ -log ρ = -ln 2 for both rows
        ("token_k2,seq_sum_k1", "0.5,0.4_2.5", [[1, 1, 0], [1, 0, 1]]),  # AND of the two
        ("token_k2,seq_max_k2", "0.5", [[1, 1, 0], [0, 0, 0]]),  # one shared threshold
    ],
)
def test_rejection_options(option, threshold, expected):
    kept, metrics = rejection_mask(LOG_RATIO, MASK, option, threshold)
    assert kept.tolist() == torch.tensor(expected, dtype=torch.float32).tolist()
    rejected = MASK.sum().item() - kept.sum().item()
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(rejected / 5)


def test_rejection_never_unmasks_a_token():
    g = torch.Generator().manual_seed(1)
    log_ratio = torch.randn(16, 9, generator=g)
    mask = (torch.rand(16, 9, generator=g) > 0.4).float()
    for option in RS_OPTIONS:
        threshold = "0.5_2.0" if option.endswith("k1") else "0.3"
        kept, _ = rejection_mask(log_ratio, mask, option, threshold)
        assert bool((kept <= mask).all()), option


@pytest.mark.parametrize(
    "options, thresholds, message",
    [
        ("token_k4", "1", "known:"),
        ("token_k1", None, "needs rollout_rs_threshold"),
        ("token_k1,token_k2", "1,2,3", "give 1 or 2"),
        ("token_k2", "0.5_2", "only \\*_k1"),
    ],
)
def test_bad_rs_specs_say_what_to_do(options, thresholds, message):
    with pytest.raises(ConfigError, match=message):
        parse_rs(options, thresholds)


def test_offpolicy_metrics_direct_formulas():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -3.0]])
    rollout = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -1.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    m = offpolicy_metrics(old, rollout, mask)
    tokens = [(o, r) for ro, rr, rm in zip(old.tolist(), rollout.tolist(), mask.tolist())
              for o, r, v in zip(ro, rr, rm) if v]  # fmt: skip
    lr = [o - r for o, r in tokens]
    assert m["kl"] == pytest.approx(sum(-x for x in lr) / 5)
    assert m["k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in lr) / 5)
    assert m["chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in lr) / 5 - 1)
    seq_sums = [lr[0] + lr[1], lr[2] + lr[3] + lr[4]]
    assert m["chi2_seq"] == pytest.approx(sum(math.exp(2 * s) for s in seq_sums) / 2 - 1)
    mean_old = [(-1 - 2) / 2, (-0.5 - 0.5 - 3) / 3]
    mean_roll = [(-1.5 - 1) / 2, (-0.5 - 1 - 2) / 3]
    diffs = [r - o for o, r in zip(mean_old, mean_roll)]
    assert m["log_ppl_diff"] == pytest.approx(sum(diffs) / 2)
    assert m["ppl_ratio"] == pytest.approx(sum(math.exp(d) for d in diffs) / 2)
    assert m["training_ppl"] == pytest.approx(sum(math.exp(-x) for x in mean_old) / 2)


# --- verl 0.9.1 diagnostics: rollout_is_std, rollout_is_seq_*, rollout_rs_*_{std,fraction_*,seq_*} ---

def test_is_std_and_sequence_diagnostics_hand_values():
    _, m = is_weights(LOG_RATIO, MASK, "token", 2.0)
    # valid weights 2, 1 | 0.5, 2, 1: mean 1.3, mean of squares 2.05 → std sqrt(0.36)
    assert m["rollout_is_std"] == pytest.approx(0.6, rel=1e-6)
    s0, s1 = 1.5, 3.5 / 3  # per-row means of the applied weights
    assert m["rollout_is_seq_mean"] == pytest.approx((s0 + s1) / 2, rel=1e-6)
    assert m["rollout_is_seq_std"] == pytest.approx(abs(s0 - s1) / math.sqrt(2), rel=1e-6)
    assert (m["rollout_is_seq_max"], m["rollout_is_seq_min"]) == (pytest.approx(s0), pytest.approx(s1))
    assert m["rollout_is_seq_max_deviation"] == pytest.approx(0.5)
    assert m["rollout_is_seq_fraction_high"] == 0.0 and m["rollout_is_seq_fraction_low"] == 0.0
    # raw per-row means 1.5 and (0.5 + 4 + 1)/3 = 1.83: above 1.6 is row 1; nothing below 1/1.6
    _, m = is_weights(LOG_RATIO, MASK, "token", 1.6)
    assert m["rollout_is_seq_fraction_high"] == pytest.approx(0.5)
    assert m["rollout_is_seq_fraction_low"] == 0.0


def test_rs_token_level_diagnostics_hand_values():
    _, m = rejection_mask(LOG_RATIO, MASK, "token_k2", 0.2)
    k = 0.5 * LN2**2  # 0.2402; the valid k2 values are k, 0 | k, ½ln4², 0
    assert m["rollout_rs_token_k2_fraction_high"] == pytest.approx(3 / 5)
    assert m["rollout_rs_token_k2_fraction_low"] == 0.0  # only *_k1 have a lower bound
    assert m["rollout_rs_token_k2_std"] == pytest.approx(math.sqrt(0.024 - 0.12**2), rel=1e-5)  # clamp to [0, 0.2]
    v0, v1 = k / 2, (k + 0.5 * LN4**2) / 3  # per-row means of the statistic
    assert m["rollout_rs_token_k2_seq_mean"] == pytest.approx((v0 + v1) / 2, rel=1e-6)
    assert m["rollout_rs_token_k2_seq_std"] == pytest.approx(abs(v1 - v0) / math.sqrt(2), rel=1e-6)
    assert m["rollout_rs_token_k2_seq_max"] == pytest.approx(v1) and m["rollout_rs_token_k2_seq_min"] == pytest.approx(v0)
    assert m["rollout_rs_token_k2_seq_max_deviation"] == pytest.approx(v1)
    assert m["rollout_rs_token_k2_seq_fraction_high"] == pytest.approx(0.5)
    assert "rollout_rs_token_k2_seq_fraction_low" not in m


def test_rs_sequence_k1_diagnostics_use_log_bounds():
    _, m = rejection_mask(LOG_RATIO, MASK, "seq_mean_k1", "0.8_1.5")
    v0, v1 = -LN2 / 2, (LN2 - LN4) / 3  # mean of k1 = −log ρ per row: −0.347, −0.231, both < log 0.8
    assert m["rollout_rs_seq_mean_k1_fraction_high"] == 0.0
    assert m["rollout_rs_seq_mean_k1_fraction_low"] == pytest.approx(1.0)
    assert m["rollout_rs_seq_mean_k1_seq_fraction_low"] == pytest.approx(1.0)
    assert m["rollout_rs_seq_mean_k1_std"] == pytest.approx(0.0, abs=1e-6)  # both clamp to log 0.8
    assert m["rollout_rs_seq_mean_k1_seq_mean"] == pytest.approx((v0 + v1) / 2, rel=1e-6)
    assert m["rollout_rs_seq_mean_k1_seq_max_deviation"] == pytest.approx(LN2 / 2, rel=1e-6)
