"""The planner wires the step DAG from the column contracts and the YAML (rlpipe.engine.planning.wiring).

Checked on the quickstart plus nodes of kinds and impls this module registers (names start with ``plan_test``):
the YAML order of single writers does not matter; a node that rewrites a column sits between its writer and its
readers; a writer runs after the readers of what it replaces; two writers, cycles, type mismatches, unknown kinds
and ``after:`` names are refused naming the nodes and the fix.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from conftest import quickstart_raw
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import SOURCE, build_plan
from rlpipe.errors import PlanError
from rlpipe.stage import StageResult, cols, stage
from rlpipe.stage_kinds import stage_kind

stage_kind("plan_test_rescale", doc="Test kind: rewrites token_rewards.")
stage_kind("plan_test_ping", doc="Test kind: reads pong, writes ping.")
stage_kind("plan_test_pong", doc="Test kind: reads ping, writes pong.")
stage_kind("plan_test_second_generator", doc="Test kind: plays the generates role.", step_role="generates")


@stage("plan_test_rescale", "halve", reads=cols("token_rewards"), writes=cols("token_rewards"))
def _halve(batch, params, ctx):
    return StageResult()


@stage("plan_test_rescale", "overwrite", reads=cols("response_mask"), writes=cols("token_rewards"))
def _overwrite(batch, params, ctx):
    return StageResult()


@stage("plan_test_ping", "x", reads={"pong": pa.float32()}, writes={"ping": pa.float32()})
def _ping(batch, params, ctx):
    return StageResult()


@stage("plan_test_pong", "x", reads={"ping": pa.float32()}, writes={"pong": pa.float32()})
def _pong(batch, params, ctx):
    return StageResult()


@stage("plan_test_second_generator", "x", reads={}, writes={})
def _second_generator(batch, params, ctx):
    return StageResult()


@stage("reward", "plan_test_reads_advantages", reads=cols("advantages"), writes={"bonus": pa.float32()})
def _reads_downstream(batch, params, ctx):
    return StageResult()


@stage("reward", "plan_test_reads_reward_as_int", reads={"reward": pa.int32()}, writes={})
def _reads_wrong_type(batch, params, ctx):
    return StageResult()


def _with(*extra_stages: dict, at: int | None = None):
    raw = quickstart_raw()
    for extra in extra_stages:
        raw["stages"].insert(len(raw["stages"]) if at is None else at, extra)
    return validate_config(raw)


def _names(plan) -> list[str]:
    return [n.name for n in plan.nodes]


QUICKSTART = ["generate", "reward", "balance", "old_log_prob", "advantage", "update", "weight_sync"]


def test_quickstart_is_wired_by_its_column_contracts():
    plan = build_plan(validate_config(quickstart_raw()))
    assert _names(plan) == QUICKSTART
    by_name = {n.name: n for n in plan.nodes}
    assert by_name["generate"].providers["prompt_ids"] == SOURCE
    assert by_name["advantage"].providers["token_rewards"] == "reward"
    assert by_name["update"].providers["old_logprobs"] == "old_log_prob"
    assert by_name["update"].upstream == {"generate", "old_log_prob", "advantage"}
    # state edges: the trainer's log-probs before the update that changes its weights, the push after it
    assert by_name["update"].depends_on["old_log_prob"] == "reads column 'old_logprobs'"
    assert by_name["weight_sync"].depends_on == {"generate": "its rows", "update": "reads state policy once changed"}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_yaml_order_of_nodes_that_replace_nothing_does_not_matter(seed):
    raw = quickstart_raw()
    # generate creates the rows and reward rewrites generate's status: the YAML order of those two says which
    # version the others see; the others replace nothing, so any order of theirs gives the same DAG
    head, rest = raw["stages"][:2], raw["stages"][2:]
    random.Random(seed).shuffle(rest)
    raw["stages"] = head + rest
    shuffled, listed = build_plan(validate_config(raw)), build_plan(validate_config(quickstart_raw()))
    assert {n.name: n.depends_on for n in shuffled.nodes} == {n.name: n.depends_on for n in listed.nodes}
    ran = _names(shuffled)
    assert all(ran.index(up) < ran.index(n.name) for n in shuffled.nodes for up in n.depends_on)


def test_a_node_that_rewrites_a_column_sits_between_its_writer_and_its_readers():
    plan = build_plan(_with({"kind": "plan_test_rescale", "impl": "halve", "name": "halve"}, at=2))
    assert _names(plan) == ["generate", "reward", "halve", "balance", "old_log_prob", "advantage", "update",
                            "weight_sync"]
    by_name = {n.name: n for n in plan.nodes}
    assert by_name["halve"].providers["token_rewards"] == "reward"
    assert by_name["advantage"].providers["token_rewards"] == "halve"


def test_a_reader_listed_before_a_rewrite_reads_the_first_version_and_runs_before_it():
    plan = build_plan(_with({"kind": "plan_test_rescale", "impl": "halve", "name": "halve"}))  # listed last
    by_name = {n.name: n for n in plan.nodes}
    assert by_name["advantage"].providers["token_rewards"] == "reward"
    assert by_name["halve"].depends_on["advantage"] == "advantage reads the column 'token_rewards' it replaces"
    assert _names(plan)[-1] == "halve"


def test_a_reader_of_a_downstream_column_runs_after_its_writer_wherever_it_is_listed():
    plan = build_plan(_with({"kind": "reward", "impl": "plan_test_reads_advantages", "name": "bonus"}, at=1))
    assert _names(plan).index("bonus") > _names(plan).index("advantage")
    assert {n.name: n for n in plan.nodes}["bonus"].providers["advantages"] == "advantage"


def test_two_writers_of_a_column_need_the_later_to_read_it_or_name_the_earlier():
    overwrite = {"kind": "plan_test_rescale", "impl": "overwrite", "name": "overwrite"}
    with pytest.raises(PlanError, match=r"two writers of column 'token_rewards': reward \(reward/rule\) and "
                                        r"overwrite \(plan_test_rescale/overwrite\); remove one, or give overwrite "
                                        r"`after: \[reward\]`"):
        build_plan(_with(overwrite, at=2))
    plan = build_plan(_with({**overwrite, "after": ["reward"]}, at=2))
    assert {n.name: n for n in plan.nodes}["advantage"].providers["token_rewards"] == "overwrite"


def test_a_cycle_names_its_nodes_and_columns():
    with pytest.raises(PlanError, match=r"cycle in the step DAG: pong needs ping \(reads column 'ping'\); "
                                        r"ping needs pong \(reads column 'pong'\)"):
        build_plan(_with({"kind": "plan_test_ping", "impl": "x", "name": "ping"},
                         {"kind": "plan_test_pong", "impl": "x", "name": "pong"}))


def test_reading_the_rows_a_later_barrier_replaces_while_needing_its_output_is_a_cycle():
    # listed before generate, the node runs on the prompts; it reads advantages, which need generate's rows
    with pytest.raises(PlanError, match=r"cycle in the step DAG: .*generate needs bonus \(bonus reads the row set "
                                        r"it replaces\)"):
        build_plan(_with({"kind": "reward", "impl": "plan_test_reads_advantages", "name": "bonus"}, at=0))


def test_type_mismatch_names_writer_reader_and_types():
    config = _with({"kind": "reward", "impl": "plan_test_reads_reward_as_int", "name": "needs_int"})
    with pytest.raises(PlanError, match=r"type mismatch on column 'reward': reward writes float .*needs_int "
                                        r"\(reward/plan_test_reads_reward_as_int\) reads int32"):
        build_plan(config)


def test_unknown_kind_after_name_and_a_second_generator_are_refused():
    with pytest.raises(PlanError, match=r"stages\[7:lp\]: unknown stage_kind 'lenght_penalty'.*known: .*advantage"):
        build_plan(_with({"kind": "lenght_penalty", "impl": "x", "name": "lp"}))
    with pytest.raises(PlanError, match=r"stages\[halve\]\.after names 'rewrd'.*did you mean 'reward'\?"):
        build_plan(_with({"kind": "plan_test_rescale", "impl": "halve", "name": "halve", "after": ["rewrd"]}))
    with pytest.raises(PlanError, match=r"stages generate, gen2 all play the step role 'generates'"):
        build_plan(_with({"kind": "plan_test_second_generator", "impl": "x", "name": "gen2"}))
