"""Tool-call parsers: model text → tool calls, tool outputs → observation text (registry ``tool_parser``).

* ``hermes`` — the format of Hermes / Qwen chat models:
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``,
  any number per turn; outputs come back as ``<tool_response>…</tool_response>``, one per call.
* ``compact`` — a format a from-scratch character-level model can learn with a
  dozen symbols: ``[expr]`` calls the default tool (``calculator``) with its main
  argument, ``[name:text]`` calls tool ``name``; outputs come back as ``={output};``
  per call (the ``;`` closes the observation, so a final answer after it is unambiguous). Main arguments: calculator → ``expression``, python → ``code``,
  latency → ``key`` (other tools: ``input``).

A malformed call (bad JSON, no name) is not dropped: it is returned with its
error, and the agent loop answers it with an error observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

from rlpipe.agents.tools import ToolCall, ToolOutput
from rlpipe.registry import registry

TOOL_PARSERS = registry("tool_parser")

MAIN_ARGUMENT = {"calculator": "expression", "python": "code", "latency": "key"}


@dataclass(frozen=True)
class ParsedCall:
    """A call found in the model's text: the call, or why it could not be read."""

    call: ToolCall | None
    error: str | None = None


class HermesParser:
    """``<tool_call>{json}</tool_call>`` calls; ``<tool_response>`` observations."""

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for body in self._CALL.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                calls.append(ParsedCall(None, f"error: the tool call is not valid JSON ({exc.msg})"))
                continue
            name, arguments = (obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else (None, None)
            if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(name, str) or not isinstance(arguments, dict):
                calls.append(ParsedCall(None, 'error: a tool call needs {"name": str, "arguments": object}'))
                continue
            calls.append(ParsedCall(ToolCall(name, arguments)))
        return calls

    def observation(self, outputs: Sequence[ToolOutput]) -> str:
        return "".join(f"<tool_response>{o.text}</tool_response>" for o in outputs)


class CompactParser:
    """``[expr]`` / ``[name:text]`` calls; ``={output};`` observations."""

    _CALL = re.compile(r"\[(?:([a-z_]+):)?([^\[\]]*)\]")

    def __init__(self, default_tool: str = "calculator"):
        self.default_tool = default_tool

    def parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for name, body in self._CALL.findall(text):
            name = name or self.default_tool
            calls.append(ParsedCall(ToolCall(name, {MAIN_ARGUMENT.get(name, "input"): body})))
        return calls

    def observation(self, outputs: Sequence[ToolOutput]) -> str:
        return "".join(f"={o.text};" for o in outputs)


TOOL_PARSERS.add("hermes", HermesParser)
TOOL_PARSERS.add("compact", CompactParser)


def build_parser(name: str):
    """The registered parser ``name`` (unknown names raise listing the known)."""
    return TOOL_PARSERS.get(name)()
