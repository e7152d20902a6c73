"""The DAPO filter_groups stage: drops uninformative groups, reports evictions."""

import pyarrow as pa
import pytest

from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages.filter_groups import FilterGroupsParams, filter_groups

CTX = StageContext(step=0, seed=0)


def batch():
    return pa.table({
        "uid": ["a", "a", "b", "b", "c", "c", "c", "d"],
        "status": ["ok", "ok", "ok", "failed", "ok", "ok", "failed", "ok"],
        "reward": pa.array([1, 1, 1, 0, 0, 1, None, 1], pa.float32()),
    })  # fmt: skip


def test_keeps_only_informative_groups_and_counts_evictions():
    result = filter_groups(batch(), FilterGroupsParams(), CTX)
    # a: equal rewards; b: one valid row; d: a single row; c: informative (its failed row is dropped)
    assert result.keep.tolist() == [4, 5]
    assert result.metrics["filter_groups/evicted_groups"] == 3.0
    assert result.metrics["filter_groups/evicted_no_variance"] == 1.0
    assert result.metrics["filter_groups/evicted_single_valid"] == 2.0
    assert result.metrics["filter_groups/refill_groups"] == 6.0


def test_failed_rows_of_kept_groups_can_stay():
    result = filter_groups(batch(), FilterGroupsParams(drop_failed=False, refill_factor=1), CTX)
    assert result.keep.tolist() == [4, 5, 6]
    assert result.metrics["filter_groups/refill_groups"] == 3.0


def test_contract():
    spec = stage_registry("filter_groups").get("dapo")
    assert set(spec.read_columns(FilterGroupsParams(metric="acc"))) == {"uid", "status", "acc"}
    assert spec.write_columns(FilterGroupsParams()) == {}
    with pytest.raises(ValueError):
        FilterGroupsParams(refill_factor=0)
