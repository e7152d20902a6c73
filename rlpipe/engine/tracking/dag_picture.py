"""A picture of a run's step DAG with its call groups, as one self-contained SVG (``plan_dag.svg`` in MLflow).

Drawn from ``plan_summary.json`` alone (:meth:`rlpipe.engine.planning.plan.Plan.summary` plus
``physical_plan``), so any recorded run can be drawn again. Left to right in run order: each remote call is
a box around the nodes it runs, labelled with where it runs; a call that starts beside the one before it (a
concurrent branch) is drawn below it, in the same columns; a call that hands its table straight to the next
one has a ``→`` on its label. Nodes that run outside the parts the executor walks (separate_async's rollout
replicas run the nodes before the guard) come first, in a group of their own. Arcs above the boxes are the
DAG's edges (a node waits for another: a column it reads, its rows, model state); hovering one shows why.
Without a physical plan (an inline run) every node is its own call. Plain string building: no graphviz.
"""

from __future__ import annotations

from html import escape
from typing import Any

NODE_H, GAP, CALL_PAD, ROW_H, PART_GAP, FOOTER = 40, 14, 8, 96, 36, 24
KIND_COLOURS = {"task": "#e8f1fb", "worker": "#fdf0dc", "driver": "#eaf6e6"}
"""Node fill by placement."""
MAX_LIFT = 60
"""How high an arc rises above its nodes at most (it stays below the part titles)."""


def _width(node: dict[str, Any]) -> float:
    """A node box wide enough for its name (bold) and its kind/impl (12px sans-serif, by character count)."""
    return max(96.0, 7.6 * len(node["name"]), 6.8 * len(f"{node['kind']}/{node['impl']}")) + 12


def _layout(summary: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, tuple[float, float]], float, float]:
    """The boxes to draw (calls and part titles) and each node's top-left corner."""
    parts = summary.get("physical_plan") or [{"part": "the step", "calls": [
        {"nodes": [n["name"]], "where": n.get("role") or n.get("placement", "task"), "hands_on": False,
         "beside": False} for n in summary["nodes"]]}]
    widths = {n["name"]: _width(n) for n in summary["nodes"]}
    placed = {name for part in parts for call in part["calls"] for name in call["nodes"]}
    elsewhere = [n["name"] for n in summary["nodes"] if n["name"] not in placed]
    if elsewhere:
        parts = [{"part": "on the rollout replicas, before the guard", "calls": [
            {"nodes": elsewhere, "where": "rollout replicas", "hands_on": False, "beside": False}]}, *parts]
    boxes, corner, x, y_top = [], {}, GAP, GAP + 70.0  # room above for the arcs
    width = height = 0.0
    for part in parts:
        boxes.append({"title": part["part"], "x": x, "y": GAP})
        x_part = x
        row_start, row = x, 0
        for call in part["calls"]:
            row = row + 1 if call["beside"] else 0  # each concurrent branch one row below the one before it
            start = row_start if call["beside"] else x
            left = start
            for name in call["nodes"]:
                corner[name] = (left + CALL_PAD, y_top + row * ROW_H + 18)
                left += widths[name] + GAP
            right = left - GAP + 2 * CALL_PAD
            boxes.append({"call": call, "x": start, "y": y_top + row * ROW_H, "w": right - start,
                          "h": NODE_H + 18 + CALL_PAD})
            if not call["beside"]:
                row_start = start
            x = max(x, right + GAP)
            height = max(height, y_top + row * ROW_H + NODE_H + 18 + CALL_PAD)
        width = max(width, x)
        x = max(x, x_part) + PART_GAP
    return boxes, corner, width + GAP, height + GAP + FOOTER


def dag_svg(summary: dict[str, Any]) -> str:
    """The SVG text of the step DAG of ``summary`` (a run's ``plan_summary.json``)."""
    boxes, corner, width, height = _layout(summary)
    nodes = {n["name"]: n for n in summary["nodes"]}
    widths = {name: _width(node) for name, node in nodes.items()}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'font-family="sans-serif" font-size="12">',
           '<defs><marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" '
           'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#777"/></marker></defs>',
           f'<text x="{GAP}" y="{height - 4:.0f}" fill="#666">{escape(summary.get("mode", ""))} mode: boxes are '
           'remote calls (where they run); arcs are the DAG&apos;s edges</text>']
    for box in boxes:
        if "title" in box:
            out.append(f'<text x="{box["x"]:.0f}" y="{box["y"] + 12:.0f}" font-weight="bold">'
                       f'{escape(box["title"])}</text>')
            continue
        call = box["call"]
        label = call["where"] + (" →" if call["hands_on"] else "") + ("  (beside the call above)" if call["beside"]
                                                                      else "")
        out.append(f'<g class="call"><rect x="{box["x"]:.0f}" y="{box["y"]:.0f}" width="{box["w"]:.0f}" '
                   f'height="{box["h"]:.0f}" rx="8" fill="none" stroke="#4a6fa5" stroke-dasharray="4 3"/>'
                   f'<text x="{box["x"] + CALL_PAD:.0f}" y="{box["y"] + 13:.0f}" fill="#4a6fa5">'
                   f'{escape(label)}</text></g>')
    for name, (x, y) in corner.items():
        node = nodes[name]
        placement = node.get("placement", "task")
        fill = KIND_COLOURS.get(placement, "#eee")
        out.append(f'<g class="node"><title>{escape(name)}: {escape(node["kind"])}/{escape(node["impl"])} on '
                   f'{escape(placement)}; writes {escape(", ".join(node.get("writes", ())) or "nothing")}</title>'
                   f'<rect x="{x:.0f}" y="{y:.0f}" width="{widths[name]:.0f}" height="{NODE_H}" rx="5" fill="{fill}" '
                   f'stroke="#555"/><text x="{x + 6:.0f}" y="{y + 16:.0f}" font-weight="bold">{escape(name)}</text>'
                   f'<text x="{x + 6:.0f}" y="{y + 32:.0f}" fill="#555">{escape(node["kind"])}/'
                   f'{escape(node["impl"])}</text></g>')
    for name, node in nodes.items():
        for upstream, why in node.get("depends_on", {}).items():
            if upstream not in corner or name not in corner:
                continue
            (x1, y1), (x2, y2) = corner[upstream], corner[name]
            a, b = (x1 + widths[upstream] * 0.6, y1), (x2 + widths[name] * 0.4, y2)
            lift = min(18 + 0.12 * abs(b[0] - a[0]), MAX_LIFT)
            out.append(f'<path class="edge" d="M{a[0]:.0f},{a[1]:.0f} C{a[0]:.0f},{min(a[1], b[1]) - lift:.0f} '
                       f'{b[0]:.0f},{min(a[1], b[1]) - lift:.0f} {b[0]:.0f},{b[1]:.0f}" fill="none" stroke="#777" '
                       f'marker-end="url(#arrow)"><title>{escape(name)} waits for {escape(upstream)}: '
                       f'{escape(str(why))}</title></path>')
    out.append("</svg>")
    return "\n".join(out)
