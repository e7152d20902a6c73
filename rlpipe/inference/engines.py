"""Which rollout engine a replica runs: the ``rollout_engine`` registry.

``generate.impl`` names the engine (``embedded`` | ``vllm`` | ``sglang``); the
generate stage registers one implementation per engine, all running the same
function against :class:`~rlpipe.inference.contract.RolloutEngine`, and a
rollout replica builds its engine from the registry entry of the same name. An
engine's own settings (server flags, timeouts) sit in the stage params under
``server``, so nothing else in a pipeline YAML changes when the engine does.

An entry builds an engine from :class:`EngineInputs`. Server engines import their
client module only when built, so planning a pipeline never pays for them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from rlpipe.inference.contract import RolloutEngine
from rlpipe.registry import registry

ROLLOUT_ENGINES = registry("rollout_engine")


@dataclass(frozen=True)
class EngineInputs:
    """What a rollout replica hands an engine builder."""

    model: Any
    """The replica's initial policy (a transformers causal LM with the version-0 weights)."""
    tokenizer: Any
    """The policy tokenizer."""
    params: Any
    """The generate stage's validated params (engine settings under ``params.server``)."""
    rank: int
    """Replica index, for names and ports."""
    workdir: str
    """A directory path of this replica's own (not created: a server engine creates it and saves its model
    dir and its log there)."""
    name: str
    """How errors name the replica, e.g. ``rollout replica 0``."""


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine: how to build it, and the params model of its generate implementation."""

    build: Callable[[EngineInputs], RolloutEngine]


def _lazy(module: str, builder: str) -> Callable[[EngineInputs], RolloutEngine]:
    def build(inputs: EngineInputs) -> RolloutEngine:
        return getattr(importlib.import_module(module), builder)(inputs)

    return build


def _embedded(inputs: EngineInputs) -> RolloutEngine:
    from rlpipe.inference.embedded import EmbeddedEngine

    return EmbeddedEngine(inputs.model, inputs.tokenizer)


ROLLOUT_ENGINES.add("embedded", EngineSpec(_embedded))
ROLLOUT_ENGINES.add("vllm", EngineSpec(_lazy("rlpipe.inference.vllm_engine", "build_vllm_engine")))
ROLLOUT_ENGINES.add("sglang", EngineSpec(_lazy("rlpipe.inference.sglang_engine", "build_sglang_engine")))


def build_engine(impl: str, inputs: EngineInputs) -> RolloutEngine:
    """The engine ``impl`` (a ``generate`` implementation name) for one replica."""
    return ROLLOUT_ENGINES.get(impl).build(inputs)
