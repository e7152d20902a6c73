"""The staleness guard: proves the bound from recorded prompt steps, reports staleness and versions."""

import pyarrow as pa
import pytest

from rlpipe.errors import StageError
from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages.staleness_guard import StalenessGuardParams, staleness_guard


def batch(prompt_steps=(3, 3, 4, 5)):
    return pa.table({
        "uid": ["a", "a", "b", "c"],
        "prompt_step": pa.array(prompt_steps, pa.int32()),
        "token_versions": pa.array([[3, 3, 4], [3], [4, 5, 6], None], pa.list_(pa.int32())),
        "status": ["ok", "ok", "ok", "failed"],
    })  # fmt: skip


def ctx(step=5, bound=3, version=6):
    extras = {} if bound is None else {"max_staleness": bound}
    return StageContext(step=step, seed=0, policy_version=version, extras=extras)


def test_metrics_within_the_bound():
    m = staleness_guard(batch(), StalenessGuardParams(), ctx()).metrics
    # staleness = 5 − prompt_step + 1 → 3, 3, 2, 1
    assert (m["staleness_guard/staleness/min"], m["staleness_guard/staleness/max"]) == (1.0, 3.0)
    assert m["staleness_guard/staleness/mean"] == 2.25
    assert [m[f"staleness_guard/staleness/hist_{k}"] for k in (1, 2, 3)] == [1.0, 1.0, 2.0]
    # spans (max − min + 1) over rows with tokens: 2, 1, 3; the failed row has none
    assert (m["staleness_guard/versions_spanned/mean"], m["staleness_guard/versions_spanned/max"]) == (2.0, 3.0)
    assert m["staleness_guard/version_lag/max"] == 6 - 3


def test_a_row_beyond_the_bound_fails_the_step():
    expected = r"2 trajectories have staleness outside \[1, 2\] \(worst 3; uids \['a'\]\)"
    with pytest.raises(StageError, match=expected) as e:
        staleness_guard(batch(), StalenessGuardParams(), ctx(bound=2))
    assert (e.value.kind, e.value.impl, e.value.step) == ("staleness_guard", "max_staleness", 5)
    with pytest.raises(StageError, match="max_off_policy_threshold"):
        staleness_guard(batch(), StalenessGuardParams(max_staleness=1), ctx(bound=8))  # params override the mode


def test_a_prompt_from_the_future_fails_too():
    with pytest.raises(StageError, match=r"worst 0"):
        staleness_guard(batch((3, 3, 4, 6)), StalenessGuardParams(), ctx())


def test_needs_a_bound_and_prompt_steps():
    with pytest.raises(StageError, match="set params.max_staleness"):
        staleness_guard(batch(), StalenessGuardParams(), ctx(bound=None))
    assert staleness_guard(batch(), StalenessGuardParams(max_staleness=4), ctx(bound=None)).metrics
    with pytest.raises(StageError, match="no prompt_step"):
        staleness_guard(batch((3, None, 4, 5)), StalenessGuardParams(), ctx())


def test_empty_batch_and_contract():
    assert staleness_guard(batch().slice(0, 0), StalenessGuardParams(), ctx()).metrics == {}
    spec = stage_registry("staleness_guard").get("max_staleness")
    assert set(spec.read_columns(StalenessGuardParams())) == {"uid", "prompt_step", "token_versions", "status"}
    assert spec.write_columns(StalenessGuardParams()) == {} and spec.placement == "task"
    with pytest.raises(ValueError):
        StalenessGuardParams(max_staleness=0)



def test_version_lag_beyond_the_bound_names_the_cause():
    lagging = pa.table({
        "uid": ["a", "b"], "prompt_step": pa.array([4, 4], pa.int32()),
        "token_versions": pa.array([[3, 4], [4]], pa.list_(pa.int32())), "status": ["ok", "ok"],
    })  # fmt: skip
    strict = StageContext(step=5, seed=0, policy_version=5, extras={"max_staleness": 2, "max_version_lag": 1})
    with pytest.raises(StageError, match=r"2 versions behind the trainer's 5 \(bound 1\)"):
        staleness_guard(lagging, StalenessGuardParams(), strict)
    loose = StageContext(step=5, seed=0, policy_version=5, extras={"max_staleness": 2, "max_version_lag": 2})
    assert staleness_guard(lagging, StalenessGuardParams(), loose).metrics["staleness_guard/version_lag/max"] == 2.0
