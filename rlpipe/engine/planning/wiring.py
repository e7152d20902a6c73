"""Wiring the step DAG: edges from the column contracts, one order from the edges.

Each node reads its declared columns and the row set it runs on (:data:`ROWS`); it writes its declared
columns and, when it is a barrier (its kind's ``barrier``, or an implementation that creates rows), the
row set. The prompt source provides the prompt columns and the first row set. Then:

* a reader depends on the writer of each column it reads: the last writer listed before it in the
  YAML, else the prompt source when that provides the column, else the column's one writer wherever
  it is listed (two or more: the YAML cannot say which, an error);
* a later writer of a column depends on the earlier one and must replace its values knowingly: it
  reads the column itself (a transform, e.g. a length penalty on ``token_level_rewards``) or names the
  earlier writer in ``after:``; otherwise two writers are an error, as before;
* a writer runs after every reader of the version it replaces (so a reward node listed before the
  filter sees the unfiltered rows, and the trainer's log-probs are taken before the update);
* state that is not a column (a model's weights, by the kinds' ``reads_state`` / ``writes_state`` /
  ``reads_updated_state``) orders its readers before every node that changes it, or after them, whatever
  the YAML order; the nodes that change it run in YAML order;
* ``after: [node, ...]`` adds edges by hand.

The order is the YAML order wherever the edges allow it (among nodes ready to run, the one listed
first), so a pipeline whose YAML lists its nodes in a valid order runs them in that order. Nothing
here needs Ray or a model; errors name the nodes, the column and the fix.
"""

from __future__ import annotations

import difflib
import heapq
from typing import Any, Callable

import pyarrow as pa

from rlpipe.errors import PlanError
from rlpipe.stage_kinds import get_kind

SOURCE = "<prompts>"
"""Provider name of what the prompt source (data loader) supplies."""
ROWS = "<rows>"
"""The pseudo-column of the row set a node runs on."""


def _effective(node) -> tuple[dict[str, Any], dict[str, Any]]:
    kind = get_kind(node.kind)
    writes: dict[str, Any] = dict(node.writes)
    if kind.barrier or node.spec.creates_rows:
        writes[ROWS] = None
    return {**node.reads, ROWS: None}, writes


def _state_edges(nodes: list, edge: Callable[[str, str, str], None]) -> None:
    kinds = {n.name: get_kind(n.kind) for n in nodes}
    states = {s for k in kinds.values() for s in (*k.reads_state, *k.reads_updated_state, *k.writes_state)}
    for state in sorted(states):
        changers = [n.name for n in nodes if state in kinds[n.name].writes_state]
        for earlier, later in zip(changers, changers[1:]):
            edge(earlier, later, f"changes state {state} after it")
        for node in nodes:
            for changer in changers:
                if state in kinds[node.name].reads_state:
                    edge(node.name, changer, f"{node.name} reads state {state} before it changes")
                if state in kinds[node.name].reads_updated_state:
                    edge(changer, node.name, f"reads state {state} once changed")


