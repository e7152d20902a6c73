"""The mode interface: how executions of the step DAG are scheduled.

A mode is a class registered in the ``mode`` registry. The engine core never
branches on the mode's name: it validates the mode's ``Params``, calls
``check`` at plan time, then hands the run to ``run``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

from rlpipe.stage import NoParams

if TYPE_CHECKING:
    from rlpipe.engine.planning.plan import Plan
    from rlpipe.engine.runtime import Runtime
    from rlpipe.schemas.config import PipelineConfig


class Mode:
    """Base class of trainer modes."""

    Params: type[BaseModel] = NoParams
    """Params model of the mode (the YAML's `mode_params`)."""
    generates_while_training: bool = False
    """The rollout generates while the trainer trains (the async modes): their worker processes compute at
    the same time and share the CPUs (rlpipe.engine.host's thread budget)."""
    evaluates: bool = False
    """The mode runs the eval DAG (``eval:``) during training; ``rlpipe validate`` refuses ``eval:`` otherwise."""

    @classmethod
    def check(cls, config: "PipelineConfig", plan: "Plan") -> None:
        """Raise PlanError/ConfigError when the config violates the mode's constraints."""

    @classmethod
    def roles(cls, config: "PipelineConfig") -> set[str]:
        """Worker roles the mode needs beyond those the plan's stages run on."""
        return set()

    def __init__(self, runtime: "Runtime", params: BaseModel):
        self.runtime = runtime
        self.params = params

    def run(self) -> None:
        """Drive the global steps from ``runtime.start_step`` to ``trainer.total_steps``."""
        raise NotImplementedError
