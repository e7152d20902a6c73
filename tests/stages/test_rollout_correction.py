"""The rollout_correction stage: IS adds a column, RS edits the mask, metrics always; bypass validation."""

import math

import pyarrow as pa
import pytest
from pydantic import ValidationError

from rlpipe.errors import BatchError
from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages.algos.batch_io import require_rollout_logprobs
from rlpipe.stages.rollout_correction import RolloutCorrectionParams, rollout_correction

CTX = StageContext(step=0, seed=0)
F32 = pa.list_(pa.float32())


def batch(rollout=None):
    return pa.table({
        "response_mask": pa.array([[1, 1, 0], [1, 1]], pa.list_(pa.int8())),
        "old_logprobs": pa.array([[-1.0, -1.0, -1.0], [-1.0, -1.0]], F32),
        "rollout_logprobs": rollout if rollout is not None else pa.array(
            [[-1.0 - math.log(2), -1.0, -5.0], [-1.0, -1.0 - math.log(4)]], F32),
    })  # fmt: skip


def test_is_only_adds_a_weight_column():
    b = batch()
    result = rollout_correction(b, RolloutCorrectionParams(rollout_is="token"), CTX)
    assert set(result.columns) == {"is_weights"}
    assert result.columns["is_weights"].to_pylist() == [pytest.approx([2.0, 1.0, 0.0]), pytest.approx([1.0, 2.0])]
    for key in ("kl", "k3_kl", "ppl_ratio", "log_ppl_diff", "chi2_token", "chi2_seq", "rollout_is_eff_sample_size"):
        assert f"rollout_correction/{key}" in result.metrics


def test_rs_only_edits_the_mask_and_never_unmasks():
    b = batch()
    before = b.to_pydict()
    params = RolloutCorrectionParams(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold=3.0)
    result = rollout_correction(b, params, CTX)
    assert set(result.columns) == {"response_mask"}
    assert result.columns["response_mask"].type == pa.list_(pa.int8())
    assert result.columns["response_mask"].to_pylist() == [[1, 1, 0], [1, 0]]  # ρ = 4 > 3 rejected
    assert result.metrics["rollout_correction/rollout_rs_masked_fraction"] == pytest.approx(1 / 4)
    assert b.to_pydict() == before


def test_write_contract_follows_the_params():
    spec = stage_registry("rollout_correction").get("default")
    assert set(spec.write_columns(RolloutCorrectionParams())) == {"is_weights"}
    both = RolloutCorrectionParams(rollout_rs="seq_max_k2", rollout_rs_threshold=0.1)
    assert set(spec.write_columns(both)) == {"is_weights", "response_mask"}
    assert set(spec.write_columns(RolloutCorrectionParams(rollout_is=None))) == set()


@pytest.mark.parametrize("params", [
    {"rollout_rs": "token_k1"}, {"rollout_rs": "seq_foo_k2", "rollout_rs_threshold": 1},
    {"rollout_is_threshold": "2_1"}, {"rollout_is": "tokens"},
])  # fmt: skip
def test_bad_params_say_what_to_do(params):
    with pytest.raises(ValidationError):
        RolloutCorrectionParams(**params)


def test_missing_rollout_logprobs_is_a_clear_error():
    nulls = pa.array([None, [-1.0, -1.0]], F32)
    with pytest.raises(BatchError, match="return sampled-token logprobs"):
        rollout_correction(batch(nulls), RolloutCorrectionParams(), CTX)
    no_column = batch().drop_columns(["rollout_logprobs"])
    with pytest.raises(BatchError, match="no such column"):
        require_rollout_logprobs(no_column)
    assert require_rollout_logprobs(batch()).shape == (2, 3)
