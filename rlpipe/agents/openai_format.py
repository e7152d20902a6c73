"""The OpenAI chat-completions wire format of the gateway: request messages in, replies (and stream chunks) out.

Requests: ``messages`` of roles system/developer/user/assistant/tool, content a
string, null, or a list of ``{"type": "text", "text": …}`` parts (other part types
are refused: the gateway serves a text model); assistant messages may carry
``tool_calls`` and tool messages a ``tool_call_id`` — what OpenAI clients and agent
frameworks (the OpenAI Agents SDK) send back after a tool call.

Replies: when the request lists ``tools`` and the model's text parses as tool calls
(the gateway's ``tool_parser``, :mod:`rlpipe.agents.parsers`) — every call well formed
and of a listed tool, else the reply is the plain text — the reply carries them as
OpenAI ``tool_calls`` (``finish_reason: "tool_calls"``; the text outside the
calls is the content, or null), so a framework runs its function tools. The
gateway remembers the model's raw text under each call id it issued: when the
client sends that assistant message back, the chat template renders the raw text,
token for token what the model produced (:class:`~rlpipe.agents.chat.ChatSession`).
An assistant message with calls the gateway never issued is rendered with its
calls in hermes form (``<tool_call>{json}</tool_call>``) after its content.

Streaming (``stream: true``): the finished reply is sent as server-sent events —
one chunk with the role and content (and calls), one with the finish reason, then
``data: [DONE]`` — so streaming clients work; tokens are not streamed as they are
sampled (the gateway records a turn only once it is complete).
"""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

ROLES = ("system", "developer", "user", "assistant", "tool")


class FormatError(ValueError):
    """A request that is not valid chat-completions JSON; the message says which field and what to send,
    ``param`` names the field (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_messages(body: Any) -> list[dict]:
    """The request's messages as ``{"role", "content": str, ["tool_calls"], ["tool_call_id"]}`` dicts."""
    if not isinstance(body, dict):
        raise FormatError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FormatError("`messages` must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise FormatError(f"messages[{i}] needs a `role`, one of {', '.join(ROLES)}", f"messages[{i}].role")
        message = {"role": m["role"], "content": _text(m.get("content"), i)}
        calls = m.get("tool_calls")
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list) or not all(_is_call(c) for c in calls):
                raise FormatError(f"messages[{i}].tool_calls: only assistant messages carry tool_calls, each "
                                  '{"id": str, "type": "function", "function": {"name": str, "arguments": str}}',
                                  f"messages[{i}].tool_calls")
            message["tool_calls"] = [{"id": c["id"], "name": c["function"]["name"],
                                      "arguments": c["function"].get("arguments") or "{}"} for c in calls]
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise FormatError(f"messages[{i}].content must be a string, null, or a list of "
                      '{"type": "text", "text": str} parts (the gateway serves a text model)', f"messages[{i}].content")


def _is_call(call: Any) -> bool:
    fn = call.get("function") if isinstance(call, dict) else None
    return (isinstance(call.get("id"), str) and isinstance(fn, dict) and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments", ""), (str, type(None))))


def tool_names(body: dict) -> list[str]:
    """Names of the function tools the request lists (``tools``); checked, since a framework relies on them."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise FormatError('`tools` must be a list of {"type": "function", "function": {"name": str, ...}}', "tools")
    return [t["function"]["name"] for t in tools]


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        low < value <= high if low_open else low <= value <= high)  # NaN fails both
    if not ok:
        raise FormatError(f"`{name}` must be a number {'>' if low_open else '>='} {low:g} and <= {high:g} "
                          f"(got {value!r:.40})", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int = 2**63 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise FormatError(f"`{name}` must be an integer >= {low}" + (f" and <= {high}" if high < 2**63 - 1 else "")
                          + f" (got {value!r:.40})", name)
    return value


def sampling_fields(body: dict, default_max_tokens: int) -> tuple[int, float, float, int, tuple[str, ...]]:
    """``(max_tokens, temperature, top_p, seed, stop)`` of a request, each checked as OpenAI checks it (a 400
    naming the field, never a silent substitute): ``max_completion_tokens`` / ``max_tokens`` >= 1 (the first one
    set wins; none = ``default_max_tokens``), ``temperature`` in [0, 2], ``top_p`` in (0, 1], ``n`` >= 1 and, as
    the gateway returns one choice, exactly 1, ``stop`` a string or a list of at most 4 strings (empty ones
    dropped, as they match nothing), ``seed`` a 64-bit integer."""
    limits = [_integer(body, name, 1) for name in ("max_completion_tokens", "max_tokens")]
    max_tokens = next((v for v in limits if v is not None), default_max_tokens)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    if _integer(body, "n", 1) not in (None, 1):
        raise FormatError("`n` must be 1: the gateway returns one choice per request (send n requests)", "n")
    stop = body.get("stop")
    if not (stop is None or isinstance(stop, str)
            or isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop)):
        raise FormatError("`stop` must be a string or a list of at most 4 strings", "stop")
    seed = _integer(body, "seed", -(2**63))
    stops = tuple(s for s in ([stop] if isinstance(stop, str) else stop or []) if s)
    return max_tokens, temperature, top_p, 0 if seed is None else seed, stops


def hermes_calls(calls: Sequence[dict]) -> str:
    """Client-made tool calls as text the chat template can render (hermes form)."""
    parts = []
    for c in calls:
        try:
            arguments = json.loads(c["arguments"])
        except json.JSONDecodeError:
            arguments = c["arguments"]
        parts.append(f'<tool_call>{json.dumps({"name": c["name"], "arguments": arguments})}</tool_call>')
    return "".join(parts)


def split_calls(text: str, parser: Any, names: Sequence[str], prompt: str, id_prefix: str) -> tuple[str, list[dict]]:
    """``(content, OpenAI tool_calls)`` of a reply: the calls the parser finds in ``text``, content the text without
    them (``parser.strip``). Only when every call is well formed and names a tool the request lists: otherwise the
    reply is the text as it is (the client sees what the model wrote, malformed call included)."""
    parsed = parser.parse(text, prompt)
    if not parsed or any(p.call is None or p.call.name not in names for p in parsed):
        return text, []
    calls = [p.call for p in parsed]
    content = parser.strip(text) if hasattr(parser, "strip") else text
    return content, [{"id": f"{id_prefix}_{k}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}
                     for k, c in enumerate(calls)]


def completion(model: str, reply_id: str, content: str | None, calls: list[dict], finish_reason: str,
               usage: dict, extra: dict) -> dict:
    """A ``chat.completion`` object."""
    message: dict = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return {"id": reply_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage, **extra}


def stream_events(reply: dict) -> bytes:
    """A finished ``chat.completion`` as ``chat.completion.chunk`` server-sent events ending in ``[DONE]``."""
    choice = reply["choices"][0]
    base = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply["created"], "model": reply["model"]}
    delta: dict = {"role": "assistant", "content": choice["message"]["content"]}
    if choice["message"].get("tool_calls"):
        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(choice["message"]["tool_calls"])]
    chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
               "usage": reply["usage"]}]
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
