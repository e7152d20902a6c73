"""Concurrent branches of the step DAG: when the next worker chain may run beside the current call.

The executor runs the plan's nodes as calls (a worker's chain, a task, a node). Two consecutive calls run
at the same time when nothing orders them: no node of the second waits, directly or through other nodes,
on a node of the first (its columns, rows and model state: ``PlannedNode.depends_on``); they run in
different places (not one worker, which would take them one after the other anyway); neither holds a
driver node (a weight push changes the policy version the other's contexts carry) or a node with a mode
hook (which must fire between calls). The second is then started on the first's input and recorded on
the first's output: it reads nothing the first writes, so its results, and the lineage, are those of
running them in order. Pure functions of the plan and the placement: no Ray here.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable


def waits_on(nodes: Iterable[Any], upstream: set[str], by_name: dict[str, Any]) -> bool:
    """Whether a node of ``nodes`` waits, directly or through others of ``by_name``, on one named in
    ``upstream``."""
    seen: set[str] = set()
    todo = [dep for node in nodes for dep in node.depends_on]
    while todo:
        name = todo.pop()
        if name in upstream:
            return True
        if name not in seen and name in by_name:
            seen.add(name)
            todo.extend(by_name[name].depends_on)
    return False


def runs_beside(first: list[Any], first_host: str | None, second: list[Any], second_host: str | None,
                by_name: dict[str, Any], hooked: Callable[[Any], bool]) -> bool:
    """Whether the call ``second`` (a worker chain on ``second_host``) may run beside the call ``first``
    (on ``first_host``; None: Ray's task pool) — see the module docstring."""
    if second_host is None or first_host == second_host:
        return False
    if any(n.spec.placement == "driver" or hooked(n) for n in (*first, *second)):
        return False
    return not waits_on(second, {n.name for n in first}, by_name)
