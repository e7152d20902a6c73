"""Policy losses against hand-computed values (never against themselves)."""

import math

import pytest
import torch
from pydantic import ValidationError

from rlpipe.stages.algos.aggregation import LossDenominators, single_batch_denominators
from rlpipe.stages.algos.policy_loss import ActorLossConfig, actor_loss


def _run(cfg, ratio, adv, mask=None, **kw):
    """Loss with log π_old = 0 and log π = log(ratio), so the PPO ratio is exactly ``ratio``."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    adv = torch.as_tensor(adv, dtype=torch.float64)
    log_prob = ratio.log().clone().requires_grad_(True)
    mask = torch.ones_like(adv) if mask is None else torch.as_tensor(mask, dtype=torch.float64)
    loss, metrics = actor_loss(
        cfg, log_prob=log_prob, old_log_prob=torch.zeros_like(adv), advantages=adv,
        response_mask=mask, denominators=single_batch_denominators(mask), **kw,
    )  # fmt: skip
    loss.backward()
    return loss, metrics, log_prob.grad


def test_vanilla_hand_values_with_dual_clip():
    # (ratio, A) -> per-token loss with ε=0.2, c=3, worked out by hand:
    cases = [
        (1.5, 1.0, -1.2),  # A>0, ratio above 1+ε: clipped to 1.2
        (0.5, 1.0, -0.5),  # A>0, ratio below 1-ε: unclipped (pessimistic)
        (1.1, 1.0, -1.1),  # inside the trust region
        (0.5, -1.0, 0.8),  # A<0, ratio below 1-ε: clipped to 0.8
        (5.0, -1.0, 3.0),  # A<0, ratio 5: dual-clip caps the loss at c·|A| = 3
        (1.5, -1.0, 1.5),  # A<0, ratio 1.5 < c: unclipped
    ]
    ratio, adv, expected = (list(x) for x in zip(*cases))
    loss, metrics, _ = _run(ActorLossConfig(), [ratio], [adv])
    assert loss.item() == pytest.approx(sum(expected) / 6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 6)  # tokens 1 and 4 take the clipped branch
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 6)  # token 5
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(math.log(r) for r in ratio) / 6)


def test_vanilla_asymmetric_clip():
    cfg = ActorLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.28)
    loss, _, _ = _run(cfg, [[2.0, 0.5]], [[1.0, -1.0]])
    assert loss.item() == pytest.approx((-1.28 + 0.9) / 2)


@pytest.mark.parametrize("ratio, adv, expected", [(1.2, 2.0, -2.4), (0.8, -2.0, 1.6), (3.0, -1.0, 3.0)])
def test_vanilla_at_clip_boundaries(ratio, adv, expected):
    """At r = 1±ε (and at r = c for dual-clip) both branches meet the clip formula."""
    loss, _, _ = _run(ActorLossConfig(), [[ratio]], [[adv]])
    assert loss.item() == pytest.approx(expected)


def test_vanilla_gradient_vanishes_only_when_clipped():
    _, _, grad = _run(ActorLossConfig(), [[1.5, 1.1, 0.5]], [[1.0, 1.0, -1.0]])
    # d(-A·r)/d log π = -A·r inside; 0 where the clipped branch is active
    assert grad[0].tolist() == pytest.approx([0.0, -1.1 / 3, 0.0])


def test_gspo_uses_the_sequence_ratio():
    # one sequence of 2 tokens, log ratios ln 2 and 0: sequence ratio = sqrt(2)
    loss, metrics, _ = _run(ActorLossConfig(policy_loss="gspo", clip_ratio=0.5), [[2.0, 1.0]], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-math.sqrt(2))  # sqrt(2) < 1.5: unclipped
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.0)
    loss, metrics, _ = _run(ActorLossConfig(policy_loss="gspo", clip_ratio=0.2), [[2.0, 1.0]], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-1.2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)


def test_sapo_gate_values():
    cfg = ActorLossConfig(policy_loss="sapo", tau_pos=1.0, tau_neg=2.0)
    loss, _, _ = _run(cfg, [[1.0, 2.0]], [[1.0, -1.0]])
    gate_pos = 4.0 * 0.5  # sigmoid(0)·4/1
    gate_neg = 1 / (1 + math.exp(-2.0)) * 4.0 / 2.0  # sigmoid(2·1)·4/2
    assert loss.item() == pytest.approx((-gate_pos + gate_neg) / 2)  # seq-mean-token-mean of one sequence


def test_gpg_and_cispo():
    loss, _, grad = _run(ActorLossConfig(policy_loss="gpg"), [[0.5, 2.0]], [[1.0, 2.0]])
    assert loss.item() == pytest.approx((-math.log(0.5) - 2 * math.log(2.0)) / 2)
    assert grad[0].tolist() == pytest.approx([-0.5, -1.0])
    loss, metrics, grad = _run(ActorLossConfig(policy_loss="cispo"), [[2.0, 1.0]], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-1.2 * math.log(2.0) / 2)
    assert grad[0].tolist() == pytest.approx([-0.6, -0.5])  # sg[clip(r)]·A/2: the clip carries no gradient
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)


def test_geo_mean_hand_value():
    # two tokens, log ratios 0.1 and -0.3, A=+1, ε=0.2: pessimistic clamp keeps min(x, clamp(x)) = 0.1, -0.3
    ratio = [[math.exp(0.1), math.exp(-0.3)]]
    loss, metrics, _ = _run(ActorLossConfig(policy_loss="geo_mean"), ratio, [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-math.exp((0.1 - 0.3) / 2))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)  # -0.3 is outside [-0.2, 0.2]


def test_dppo_tv_masks_tokens_that_moved_too_far():
    # old prob = 1 (log 0). π = 0.5: Δp = -0.5 < -0.2 -> masked for A<0, kept for A>0
    loss, metrics, _ = _run(ActorLossConfig(policy_loss="dppo_tv"), [[0.5, 0.5]], [[1.0, -1.0]])
    assert loss.item() == pytest.approx(-1.0 * 0.5 * math.log(0.5) / 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)


def test_kl_loss_and_entropy_bonus_enter_the_total():
    cfg = ActorLossConfig(policy_loss="gpg", use_kl_loss=True, kl_loss_type="k1", kl_loss_coef=0.5, entropy_coeff=0.1)
    ref = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    ent = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    loss, metrics, _ = _run(cfg, [[1.0, math.e]], [[0.0, 0.0]], ref_log_prob=ref, entropy=ent)
    assert metrics["actor/kl_loss"] == pytest.approx(0.5)  # mean of log ratios 0 and 1
    assert metrics["actor/entropy_loss"] == pytest.approx(2.0)
    assert loss.item() == pytest.approx(0.5 * 0.5 - 0.1 * 2.0)


def test_is_weights_scale_the_policy_loss_only():
    w = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    loss, _, _ = _run(ActorLossConfig(policy_loss="gpg"), [[0.5, 0.5]], [[1.0, 1.0]], rollout_is_weights=w)
    assert loss.item() == pytest.approx(-2.0 * math.log(0.5) / 2)


def test_global_denominator_is_used_not_the_local_one():
    den = LossDenominators(global_tokens=10, global_seqs=5)
    cfg = ActorLossConfig(policy_loss="gpg")
    lp = torch.tensor([[-1.0, -1.0]])
    loss, _ = actor_loss(cfg, log_prob=lp, old_log_prob=lp, advantages=torch.ones(1, 2),
                         response_mask=torch.ones(1, 2), denominators=den)  # fmt: skip
    assert loss.item() == pytest.approx(2.0 / 10)


@pytest.mark.parametrize("field, value", [("policy_loss", "ppo2"), ("loss_agg_mode", "mean"), ("kl_loss_type", "k9")])
def test_unknown_names_list_the_known_ones(field, value):
    with pytest.raises(ValidationError, match="known:"):
        ActorLossConfig(**{field: value})


def test_missing_ref_logprobs_is_a_clear_error():
    from rlpipe.errors import RlpipeError

    with pytest.raises(RlpipeError, match="add a `ref` stage"):
        _run(ActorLossConfig(use_kl_loss=True), [[1.0]], [[1.0]])


# --- verl 0.9.1 parity (issue 14 part 5) -------------------------------------------------------------

GSPO_RATIO, GSPO_ADV, GSPO_MASK = [[2.0, 1.0], [1.0, 3.0]], [[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 0.0]]


@pytest.mark.parametrize("mode, expected", [
    # row 0: sequence ratio sqrt(2) < 1.5 on both tokens; row 1: one valid token, ratio 1
    ("token-mean", (-2 * math.sqrt(2) - 1) / 3),
    ("seq-mean-token-mean", (-math.sqrt(2) - 1) / 2),
    ("token-sum", -2 * math.sqrt(2) - 1),
])
def test_gspo_honors_the_configured_loss_agg_mode(mode, expected):
    cfg = ActorLossConfig(policy_loss="gspo", clip_ratio=0.5, loss_agg_mode=mode)
    loss, _, _ = _run(cfg, GSPO_RATIO, GSPO_ADV, GSPO_MASK)
    assert loss.item() == pytest.approx(expected)


def test_gspo_defaults_to_token_mean_as_verl_0_9_1():
    loss, _, _ = _run(ActorLossConfig(policy_loss="gspo", clip_ratio=0.5), GSPO_RATIO, GSPO_ADV, GSPO_MASK)
    assert loss.item() == pytest.approx((-2 * math.sqrt(2) - 1) / 3)


def test_dro_quadratic_penalty_hand_values():
    # per token −(A·log π − ½β(log π − log π_old)²), β = 0.5, log π_old = 0
    loss, metrics, grad = _run(ActorLossConfig(policy_loss="dro", dro_beta=0.5), [[2.0, 1.0]], [[1.0, -1.0]])
    ln2 = math.log(2)
    assert loss.item() == pytest.approx((-ln2 + 0.25 * ln2**2 + 0.0) / 2)
    assert grad[0].tolist() == pytest.approx([(-1 + 0.5 * ln2) / 2, 1 / 2])  # (−A + β·log ratio) / tokens
    assert metrics["actor/ppo_kl"] == pytest.approx(-ln2 / 2)


def test_dro_needs_its_beta():
    with pytest.raises(ValidationError, match="policy_loss 'dro' needs dro_beta"):
        ActorLossConfig(policy_loss="dro")


def test_bypass_mode_reinforce_applies_sequence_is_weights():
    # log π_rollout = 0 (old_log_prob in bypass mode), log π = [ln 2, 0]: sequence weight exp(ln 2) = 2
    cfg = ActorLossConfig(policy_loss="bypass_mode", bypass={"loss_type": "reinforce", "rollout_is": "sequence"})
    loss, metrics, grad = _run(cfg, [[2.0, 1.0]], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-2 * math.log(2) / 2)  # −A·log π·w, token-mean
    assert grad[0].tolist() == pytest.approx([-1.0, -1.0])  # −A·w / 2: the weight carries no gradient
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(2.0)
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(2) / 2)
    cfg = ActorLossConfig(policy_loss="bypass_mode",
                          bypass={"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 1.5})
    loss, _, _ = _run(cfg, [[2.0, 1.0]], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-1.5 * math.log(2) / 2)  # truncated at 1.5


def test_bypass_mode_ppo_clip_is_vanilla_without_is_weights_and_with_rejection():
    cfg = ActorLossConfig(policy_loss="bypass_mode")  # ppo_clip, sequence IS reported only
    loss, metrics, _ = _run(cfg, [[2.0, 1.0]], [[1.0, 1.0]])
    assert loss.item() == pytest.approx((-1.2 - 1.0) / 2)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(2.0)
    # token_k2 = ½(log ρ)² = 0.240 > 0.2 rejects token 0; the denominator stays the step's 2 tokens
    cfg = ActorLossConfig(policy_loss="bypass_mode", bypass={"rollout_rs": "token_k2", "rollout_rs_threshold": 0.2})
    loss, metrics, grad = _run(cfg, [[2.0, 1.0]], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-1.0 / 2)
    assert grad[0].tolist() == pytest.approx([0.0, -0.5])
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
