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
re-tokenizing what came before: the first request's rendered text is the prompt;
for a later one, the rendered text must extend the session's text (prompt,
model tokens decoded with their special tokens, added messages); only the new
suffix is tokenized and appended with mask 0. The model's tokens are appended
as the engine returned them, mask 1. A request whose history does not extend
the session (the client rewrote or dropped messages) starts a new segment: the
session then holds several trajectories, and the last one is the session's.
"""

from __future__ import annotations

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
    text: str  # rendered text of prompt + response so far
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)


class ChatSession:
    """The token-level record of one gateway session (not thread-safe: the gateway serializes a session)."""

    def __init__(self, session_id: str, tokenizer: Any, max_tokens: int | None = None):
        self.id = session_id
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.segments: list[Segment] = []
        self.turns = 0
        self.cut = False  # a request hit the session's length cap

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def prompt_for(self, messages: Sequence[dict]) -> np.ndarray:
        """Record the request's messages and return the token ids the engine continues (prompt + response)."""
        text = render(self.tokenizer, messages)
        seg = self.current
        if seg is not None and text.startswith(seg.text):
            added = self.tokenizer.encode(text[len(seg.text):], add_special_tokens=False)
            seg.ids.extend(added)
            seg.mask.extend([0] * len(added))
            seg.logprobs.extend([0.0] * len(added))
            seg.versions.extend([seg.versions[-1] if seg.versions else 0] * len(added))
            seg.text = text
        else:
            seg = Segment(self.tokenizer.encode(text, add_special_tokens=False), text)
            self.segments.append(seg)
        return np.asarray(seg.prompt_ids + seg.ids, np.int32)

    def budget(self) -> int | None:
        """Tokens this session may still add after its first prompt (None: no cap)."""
        return None if self.max_tokens is None else self.max_tokens - len(self.current.ids)

    def record(self, result: GenerationResult) -> str:
        """Append the model's tokens (mask 1); returns the reply text for the client (special tokens skipped)."""
        seg = self.current
        ids = result.response_ids.tolist()
        seg.spans.append((len(seg.ids), len(seg.ids) + len(ids)))
        seg.ids.extend(ids)
        seg.mask.extend([1] * len(ids))
        seg.logprobs.extend(result.logprobs.tolist())
        seg.versions.extend(result.versions.tolist())
        seg.text += self.tokenizer.decode(ids, skip_special_tokens=False)
        self.turns += 1
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def summary(self) -> dict:
        seg = self.current
        return {"session": self.id, "segments": len(self.segments), "turns": self.turns, "cut": self.cut,
                "prompt_tokens": len(seg.prompt_ids) if seg else 0, "response_tokens": len(seg.ids) if seg else 0,
                "model_tokens": int(sum(seg.mask)) if seg else 0}