def wire(nodes: list, source_columns: dict[str, pa.DataType],
         registered_writers: Callable[[str], list[str]] = lambda column: []) -> list:
    """Set each node's ``providers`` (read column → node name or SOURCE) and ``depends_on`` (node name →
    why); returns the nodes in execution order. ``nodes`` are in YAML order; raises PlanError naming the
    nodes and the fix."""
    effective = {n.name: _effective(n) for n in nodes}
    by_name = {n.name: n for n in nodes}
    position = {n.name: i for i, n in enumerate(nodes)}
    provided = {**source_columns, ROWS: None}
    writers: dict[str, list[str]] = {}
    for node in nodes:
        for column in effective[node.name][1]:
            writers.setdefault(column, []).append(node.name)
    for node in nodes:
        node.depends_on = {}

    def edge(before: str, after: str, why: str) -> None:
        if before != after and before != SOURCE:
            by_name[after].depends_on.setdefault(before, why)

    version: dict[tuple[str, str], str] = {}
    """(reader, column) → the writer (or SOURCE) of the version it reads."""
    for node in nodes:
        for column, wanted in effective[node.name][0].items():
            others = [w for w in writers.get(column, []) if w != node.name]
            earlier = [w for w in others if position[w] < position[node.name]]
            pseudo = column.startswith("<")
            if earlier:
                provider = earlier[-1]
            elif column in provided or pseudo:
                provider = SOURCE
            elif len(others) == 1:
                provider = others[0]
            elif not others:
                writers_hint = registered_writers(column)
                hint = f"; add a stage that writes it: {', '.join(writers_hint)}" if writers_hint else ""
                raise PlanError(f"{_named(node)} reads column {column!r} but no stage writes it{hint}")
            else:
                raise PlanError(
                    f"{_named(node)} reads column {column!r}, which {', '.join(others)} all write, and is listed "
                    f"before them: list it after the writer whose values it reads (the last one before it wins)")
            version[(node.name, column)] = provider
            if not pseudo:
                have = provided[column] if provider == SOURCE else by_name[provider].writes[column]
                if have != wanted:
                    raise PlanError(f"type mismatch on column {column!r}: {provider} writes {have} but "
                                    f"{_named(node)} reads {wanted}")
                node.providers[column] = provider
            edge(provider, node.name, _why_read(column))
    for column, chain in writers.items():
        for earlier, later in zip(chain, chain[1:]):
            if not column.startswith("<") and column not in effective[later][0] and \
                    earlier not in by_name[later].after:
                raise PlanError(
                    f"two writers of column {column!r}: {_named(by_name[earlier])} and {_named(by_name[later])}; "
                    f"remove one, or give {later} `after: [{earlier}]` if it is meant to replace those values")
            edge(earlier, later, f"replaces {_shown(column)}")
        for later in chain:  # a writer runs after every reader of the version it replaces
            for (reader, read_column), provider in version.items():
                if read_column == column and reader != later and \
                        (provider == SOURCE or position[provider] < position[later]):
                    edge(reader, later, f"{reader} reads the {_shown(column)} it replaces")
    _state_edges(nodes, edge)
    for node in nodes:
        for name in node.after:
            if name not in by_name:
                close = difflib.get_close_matches(name, list(by_name), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the nodes are {', '.join(by_name)}"
                raise PlanError(f"stages[{node.name}].after names {name!r}, which is no node of the pipeline{hint}")
            edge(name, node.name, "after:")
    return _ordered(nodes, position)


def _ordered(nodes: list, position: dict[str, int]) -> list:
    """Kahn's topological order, the node listed first among those ready; PlanError naming a cycle."""
    waiting = {n.name: set(n.depends_on) for n in nodes}
    dependents: dict[str, list[str]] = {n.name: [] for n in nodes}
    for n in nodes:
        for upstream in n.depends_on:
            dependents[upstream].append(n.name)
    ready = [(position[name], name) for name, deps in waiting.items() if not deps]
    heapq.heapify(ready)
    order = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for down in dependents[name]:
            waiting[down].discard(name)
            if not waiting[down]:
                heapq.heappush(ready, (position[down], down))
    if len(order) < len(nodes):
        raise PlanError(_cycle_message({n.name: n for n in nodes}, set(waiting) - set(order)))
    by_name = {n.name: n for n in nodes}
    return [by_name[name] for name in order]


def _cycle_message(by_name: dict[str, Any], stuck: set[str]) -> str:
    start = min(stuck)
    path, seen = [start], {start}
    while True:  # every stuck node waits on a stuck node: walk back until a node repeats
        node = by_name[path[-1]]
        upstream = sorted(u for u in node.depends_on if u in stuck)[0]
        if upstream in seen:
            cycle = path[path.index(upstream):] + [upstream]
            break
        path.append(upstream)
        seen.add(upstream)
    cycle.reverse()  # upstream first
    steps = [f"{b} needs {a} ({by_name[b].depends_on[a]})" for a, b in zip(cycle, cycle[1:])]
    return (f"cycle in the step DAG: {'; '.join(steps)}. A stage cannot depend on its own output: change what "
            "one of them reads or writes, or move it in the YAML (the YAML order decides which version of a "
            "replaced column or row set a node sees)")


def _why_read(column: str) -> str:
    return "its rows" if column == ROWS else f"reads {_shown(column)}"


def _shown(column: str) -> str:
    return "row set" if column == ROWS else f"column {column!r}"


def _named(node) -> str:
    return f"{node.name} ({node.kind}/{node.impl})"
