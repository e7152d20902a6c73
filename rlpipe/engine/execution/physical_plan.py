"""The physical plan of a step on Ray: which remote calls run which nodes, where, and what overlaps.

Derived from the config alone (no Ray): :class:`StaticPlacement` answers what the Ray backend will
answer about the run's workers (how many a role has, which process hosts it), and the executor compiles
its calls on it with the same rules it follows when it runs (rlpipe.engine.execution.call_plan), so what
``rlpipe validate`` prints and the run logs to MLflow (``plan_summary.json``: ``physical_plan``) is the list
the executor walks.
"""

from __future__ import annotations

from typing import Any

from rlpipe.engine.state.roles import WORKER_ROLES, worker_processes


class StaticPlacement:
    """The Ray backend's answers about a run's workers, from the config: the executor's grouping rules run on it
    without starting anything."""

    shared_filesystem = True
    workers = None
    chains_tasks = True

    def __init__(self, config, roles: set[str]):
        self.task_stages_in_workers = config.resources.task_stages_in_workers
        processes = worker_processes(config, roles)
        self._hosted = {role: hosted for hosted in processes.values() for role in hosted}
        self._sizes = {host: WORKER_ROLES.get(host).size(config) for host in processes}

    def group_size(self, role: str) -> int:
        return self._sizes.get(self.host(role), 1)

    def host(self, role: str) -> str:
        return self._hosted.get(role, (role,))[0]

    def hosted_roles(self, role: str) -> tuple[str, ...]:
        return self._hosted.get(role, (role,))

    def group_nodes(self, role: str) -> list[str]:
        return []

    def overlap(self, work) -> bool:
        return False


def describe_calls(executor, nodes: list[Any]) -> list[dict[str, Any]]:
    """The calls one run of ``nodes`` makes, in order (``executor.calls``): ``nodes`` (names), ``where``
    (``rollout×1``, ``task``, ``driver`` ...), ``hands_on`` (its last table goes straight to the next call),
    ``beside`` (starts with the calls before it back to the last one that is not beside: a concurrent branch)."""
    return [_call(executor, call) for call in executor.calls(nodes)]


def _call(executor, call) -> dict[str, Any]:
    if call.worker_chain:
        placement = executor.backend
        where = f"{'+'.join(placement.hosted_roles(call.role))}×{placement.group_size(call.role)}"
    elif call.task_chain:
        where = "task"
    else:
        where = executor.where(call.nodes[0])
    return {"nodes": call.names, "where": where, "hands_on": call.hands_on, "beside": call.beside}


def format_calls(calls: list[dict[str, Any]]) -> list[str]:
    """One line per call, for the terminal."""
    lines = []
    leader = 0
    for k, call in enumerate(calls, 1):
        leader = leader if call["beside"] else k
        notes = [note for note, on in (("hands its table to the next call", call["hands_on"]),
                                       (f"runs beside call {leader}", call["beside"])) if on]
        lines.append(f"  {k}. {call['where']}: {', '.join(call['nodes'])}" + (f"  ({'; '.join(notes)})" if notes
                                                                                 else ""))
    return lines


def physical_plan(config, plan, roles: set[str]) -> list[dict[str, Any]]:
    """Per part of a step the executor runs as one sequence of calls (the modes split the DAG at their anchors):
    ``{"part": what, "calls": describe_calls(...)}``."""
    from rlpipe.engine.execution.executor import StepExecutor
    from rlpipe.engine.tracking.observer import NullObserver

    executor = StepExecutor(plan, StaticPlacement(config, roles), NullObserver(), "plan", config.seed,
                            concurrent_branches=config.resources.concurrent_branches)
    nodes = plan.nodes
    guard, selects = plan.anchor("guards_staleness"), plan.anchor("selects_groups")
    if guard is not None:
        parts = [("the trainer's nodes (each rollout replica runs the nodes before the guard on its groups)",
                  nodes[nodes.index(guard):])]
    elif selects is not None:
        cut = nodes.index(selects) + 1
        parts = [("generation, repeated until the step has its groups", nodes[:cut]), ("training", nodes[cut:])]
    else:
        parts = [("the step", nodes)]
    return [{"part": part, "calls": describe_calls(executor, part_nodes)} for part, part_nodes in parts]
