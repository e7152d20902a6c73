"""The eval DAG (``eval:``), planned with the step DAG: which nodes an evaluation runs, with which params.

An evaluation runs the rollout side of the step DAG on validation prompts: the node that generates, every
scorer, the nodes ``eval.nodes`` names, and every node those wait for, in the step's order. Each is a copy
of its training node named ``eval.<node>`` (so its lineage records, child run and trace spans say eval) with
``eval.params[<node>]`` merged over its params and validated by the same params model. Nothing here runs
anything; errors name the ``eval`` field and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from pydantic import BaseModel

from rlpipe.errors import ConfigError
from rlpipe.registry import registry

PREFIX = "eval."
"""Node names of the eval DAG: ``eval.<training node>``."""


@dataclasses.dataclass
class EvalPlan:
    """The checked eval DAG."""

    nodes: list[Any]
    """Copies of the plan's nodes (PlannedNode), renamed ``eval.<name>``, in run order."""
    samples_per_prompt: int
    """The eval generate node's ``n``: the k of mean@k and pass@k."""
    temperature: float
    """The eval generate node's sampling temperature (what the other stages are told it was)."""


def plan_eval(config, plan, validate_params: Callable[[type[BaseModel], dict, str], BaseModel]) -> EvalPlan | None:
    """The eval DAG of ``config.eval`` over ``plan`` (None without ``eval:``); ConfigError naming the field."""
    spec = config.eval
    if spec is None:
        return None
    if not registry("mode").get(plan.mode_name).evaluates:
        raise ConfigError(f"eval: mode {plan.mode_name!r} does not run evaluations; remove the eval section or use "
                          "mode: sync, colocate_async or separate_async")
    by_name = {n.name: n for n in plan.nodes}
    for name in [*spec.nodes, *spec.params]:
        if name not in by_name:
            raise ConfigError(f"eval: names node {name!r}, which the pipeline does not have; its nodes: "
                              f"{', '.join(by_name)}")
    generate = plan.anchor("generates")
    wanted = {generate.name, *(n.name for n in plan.with_role("scores")), *spec.nodes}
    todo = list(wanted)
    while todo:  # and everything they wait for
        for upstream in by_name[todo.pop()].depends_on:
            if upstream not in wanted:
                wanted.add(upstream)
                todo.append(upstream)
    trainer_side = sorted(n for n in wanted if by_name[n].step_role in ("updates_policy", "pushes_weights"))
    if trainer_side:
        raise ConfigError(f"eval: node(s) {', '.join(trainer_side)} would change the weights; an evaluation never "
                          "trains: drop them from eval.nodes")
    nodes = [_eval_copy(n, spec.params.get(n.name, {}), validate_params) for n in plan.nodes if n.name in wanted]
    eval_generate = next(n for n in nodes if n.name == PREFIX + generate.name)
    return EvalPlan(nodes, int(getattr(eval_generate.params, "n", 1)),
                    float(getattr(eval_generate.params, "temperature", 1.0)))


def _eval_copy(node, override: dict, validate_params) -> Any:
    params = node.params
    if override:
        params = validate_params(node.spec.params_model, {**node.params_dict, **override}, f"eval.params.{node.name}")
    rename = {**{k: PREFIX + k for k in node.depends_on}}
    copy = dataclasses.replace(
        node, name=PREFIX + node.name, params=params, reads=node.spec.read_columns(params),
        writes=node.spec.write_columns(params),
        providers={c: rename.get(p, p) for c, p in node.providers.items()},
        depends_on={PREFIX + k: why for k, why in node.depends_on.items()}, after=())
    return copy
