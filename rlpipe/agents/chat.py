"""Chat sessions recorded at the token level (seed 5.3.1): what the gateway keeps per session.

The chat template renders a conversation to text; the tokenizer's own
``chat_template`` when it has one, else :data:`DEFAULT_CHAT_TEMPLATE` (tokenizers
rlpipe builds locally have none)::

    \\n<R>:<content>  per message, <R> = S (system) | U (user) | A (assistant) | T (tool);
                     an assistant message is followed by the eos token;
    \\nA:             the generation prompt.

Every message *starts* with its separator, so a conversation rendered after the
model's turn begins with exactly the text the model saw plus what it produced
(``…\\nA:`` + reply + eos). A character-level alphabet needs ``\\n``, ``:`` and the
role letters; characters outside it become ``<unk>``.

:class:`ChatSession` turns each request of a session into token ids without
re-tokenizing what came before. The first request's rendering is the prompt. A
later request whose messages extend the session's (the messages so far, the
model's replies as the client got them, then new messages) adds only the text
its rendering has beyond the rendering of the session's messages, tokenized
alone, mask 0; the model's tokens stay as the engine returned them, mask 1
(special tokens included, though the client sees the reply without them). Text
the template puts after a reply that the model did not generate (the end token
of a reply cut by the length cap, a newline after the end token) opens the next
addition, mask 0. With a token cap (``max_tokens``, counted after the first prompt), an addition
that does not fit is cut to the cap. A request whose history does not extend the session (the
client rewrote or dropped messages) starts a new segment: the session then holds
several trajectories, and the last one is the session's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from rlpipe.inference.contract import GenerationResult

DEFAULT_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '\\n' + {'system': 'S', 'user': 'U', 'assistant': 'A', 'tool': 'T'}.get(m['role'], m['role']) + ':' -}}"
    "{{- m['content'] or '' -}}"
    "{%- if m['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '\\nA:' -}}{%- endif -%}"
)


def render(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """``messages`` rendered by the tokenizer's chat template (or rlpipe's default) to text."""
    template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


@dataclass
class Segment:
    """One token-level trajectory of a session: the first prompt, then everything after it."""

    prompt_ids: list[int]
    messages: list[dict]  # the conversation so far, the model's replies as the client got them
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    pending: str = ""  # template text after the last reply that the model did not generate


class ChatSession:
    """The token-level record of one gateway session (not thread-safe: the gateway serializes a session)."""

    def __init__(self, session_id: str, tokenizer: Any, max_tokens: int | None = None):
        self.id = session_id
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.segments: list[Segment] = []
        self.turns = 0
        self.cut = False  # a request hit the session's length cap
        self.call_text: dict[str, str] = {}  # tool-call id the gateway issued -> the model's raw text of that reply
        self.last_active = time.monotonic()

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def canonical(self, messages: Sequence[dict]) -> list[dict]:
        """``{role, content}`` messages as the template renders them: an assistant message carrying tool calls the
        gateway issued becomes the model's raw text of that reply (so it re-renders token for token); one with
        calls the gateway never issued gets them appended in hermes form."""
        from rlpipe.agents.openai_format import hermes_calls

        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if m["role"] == "assistant" and calls:
                raw = self.call_text.get(calls[0]["id"])
                out.append({"role": "assistant", "content": raw if raw is not None else m["content"] + hermes_calls(calls)})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return out

    def remember_calls(self, calls: Sequence[dict], raw_text: str) -> None:
        """The reply with these OpenAI tool calls was the model's ``raw_text``."""
        for call in calls:
            self.call_text[call["id"]] = raw_text

    def prompt_for(self, messages: Sequence[dict]) -> np.ndarray:
        """Record the request's messages and return the token ids the engine continues (prompt + response)."""
        messages = [dict(m) for m in messages]
        seg = self.current
        if seg is not None and len(messages) > len(seg.messages) and messages[: len(seg.messages)] == seg.messages:
            before = render(self.tokenizer, seg.messages, add_generation_prompt=False)
            text = render(self.tokenizer, messages)
            if text.startswith(before):
                added = self.tokenizer.encode(seg.pending + text[len(before):], add_special_tokens=False)
                room = None if self.max_tokens is None else self.max_tokens - len(seg.ids)
                if room is not None and len(added) > room:  # over the cap: the message is cut, the session kept
                    added, self.cut = added[:room], True
                seg.ids.extend(added)
                seg.mask.extend([0] * len(added))
                seg.logprobs.extend([0.0] * len(added))
                seg.versions.extend([seg.versions[-1] if seg.versions else 0] * len(added))
                seg.messages, seg.pending = messages, ""
                return np.asarray(seg.prompt_ids + seg.ids, np.int32)
        seg = Segment(self.tokenizer.encode(render(self.tokenizer, messages), add_special_tokens=False), messages)
        self.segments.append(seg)
        return np.asarray(seg.prompt_ids, np.int32)

    def budget(self) -> int | None:
        """Tokens this session may still add after its first prompt (None: no cap)."""
        return None if self.max_tokens is None else self.max_tokens - len(self.current.ids)

    def record(self, result: GenerationResult, content: str | None = None) -> str:
        """Append the model's tokens (mask 1); returns the reply text for the client: ``content`` when given (a
        reply cut at a stop string, :func:`cut_at_stop`), else the tokens' text with special tokens skipped."""
        seg = self.current
        ids = result.response_ids.tolist()
        seg.spans.append((len(seg.ids), len(seg.ids) + len(ids)))
        seg.ids.extend(ids)
        seg.mask.extend([1] * len(ids))
        seg.logprobs.extend(result.logprobs.tolist())
        seg.versions.extend(result.versions.tolist())
        self.turns += 1
        if content is None:
            content = self.tokenizer.decode(ids, skip_special_tokens=True)
        prompt = render(self.tokenizer, seg.messages)
        seg.messages.append({"role": "assistant", "content": content})
        full = render(self.tokenizer, seg.messages, add_generation_prompt=False)
        tail = full[len(prompt) + len(content):] if full.startswith(prompt + content) else ""
        eos = self.tokenizer.eos_token or ""
        ended = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        seg.pending = tail[len(eos):] if ended and eos and tail.startswith(eos) else tail
        return content

    def summary(self) -> dict:
        seg = self.current
        return {"session": self.id, "segments": len(self.segments), "turns": self.turns, "cut": self.cut,
                "prompt_tokens": len(seg.prompt_ids) if seg else 0, "response_tokens": len(seg.ids) if seg else 0,
                "model_tokens": int(sum(seg.mask)) if seg else 0}


def cut_at_stop(result: GenerationResult, stops: Sequence[str], tokenizer: Any) -> tuple[GenerationResult, str | None]:
    """A reply ended at its first stop string, as OpenAI's ``stop`` does: the result up to the token that
    completes the string (the tokens the model really produced, so the trajectory stays token-true; those after
    it are dropped) with finish reason ``stop``, and the reply text before the string (None, and the result as it
    is, when no stop string occurs). The engines stop on token ids, so the check runs on the finished reply: the
    smallest token prefix holding a stop string is found by bisection (log2(n) decodes)."""
    ids = result.response_ids
    decode = lambda k: tokenizer.decode(ids[:k].tolist(), skip_special_tokens=True)  # noqa: E731
    if not stops or not any(s in decode(len(ids)) for s in stops):
        return result, None
    low, high = 1, len(ids)  # the text of ids[:high] holds a stop string; find the smallest such high
    while low < high:
        middle = (low + high) // 2
        if any(s in decode(middle) for s in stops):
            high = middle
        else:
            low = middle + 1
    text = decode(high)
    start = min(text.find(s) for s in stops if s in text)
    kept = GenerationResult(result.request_id, ids[:high], result.logprobs[:high], result.versions[:high], "stop")
    return kept, text[:start]
