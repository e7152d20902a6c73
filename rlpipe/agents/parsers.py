"""Tool-call parsers: model text → tool calls, tool outputs → observation text (registry ``tool_parser``).

* ``hermes`` — the format of Hermes / Qwen chat models:
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``,
  any number per turn; outputs come back as ``<tool_response>…</tool_response>``, one per call.
* ``compact`` — a format a from-scratch character-level model can learn with a
  dozen symbols: ``[expr]`` calls the default tool with its main argument,
  ``[name:text]`` calls tool ``name``; outputs come back as ``={output};`` per call
  (the ``;`` closes the observation, so a final answer after it is unambiguous).
  Main arguments: calculator → ``expression``, python → ``code``, latency and
  lookup → ``key`` (other tools: ``input``).
* ``trigger`` — the smallest call a randomly initialized model can stumble on: a
  turn containing ``!`` calls the default tool once, with the *prompt's operand*
  as its main argument (the prompt text without its closing ``?`` / ``=``: ``"123?"``
  → ``lookup(key="123")``, ``"7*8="`` → ``calculator("7*8")``); the observation
  is ``={output}`` with no closing mark, so the output is the last thing the model
  sees before it answers (copying it starts with repeating the current token). The
  model learns *when* to call, not how to spell a call.

The default tool is the first of ``agent_loop.tools``. Parsers get the episode's
prompt text (``parse(text, prompt)``); only ``trigger`` uses it.

A malformed call (bad JSON, no name) is not dropped: it is returned with its
error, and the agent loop answers it with an error observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

from rlpipe.agents.tool_types import ToolCall, ToolOutput
from rlpipe.registry import registry

TOOL_PARSERS = registry("tool_parser")

MAIN_ARGUMENT = {"calculator": "expression", "python": "code", "latency": "key", "lookup": "key"}


@dataclass(frozen=True)
class ParsedCall:
    """A call found in the model's text: the call, or why it could not be read."""

    call: ToolCall | None
    error: str | None = None


class HermesParser:
    """``<tool_call>{json}</tool_call>`` calls; ``<tool_response>`` observations."""

    STOP = None  # a multi-token closing tag: turns end at eos

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, prompt: str = "") -> list[ParsedCall]:
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

    def strip(self, text: str) -> str:
        """``text`` without its calls (the content of a gateway reply that carries them as tool_calls)."""
        return self._CALL.sub("", text).strip()


class CompactParser:
    """``[expr]`` / ``[name:text]`` calls; ``={output};`` observations."""

    _CALL = re.compile(r"\[(?:([a-z_]+):)?([^\[\]]*)\]")
    STOP = "]"  # a call's last character: `stop_at_call` ends the turn there

    def __init__(self, default_tool: str = "calculator"):
        self.default_tool = default_tool

    def parse(self, text: str, prompt: str = "") -> list[ParsedCall]:
        calls = []
        for name, body in self._CALL.findall(text):
            name = name or self.default_tool
            calls.append(ParsedCall(ToolCall(name, {MAIN_ARGUMENT.get(name, "input"): body})))
        return calls

    def observation(self, outputs: Sequence[ToolOutput]) -> str:
        return "".join(f"={o.text};" for o in outputs)

    def strip(self, text: str) -> str:
        return self._CALL.sub("", text).strip()


class TriggerParser(CompactParser):
    """``!`` anywhere in the turn: one call of the default tool with the prompt's operand; ``={output};``."""

    TRIGGER = STOP = "!"

    def parse(self, text: str, prompt: str = "") -> list[ParsedCall]:
        if self.TRIGGER not in text:
            return []
        operand = prompt.strip().rstrip("?=").strip()
        return [ParsedCall(ToolCall(self.default_tool, {MAIN_ARGUMENT.get(self.default_tool, "input"): operand}))]

    def observation(self, outputs: Sequence[ToolOutput]) -> str:
        return "".join(f"={o.text}" for o in outputs)

    def strip(self, text: str) -> str:
        return text.replace(self.TRIGGER, "").strip()


TOOL_PARSERS.add("hermes", lambda default_tool: HermesParser())
TOOL_PARSERS.add("compact", CompactParser)
TOOL_PARSERS.add("trigger", TriggerParser)


def build_parser(name: str, default_tool: str = "calculator"):
    """The registered parser ``name``, calling ``default_tool`` where its format names no tool
    (unknown names raise listing the known)."""
    return TOOL_PARSERS.get(name)(default_tool)
