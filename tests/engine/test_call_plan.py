"""The calls a step makes, compiled before anything runs (rlpipe.engine.execution.call_plan): which nodes share a
call, which chain hands its table on, which starts beside the call before it. Pure functions of a real plan and a
placement written down here: no Ray."""

from __future__ import annotations

from conftest import quickstart_raw, with_reference
from rlpipe.engine.execution.call_plan import CallRules, compile_calls
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan


class Layout:
    """One worker per role unless ``sizes`` says otherwise; ``hosts`` maps roles that share a process."""

    def __init__(self, sizes=None, hosts=None):
        self.sizes, self.hosts = sizes or {}, hosts or {}

    def group_size(self, role):
        return self.sizes.get(role, 1)

    def host(self, role):
        return self.hosts.get(role, role)


def _nodes(with_ref: bool):
    raw = with_reference(quickstart_raw()) if with_ref else quickstart_raw()
    return build_plan(validate_config(raw)).nodes


def _shape(calls):
    return [(c.names, c.role, c.hands_on, c.beside) for c in calls]


def _rules(layout=None, hooked=lambda node: False, **options):
    return CallRules(layout or Layout(), options.pop("task_stages_in_workers", True), options.pop("chains_tasks", True),
                     hooked, **options)


def test_each_worker_runs_its_nodes_and_the_tasks_beside_them_in_one_call_handing_the_table_on():
    calls = compile_calls(_nodes(False), _rules())
    assert _shape(calls) == [(["generate", "reward", "balance"], "rollout", True, False),
                             (["old_log_prob", "advantage", "update", "weight_sync"], "actor", False, False)]


def test_a_reference_chain_starts_beside_old_log_prob_and_nothing_is_handed_past_it():
    calls = compile_calls(_nodes(True), _rules())
    # old_log_prob alone is a plain worker call, not a chain: the rollout's chain cannot hand it a table (only a
    # started chain takes one), so its table goes through the driver
    assert _shape(calls) == [(["generate", "reward", "balance"], "rollout", False, False),
                             (["old_log_prob"], None, False, False),
                             (["ref", "advantage"], "ref", False, True),
                             (["update", "weight_sync"], "actor", False, False)]
    assert [c.at for c in calls] == [0, 3, 4, 6]
    in_order = compile_calls(_nodes(True), _rules(concurrent_branches=False))
    assert [c.beside for c in in_order] == [False] * len(in_order)


def test_a_mode_hook_starts_a_call_of_its_own_and_stops_the_hand_on_before_it():
    hooked = lambda node: node.step_role == "updates_policy"  # noqa: E731 - colocate_async's release
    calls = compile_calls(_nodes(False), _rules(hooked=hooked))
    assert _shape(calls) == [(["generate", "reward", "balance"], "rollout", True, False),
                             (["old_log_prob", "advantage"], "actor", False, False),
                             (["update", "weight_sync"], "actor", False, False)]


def test_several_trainer_ranks_or_a_backend_without_chains_fall_back_to_task_chains_and_single_nodes():
    two_ranks = compile_calls(_nodes(False), _rules(Layout({"actor": 2})))
    assert _shape(two_ranks) == [(["generate", "reward", "balance"], "rollout", False, False),
                                 (["old_log_prob"], None, False, False), (["advantage"], None, False, False),
                                 (["update"], None, False, False), (["weight_sync"], None, False, False)]
    inline = compile_calls(_nodes(False), _rules(task_stages_in_workers=False, chains_tasks=False))
    assert [c.names for c in inline] == [[n.name] for n in _nodes(False)]
    tasks_only = compile_calls(_nodes(False), _rules(task_stages_in_workers=False))
    assert [c.names for c in tasks_only if c.task_chain] == [["reward", "balance"]]


def test_colocated_roles_share_one_call():
    calls = compile_calls(_nodes(False), _rules(Layout(hosts={"rollout": "actor"})))
    assert _shape(calls) == [([n.name for n in _nodes(False)], "rollout", False, False)]


def _ppo_nodes():
    """PPO with a critic and a reference model: ref and critic_values listed after old_log_prob, GAE reads the
    values, the KL loss the reference's log-probs."""
    raw = with_reference(quickstart_raw())
    stages = []
    for s in raw["stages"]:
        if s["kind"] == "advantage":
            stages.append({"kind": "critic_values", "impl": "critic"})
            s = {"kind": "advantage", "impl": "gae"}
        stages.append(s)
    raw["stages"] = stages + [{"kind": "critic_update", "impl": "ppo"}]
    return build_plan(validate_config(raw)).nodes


def test_the_reference_and_the_critic_start_beside_old_log_prob_each_on_its_own_worker():
    nodes = _ppo_nodes()
    assert [n.name for n in nodes][3:6] == ["old_log_prob", "ref", "critic_values"]
    calls = compile_calls(nodes, _rules())
    # ref alone is a chain of one (its role has one worker): three branches, one per worker, on one input
    assert _shape(calls)[1:4] == [(["old_log_prob"], None, False, False), (["ref"], "ref", False, True),
                                  (["critic_values", "advantage"], "critic", False, True)]
    assert [c.at for c in calls[1:4]] == [3, 4, 5]
    # the reference and the critic in one process: one chain of both, beside old_log_prob
    shared = compile_calls(nodes, _rules(Layout(hosts={"critic": "ref"})))
    assert [(c.names, c.beside) for c in shared[1:3]] == [(["old_log_prob"], False),
                                                          (["ref", "critic_values", "advantage"], True)]
    # two critic ranks: rows split by dp_rank, a plain call the driver waits on, after the branches
    two_ranks = compile_calls(nodes, _rules(Layout({"critic": 2, "actor": 2})))
    assert [(c.names, c.beside) for c in two_ranks[1:4]] == [(["old_log_prob"], False), (["ref"], True),
                                                             (["critic_values"], False)]
    # in one process (no worker chains) every call waits for the one before it
    inline = compile_calls(nodes, _rules(task_stages_in_workers=False, chains_tasks=False))
    assert not any(c.beside for c in inline)
