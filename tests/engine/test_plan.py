"""Planner checks that no shipped stage can trigger: a cycle and a column type mismatch.

The stages below are registered by this test module only (names start with ``plan_test_``).
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from conftest import quickstart_raw
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import SOURCE, build_plan
from rlpipe.errors import PlanError
from rlpipe.stage import StageResult, cols, stage


@stage("reward", "plan_test_reads_advantages", reads=cols("advantages"), writes={"bonus": pa.float32()})
def _reads_downstream(batch, params, ctx):
    return StageResult()


@stage("reward", "plan_test_reads_reward_as_int", reads={"reward": pa.int32()}, writes={})
def _reads_wrong_type(batch, params, ctx):
    return StageResult()


def _with(extra_stage: dict):
    raw = quickstart_raw()
    raw["stages"].append(extra_stage)
    return validate_config(raw)


def test_reading_a_column_only_a_later_stage_writes_is_a_cycle():
    config = _with({"kind": "reward", "impl": "plan_test_reads_advantages", "name": "bonus"})
    with pytest.raises(PlanError, match=r"cycle: bonus \(reward/plan_test_reads_advantages\) reads column "
                                        r"'advantages', which only advantage writes"):
        build_plan(config)


def test_type_mismatch_names_writer_reader_and_types():
    config = _with({"kind": "reward", "impl": "plan_test_reads_reward_as_int", "name": "needs_int"})
    with pytest.raises(PlanError, match=r"type mismatch on column 'reward': reward writes float .*needs_int "
                                        r"\(reward/plan_test_reads_reward_as_int\) reads int32"):
        build_plan(config)


def test_quickstart_is_wired_by_its_column_contracts():
    plan = build_plan(validate_config(quickstart_raw()))
    assert [n.kind for n in plan.nodes] == [
        "generate", "reward", "balance", "old_log_prob", "advantage", "update", "weight_sync"]
    by_name = {n.name: n for n in plan.nodes}
    assert by_name["generate"].providers["prompt_ids"] == SOURCE
    assert by_name["advantage"].providers["token_rewards"] == "reward"
    assert by_name["update"].providers["old_logprobs"] == "old_log_prob"
    assert by_name["update"].upstream == {"generate", "old_log_prob", "advantage"}
