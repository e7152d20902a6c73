"""Agent programs: the ``agent_program`` registry and the built-in programs.

An agent program is ``fn(base_url, api_key, prompt) -> None``: a plain OpenAI chat-completions
client that the ``gateway`` agent (:mod:`rlpipe.agents.gateway_agent`) runs in a thread per
trajectory, pointed at the replica's gateway (``generate.params.gateway.program`` names one).
Plugins register more with ``AGENT_PROGRAMS.add(name, fn)`` from an ``rlpipe.plugins`` entry point.

The registry lives here, beside the programs and apart from the gateway agent, so that
:mod:`rlpipe.agents.config` can check ``gateway.program`` against it without importing the
agent that imports the config (the two would import each other).
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from rlpipe.agents.parsers import build_parser
from rlpipe.agents.tools import ToolOutput, build_tool
from rlpipe.registry import registry

AGENT_PROGRAMS = registry("agent_program")


def chat_completion(base_url: str, api_key: str | None, messages: list[dict], timeout: float = 120.0,
                    **fields: Any) -> dict:
    """One OpenAI-style ``POST {base_url}/chat/completions`` with urllib (what any OpenAI client sends)."""
    data = json.dumps({"model": "rlpipe-policy", "messages": messages, **fields}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    with urllib.request.urlopen(urllib.request.Request(f"{base_url}/chat/completions", data, headers),
                                timeout=timeout) as response:
        return json.loads(response.read())


def calculator_client(base_url: str, api_key: str | None, prompt: str, max_turns: int = 4) -> None:
    """A plain OpenAI-client agent: ask, run the calculator on every call in the reply (compact or hermes
    format), send the outputs back as a `tool` message, until a reply has no call."""
    parsers = [build_parser("compact"), build_parser("hermes")]
    calculator = build_tool("calculator")
    messages = [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        choice = chat_completion(base_url, api_key, messages)["choices"][0]
        content = choice["message"]["content"]
        messages.append({"role": "assistant", "content": content})
        calls = next((found for parser in parsers if (found := parser.parse(content))), [])
        if choice["finish_reason"] == "length" or not calls:
            return
        outputs = [calculator.run(c.call.arguments) if c.call is not None and c.call.name == "calculator"
                   else ToolOutput("error: unknown tool", ok=False) for c in calls]
        messages.append({"role": "tool", "content": " ".join(o.text for o in outputs)})


AGENT_PROGRAMS.add("calculator_client", calculator_client)


def lookup_client(base_url: str, api_key: str | None, prompt: str) -> None:
    """The agent_tools task as a black-box OpenAI-client agent: ask; if the reply calls the lookup (a `!`, the
    `trigger` format), look the prompt's key up and send the observation (`=7`) as a `tool` message; ask again."""
    parser, lookup = build_parser("trigger", "lookup"), build_tool("lookup")
    messages = [{"role": "user", "content": prompt}]
    choice = chat_completion(base_url, api_key, messages)["choices"][0]
    calls = parser.parse(choice["message"]["content"], prompt)
    if choice["finish_reason"] == "length" or not calls:
        return
    messages += [{"role": "assistant", "content": choice["message"]["content"]},
                 {"role": "tool", "content": parser.observation([lookup.run(calls[0].call.arguments)])}]
    chat_completion(base_url, api_key, messages)


AGENT_PROGRAMS.add("lookup_client", lookup_client)
