"""The calls a run of planned nodes makes, compiled once: the executor follows this list, and ``rlpipe
validate`` prints it (rlpipe.engine.execution.physical_plan).

A *call* is one round trip from the driver: a worker's chain (the nodes of the roles one worker hosts with
the task nodes next to them and, last, the driver nodes that say which roles they call), a chain of task
nodes as one Ray task, or a single node. Two decisions are made here, before anything runs, each a small
function of the nodes and the placement (no Ray):

* **hand on** — a worker chain gives its last table straight to the next worker chain (worker to worker,
  not through the driver) when the driver has nothing to do between them (no driver node in it, no mode
  hook before the next one);
* **beside** — the next worker chains start together with the current call when no path of the DAG joins
  any two of them and each runs in a place of its own (rlpipe.engine.execution.branches): ``ref`` on its
  worker and ``critic_values`` on the critic's while the trainer computes ``old_log_prob``. A lone node of a
  role with one worker starts as a chain of one for that.

The mode hooks (``StepExecutor.before_role``) are part of the input: a node with a hook starts a call of its
own, so the hook fires between calls, after the nodes before it are done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from rlpipe.engine.execution.branches import runs_beside


class Placement(Protocol):
    """What the call rules need to know about where the workers are (RayBackend, InlineBackend, or
    physical_plan.StaticPlacement from the config alone)."""

    def group_size(self, role: str) -> int: ...

    def host(self, role: str) -> str: ...


@dataclass(frozen=True)
class Call:
    """One remote call of a run: which nodes, where, and how it joins the calls around it."""

    nodes: tuple[Any, ...]
    """The planned nodes it runs, in plan order (each keeps its own lineage record)."""
    at: int
    """Index of its first node in the run's node list."""
    role: str | None = None
    """The worker role whose one worker runs the chain; None: a task chain or a single node."""
    hands_on: bool = False
    """Its last table goes straight to the next call (a worker chain), started at once."""
    beside: bool = False
    """It starts together with the calls before it back to the last call that is not ``beside`` (a concurrent
    branch), on that call's input."""

    @property
    def worker_chain(self) -> bool:
        return self.role is not None

    @property
    def task_chain(self) -> bool:
        return self.role is None and len(self.nodes) > 1

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]


@dataclass(frozen=True)
class CallRules:
    """The placement facts and the run's options the rules read."""

    placement: Placement
    task_stages_in_workers: bool
    """Task nodes may join a worker's chain (resources.task_stages_in_workers, on a backend that chains)."""
    chains_tasks: bool
    """The backend runs consecutive task nodes as one task."""
    hooked: Callable[[Any], bool]
    """Whether a mode hook fires before a node."""
    concurrent_branches: bool = True
    """Start the next worker chain beside the current call when nothing orders them."""


def fusable(nodes: Sequence[Any], i: int, rules: CallRules) -> tuple[list[Any], str | None]:
    """The nodes from ``nodes[i]`` that run as one call, and the role whose worker runs them (None: a task).

    A worker chain: task nodes and the nodes of the roles one worker hosts (one role, or the roles colocated
    with it), when it is the only worker of its roles (with more, rows are split by ``dp_rank``, which the task
    nodes before them may still be writing), and after them the driver nodes that declare the roles they call
    (a weight push as the trainer's last act). Otherwise the run of task nodes from ``nodes[i]``.
    ``([nodes[i]], None)`` when nothing fuses. A node with a mode hook starts a call of its own."""
    placement = rules.placement
    if rules.task_stages_in_workers:
        role = host = None
        j = i
        while j < len(nodes) and nodes[j].spec.placement in ("task", "worker", "driver"):
            if j > i and rules.hooked(nodes[j]):
                break
            spec = nodes[j].spec
            if spec.placement == "worker":
                if host is None and placement.group_size(spec.role) == 1:
                    role, host = spec.role, placement.host(spec.role)
                elif host is None or placement.host(spec.role) != host:
                    break
            elif spec.placement == "driver" and (host is None or not spec.calls):
                break  # a driver stage joins a worker's call only after that worker's nodes, and when it says which
                # roles it calls (the worker reaches them from there)
            j += 1
        if role is not None and j - i > 1:
            return list(nodes[i:j]), role
    if not rules.chains_tasks:
        return [nodes[i]], None
    j = i
    while j < len(nodes) and nodes[j].spec.placement == "task" and not (j > i and rules.hooked(nodes[j])):
        j += 1
    return (list(nodes[i:j]) if j - i > 1 else [nodes[i]]), None


