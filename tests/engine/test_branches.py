"""When the next worker chain runs beside the current call (rlpipe.engine.execution.branches): pure functions of a
real plan and where its calls run."""

from __future__ import annotations

from conftest import quickstart_raw, with_reference
from rlpipe.engine.execution.branches import runs_beside, waits_on
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan


def _plan():
    """The quickstart with a reference model listed after old_log_prob and a KL loss that reads it."""
    plan = build_plan(validate_config(with_reference(quickstart_raw())))
    return plan, {n.name: n for n in plan.nodes}


def test_a_reference_chain_runs_beside_old_log_prob_on_another_worker():
    plan, n = _plan()
    assert [x.name for x in plan.nodes] == ["generate", "reward", "balance", "old_log_prob", "ref", "advantage",
                                            "update", "weight_sync"]
    assert runs_beside([n["old_log_prob"]], "actor", [n["ref"], n["advantage"]], "ref", n, lambda node: False)


def test_nothing_runs_beside_what_it_waits_on_or_on_the_same_worker():
    plan, n = _plan()
    no_hooks = lambda node: False  # noqa: E731
    # update reads old_logprobs and ref_logprobs: never beside either
    assert waits_on([n["update"]], {"old_log_prob"}, n) and waits_on([n["update"]], {"ref"}, n)
    assert not runs_beside([n["ref"], n["advantage"]], "ref", [n["update"]], "actor", n, no_hooks)
    # through another node: weight_sync waits on update, which waits on advantage
    assert waits_on([n["weight_sync"]], {"advantage"}, n)
    # one worker takes its calls one after the other: nothing to gain
    assert not runs_beside([n["old_log_prob"]], "actor", [n["ref"], n["advantage"]], "actor", n, no_hooks)
    # a task call beside nothing: the second must be a worker chain (it starts without waiting)
    assert not runs_beside([n["old_log_prob"]], "actor", [n["ref"], n["advantage"]], None, n, no_hooks)


def test_driver_nodes_and_hooked_nodes_keep_their_order():
    plan, n = _plan()
    assert not runs_beside([n["old_log_prob"]], "actor", [n["ref"], n["weight_sync"]], "ref", n, lambda node: False)
    hooked = lambda node: node.name == "advantage"  # noqa: E731 - a mode hook fires before it
    assert not runs_beside([n["old_log_prob"]], "actor", [n["ref"], n["advantage"]], "ref", n, hooked)

