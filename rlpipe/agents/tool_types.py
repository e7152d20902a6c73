"""What a tool is: the :class:`Tool` protocol, the call and output records, :class:`ToolInfraError`.

These sit below both the tool registry (:mod:`rlpipe.agents.tools`, which registers the built-in
tools) and the tool implementations it registers (:mod:`rlpipe.agents.sandbox`), so that an
implementation needs nothing from the registry that imports it. Callers may keep importing
these names from :mod:`rlpipe.agents.tools`, which re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from rlpipe.errors import RlpipeError


class ToolInfraError(RlpipeError):
    """A tool could not run at all (not a failure of the call itself): the trajectory is marked failed."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool name and its arguments (already parsed)."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ToolOutput:
    """What a call returned: the observation text and whether the call succeeded."""

    text: str
    ok: bool = True


class Tool(Protocol):
    name: str

    def run(self, arguments: Mapping[str, Any]) -> ToolOutput: ...
