"""The advantage stage over Arrow batches: contracts, failed rows, KL in reward."""

import math

import pyarrow as pa
import pytest
from pydantic import ValidationError

from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages import advantage  # noqa: F401  (registers the impls)

EPS = 1e-6
CTX = StageContext(step=0, seed=0)


def table(scores, uids, lengths, status=None, **extra):
    mask = [[1] * n for n in lengths]
    rewards = [[0.0] * (n - 1) + [s] for s, n in zip(scores, lengths)]
    cols = {
        "uid": uids,
        "response_mask": pa.array(mask, pa.list_(pa.int8())),
        "token_rewards": pa.array(rewards, pa.list_(pa.float32())),
        "status": status or ["ok"] * len(uids),
    }
    cols.update(extra)
    return pa.table(cols)


def run(impl, batch, ctx=CTX, **params):
    spec = stage_registry("advantage").get(impl)
    p = spec.params_model(**params)
    return spec.fn(batch, p, ctx), spec, p


def test_every_estimator_is_an_advantage_impl():
    expected = {"gae", "grpo", "dr_grpo", "grpo_passk", "rloo", "reinforce_plus_plus",
                "reinforce_plus_plus_baseline", "remax", "opo", "gpg"}  # fmt: skip
    assert expected <= set(stage_registry("advantage").names())


def test_grpo_stage_excludes_failed_rows_and_keeps_input_intact():
    batch = table([1.0, 0.0, 5.0, 2.0, 4.0], ["a", "a", "a", "b", "b"], [2, 1, 3, 1, 2],
                  status=["ok", "ok", "failed", "ok", "ok"])  # fmt: skip
    before = batch.to_pydict()
    result, spec, p = run("grpo", batch)
    assert batch.to_pydict() == before
    adv = result.columns["advantages"].to_pylist()
    s = 1 / (math.sqrt(0.5) + EPS)  # group a without the failed row: [1, 0], std = sqrt(1/2)
    assert adv[0] == pytest.approx([0.5 * s] * 2) and adv[1] == pytest.approx([-0.5 * s])
    assert adv[2] == [0.0, 0.0, 0.0]  # the failed row carries no advantage
    assert adv[3] == pytest.approx([-1 / (math.sqrt(2) + EPS)])
    assert result.columns["advantages"].type == pa.list_(pa.float32())
    assert result.metrics["advantage/failed_rows"] == 1.0
    assert set(spec.write_columns(p)) == {"advantages", "returns"}


def test_read_contracts_follow_the_params():
    spec = stage_registry("advantage").get("gae")
    assert "values" in spec.read_columns(spec.params_model())
    p = spec.params_model(exclude_failed=False, use_kl_in_reward=True)
    reads = spec.read_columns(p)
    assert "status" not in reads and {"old_logprobs", "ref_logprobs"} <= set(reads)
    remax = stage_registry("advantage").get("remax")
    assert remax.read_columns(remax.params_model())["reward_baseline"] == pa.float32()


def test_gae_stage_reads_values_and_reports_explained_variance():
    batch = table([1.0, 1.0], ["a", "b"], [3, 3], values=pa.array([[0.5, 0.6, 0.7]] * 2, pa.list_(pa.float32())))
    result, _, _ = run("gae", batch)
    assert result.columns["returns"].to_pylist()[0] == pytest.approx([1.0, 1.0, 1.0])
    assert "advantage/vf_explained_var" in result.metrics


def test_remax_stage_uses_the_baseline_column():
    batch = table([1.0], ["a"], [2], reward_baseline=pa.array([0.25], pa.float32()))
    result, _, _ = run("remax", batch)
    assert result.columns["advantages"].to_pylist()[0] == pytest.approx([0.75, 0.75])


def test_kl_in_reward_with_adaptive_coefficient_carried_between_steps():
    batch = table([1.0, 0.0], ["a", "a"], [1, 1],
                  old_logprobs=pa.array([[-1.0], [-1.0]], pa.list_(pa.float32())),
                  ref_logprobs=pa.array([[-1.5], [-1.0]], pa.list_(pa.float32())))  # fmt: skip
    ctx = StageContext(step=3, seed=0, carry={"kl_coef": 0.2})  # what step 2 carried forward
    result, _, _ = run("dr_grpo", batch, ctx, use_kl_in_reward=True,
                       kl_ctrl={"type": "adaptive", "target_kl": 0.1, "horizon": 100})  # fmt: skip
    # rewards become 1 - 0.2·0.5 = 0.9 and 0; Dr. GRPO: ±0.45
    assert [a[0] for a in result.columns["advantages"].to_pylist()] == pytest.approx([0.45, -0.45])
    assert result.metrics["advantage/kl_coef"] == 0.2
    assert result.metrics["advantage/reward_kl_penalty"] == pytest.approx(0.25)
    assert result.metrics["advantage/kl_coef_next"] == pytest.approx(0.2 * (1 + 0.2 * 2 / 100))
    assert result.carry == {"kl_coef": result.metrics["advantage/kl_coef_next"]}


@pytest.mark.parametrize("params", [{"kl_penalty": "full"}, {"kl_penalty": "k7"}, {"bogus": 1}, {"epsilon": 0}])
def test_bad_params_are_rejected(params):
    with pytest.raises(ValidationError):
        stage_registry("advantage").get("grpo").params_model(**params)


def test_a_failed_row_without_rewards_is_accepted():
    batch = table([1.0, 0.0, 0.0], ["a", "a", "a"], [1, 1, 2], status=["ok", "ok", "failed"])
    rewards = pa.array([[1.0], [0.0], None], pa.list_(pa.float32()))
    batch = batch.set_column(batch.schema.get_field_index("token_rewards"), "token_rewards", rewards)
    result, _, _ = run("dr_grpo", batch)
    assert result.columns["advantages"].to_pylist() == [[0.5], [-0.5], [0.0, 0.0]]
