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
    lora: Any = None
    """``trainer.lora`` or None: the embedded engine keeps the base and merges each pushed adapter; vLLM loads each
    push as an adapter of its own (rlpipe.inference.vllm_lora); the plan check refuses LoRA with SGLang."""
    mode_params: Any = None
    """The run's validated ``mode_params``: with ``lora``, vLLM's adapter slots follow the mode's staleness bound."""


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine: how to build it, and the params model of its generate implementation."""

    build: Callable[[EngineInputs], RolloutEngine]


def _embedded(inputs: EngineInputs) -> RolloutEngine:
    from rlpipe.inference.embedded import EmbeddedEngine

    from rlpipe.backends.lora import MergedAdapter

    adapter = MergedAdapter(inputs.model, inputs.lora) if inputs.lora is not None else None
    return EmbeddedEngine(inputs.model, inputs.tokenizer, adapter=adapter)


ROLLOUT_ENGINES.add("embedded", EngineSpec(_embedded))
def _vllm(inputs: EngineInputs) -> RolloutEngine:
    from rlpipe.inference.vllm_build import build_vllm_engine

    return build_vllm_engine(inputs.model, inputs.tokenizer, inputs.params.server, inputs.rank, inputs.workdir,
                             lora=inputs.lora, mode_params=inputs.mode_params)


ROLLOUT_ENGINES.add("vllm", EngineSpec(_vllm))
def _sglang(inputs: EngineInputs) -> RolloutEngine:
    from rlpipe.inference.sglang_engine import build_sglang_engine

    return build_sglang_engine(inputs)


ROLLOUT_ENGINES.add("sglang", EngineSpec(_sglang))


def build_engine(impl: str, inputs: EngineInputs) -> RolloutEngine:
    """The engine ``impl`` (a ``generate`` implementation name) for one replica."""
    return ROLLOUT_ENGINES.get(impl).build(inputs)
