"""The picture of a step DAG with its call groups (rlpipe.engine.tracking.dag_picture), drawn from a plan summary
as a run logs it: one box per node, one dashed box per remote call in run order, a concurrent branch below the call
it runs beside, one arc per DAG edge."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from rlpipe.engine.execution.physical_plan import physical_plan
from rlpipe.engine.host import run_thread_budget
from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.tracking.dag_picture import dag_svg

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


def _summary(pipeline: str, on_ray: bool = True):
    config, _ = load_pipeline(str(ROOT / "pipelines" / pipeline), [])
    plan = build_plan(config)
    summary = plan.summary()
    if on_ray:
        summary["physical_plan"] = physical_plan(config, plan, run_thread_budget(config, plan, inline=False)[0])
    return summary


def _drawn(svg: str):
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    groups = root.iter(f"{SVG}g")
    nodes, calls = {}, []
    for g in groups:
        rect = g.find(f"{SVG}rect")
        box = tuple(float(rect.get(k)) for k in ("x", "y", "width", "height"))
        if g.get("class") == "node":
            nodes[g.find(f"{SVG}text").text] = box
        else:
            calls.append((g.find(f"{SVG}text").text, box))
    edges = [p.find(f"{SVG}title").text for p in root.iter(f"{SVG}path") if p.get("class") == "edge"]
    return nodes, calls, edges


def _inside(inner, outer) -> bool:
    x, y, w, h = inner
    ox, oy, ow, oh = outer
    return ox <= x and oy <= y and x + w <= ox + ow and y + h <= oy + oh


def test_a_reference_branch_is_drawn_below_the_call_it_runs_beside_and_every_edge_once():
    summary = _summary("qwen05b_gsm8k_cpu.yaml")
    nodes, calls, edges = _drawn(dag_svg(summary))
    assert set(nodes) == {n["name"] for n in summary["nodes"]}
    plan_calls = summary["physical_plan"][0]["calls"]
    assert [label.split(" ")[0] for label, _ in calls] == [c["where"] for c in plan_calls]
    for (label, box), call in zip(calls, plan_calls):  # each call's box holds its nodes
        assert all(_inside(nodes[name], box) for name in call["nodes"]), label
    (_, old_log_prob), (beside_label, ref) = calls[1], calls[2]
    assert "beside the call above" in beside_label and ref[1] > old_log_prob[1] and ref[0] == old_log_prob[0]
    wanted = {(n["name"], upstream) for n in summary["nodes"] for upstream in n["depends_on"]}
    assert {tuple(re.match(r"(\S+) waits for (\S+):", e).groups()) for e in edges} == wanted
    assert len(edges) == len(wanted)


def test_nodes_outside_the_executors_parts_and_an_inline_run_are_drawn_too():
    nodes, calls, _ = _drawn(dag_svg(_summary("quickstart_async.yaml")))
    assert calls[0][0] == "rollout replicas" and _inside(nodes["generate"], calls[0][1])  # before the guard
    inline = _summary("quickstart.yaml", on_ray=False)
    nodes, calls, edges = _drawn(dag_svg(inline))
    assert len(calls) == len(nodes) == len(inline["nodes"]) and edges