def _is_worker_chain(group: list[Any], role: str | None) -> bool:
    return role is not None and len(group) > 1


def _startable(group: list[Any], role: str | None, rules: CallRules) -> str | None:
    """The role whose one worker can start ``group`` without the driver waiting (a worker chain; a lone node of a
    role with one worker, as a chain of one, where the backend runs worker chains), else None."""
    if _is_worker_chain(group, role):
        return role
    node = group[0]
    if (rules.task_stages_in_workers and len(group) == 1 and node.spec.placement == "worker"
            and rules.placement.group_size(node.spec.role) == 1 and not rules.hooked(node)):
        return node.spec.role
    return None


def _host(group: list[Any], role: str | None, rules: CallRules) -> str | None:
    worker = next((n for n in group if n.spec.placement == "worker"), None)
    return rules.placement.host(role or worker.spec.role) if worker is not None else None


def beside(nodes: Sequence[Any], running: list[tuple[list[Any], str | None]], following: list[Any],
           following_role: str | None, rules: CallRules) -> str | None:
    """The role whose worker starts the call ``following`` together with the ``running`` calls (each its nodes and
    its role), or None when it must wait for them (see rlpipe.engine.execution.branches)."""
    role = _startable(following, following_role, rules) if rules.concurrent_branches else None
    if role is None:
        return None
    by_name = {n.name: n for n in nodes}
    host = rules.placement.host(role)
    together = all(runs_beside(group, _host(group, group_role, rules), following, host, by_name, rules.hooked)
                   for group, group_role in running)
    return role if together else None


def hands_on(group: list[Any], following: list[Any], following_role: str | None, rules: CallRules) -> bool:
    """Whether the worker chain ``group`` gives its last table straight to the call after it, ``following``:
    that call is a worker chain without a mode hook, and nothing the driver does after ``group`` can change what
    the next one is given (no driver node in ``group``: a weight push bumps the policy version of the contexts)."""
    return (_is_worker_chain(following, following_role) and not rules.hooked(following[0])
            and all(n.spec.placement != "driver" for n in group))


def compile_calls(nodes: Sequence[Any], rules: CallRules) -> tuple[Call, ...]:
    """The calls one run of ``nodes`` makes, in order. The calls started beside another come right after it;
    a chain handed a table is never started beside anything (it already started, on its own input)."""
    calls: list[Call] = []
    i, handed = 0, False
    while i < len(nodes):
        group, role = fusable(nodes, i, rules)
        after = i + len(group)
        running = [(group, role)]
        branches: list[Call] = []
        pair = None  # the call after this one and its branches (nodes, role)
        while after < len(nodes):
            pair = fusable(nodes, after, rules)
            starts_as = None if handed else beside(nodes, running, *pair, rules)
            if starts_as is None:
                break
            branches.append(Call(tuple(pair[0]), after, starts_as, False, True))
            running.append((pair[0], starts_as))
            after += len(pair[0])
            pair = None
        gives = (_is_worker_chain(group, role) and not branches and pair is not None
                 and hands_on(group, *pair, rules))
        calls.append(Call(tuple(group), i, role if _is_worker_chain(group, role) else None, gives))
        calls.extend(branches)
        i, handed = after, gives
    return tuple(calls)
