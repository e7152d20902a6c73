"""Settings of the agent loops: ``generate.params.agent_loop`` and ``generate.params.gateway``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlpipe.agents.http_guard import GatewayLimits
from rlpipe.agents.parsers import TOOL_PARSERS
from rlpipe.agents.programs import AGENT_PROGRAMS
from rlpipe.agents.tools import TOOLS
from rlpipe.schemas.config import Strict


class AgentLoopParams(Strict):
    """The multi-turn tool agent (``generate.params.agent: tool_agent``)."""

    tools: list[str] = Field(default_factory=lambda: ["calculator"], min_length=1)
    """Tools the model may call, by registered name (built-ins: calculator, python, latency, lookup); the first
    is the default tool of the `compact` and `trigger` formats."""
    tool_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per-tool settings by tool name, e.g. `{python: {cpu_s: 2, wall_s: 5, memory_mb: 256}}`."""
    parser: str = "hermes"
    """Tool-call format: `hermes` (`<tool_call>{json}</tool_call>`), `compact` (`[expr]`, `[tool:text]`) or
    `trigger` (`!` calls the default tool with the prompt's operand), see rlpipe.agents.parsers."""
    stop_at_call: bool = False
    """End a model turn at the call format's closing character (`]` compact, `!` trigger) as well as at eos,
    so a call needs no eos after it (the engine's `stop_token_ids`); `hermes` calls always end at eos."""
    max_turns: int = Field(4, ge=1)
    """Most model turns per trajectory; a turn that still calls a tool at this count ends it (`max_turns`)."""
    max_calls_per_turn: int = Field(4, ge=1)
    """Most tool calls run per turn; calls past it are answered with an error observation."""
    max_observation_tokens: int = Field(64, ge=1)
    """Most tokens of one turn's observation (all its tool outputs); longer ones are truncated."""
    observation_truncation: Literal["left", "right"] = "right"
    """Which side of a long observation is cut: `right` keeps its start, `left` keeps its end."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """A call still running after this long is answered with a timeout error (its thread is left to finish)."""
    tool_workers: int = Field(8, ge=1)
    """Threads running tool calls (several calls of one turn run concurrently)."""
    on_tool_error: Literal["observe", "terminate"] = "observe"
    """A failed call (unknown tool, malformed call, the tool's own error): `observe` shows the model the error
    and continues; `terminate` ends the trajectory with termination `tool_error`."""

    @model_validator(mode="after")
    def _known_parts(self) -> "AgentLoopParams":
        """Tools, their settings and the parser are checked here, before anything runs."""
        if self.parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {self.parser!r}; known: {', '.join(TOOL_PARSERS.names())}")
        unknown = sorted(set(self.tools) - set(TOOLS.names()))
        if unknown:
            raise ValueError(f"unknown tool(s) {unknown}; known: {', '.join(TOOLS.names())}")
        stray = sorted(set(self.tool_settings) - set(self.tools))
        if stray:
            raise ValueError(f"tool_settings for {stray}, which are not in tools {self.tools}; add them to tools")
        for name, settings in self.tool_settings.items():
            try:
                TOOLS.get(name)(dict(settings))
            except TypeError as exc:
                raise ValueError(f"tool_settings.{name}: {exc}") from None
        return self


class GatewayAgentParams(Strict):
    """The black-box agent (``generate.params.agent: gateway``): a program talks to an OpenAI-compatible
    gateway in front of the rollout engine; each trajectory is one gateway session."""

    program: str | None = "calculator_client"
    """A registered agent program (registry `agent_program`) run in a thread per trajectory:
    `fn(base_url, api_key, prompt) -> None`. Built-in: calculator_client."""
    script: str | None = None
    """Instead of `program` (a script wins when both are set): a Python script run per trajectory as a subprocess with OPENAI_BASE_URL,
    OPENAI_API_KEY and the prompt on stdin (the base URL carries the session id)."""
    timeout_s: float = Field(120.0, gt=0)
    """A session whose program has not returned after this long ends; its trajectory is kept, status truncated."""
    max_session_tokens: int | None = Field(None, ge=1)
    """Cap on a session's tokens after its first prompt; None = the generate stage's max_tokens."""
    workers: int = Field(16, ge=1)
    """Programs running at once (threads)."""
    tool_parser: str = "hermes"
    """How the gateway reads tool calls in the model's text when a request lists `tools` (they are returned as
    OpenAI `tool_calls`): `hermes`, `compact` or `trigger` (see rlpipe.agents.parsers)."""

    limits: GatewayLimits = Field(default_factory=GatewayLimits)
    """Bounds of the gateway's HTTP server: largest body, read and keep-alive deadlines, concurrent handlers."""

    @model_validator(mode="after")
    def _runnable(self) -> "GatewayAgentParams":
        from pathlib import Path

        if self.limits.max_handlers < self.workers:
            raise ValueError(f"gateway.limits.max_handlers={self.limits.max_handlers} is below gateway.workers="
                             f"{self.workers}: programs past it would wait for a handler; raise max_handlers")
        if self.tool_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {self.tool_parser!r}; known: {', '.join(TOOL_PARSERS.names())}")

        if self.script is not None:
            if not Path(self.script).is_file():
                raise ValueError(f"gateway.script {self.script!r} is not a file (cwd {Path.cwd()})")
            return self
        if self.program is None:
            raise ValueError("set gateway.program (a registered agent program) or gateway.script")
        if self.program not in AGENT_PROGRAMS:
            raise ValueError(f"unknown agent program {self.program!r}; known: {', '.join(AGENT_PROGRAMS.names())}")
        return self

