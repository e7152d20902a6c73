"""One line for an error Ray raised about a worker actor.

Ray reports an actor whose ``__init__`` raised as ``ActorDiedError`` whose text opens with
"The actor died because of an error raised in its creation task", then the actor's process and
its whole traceback; the worker's own exception (``SafetensorError: header too large``) is the
traceback's last line. :func:`actor_error_line` returns that line, so a run that fails while its
workers start says why in one line; other actor errors give their first line.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")
"""``module.Type: message``: how a traceback's last line names the exception."""


def actor_error_line(exc: BaseException) -> str:
    """The worker's own exception for a start-up failure, else the first line of ``exc``'s text."""
    text = _ANSI.sub("", str(exc)).strip()
    if getattr(exc, "actor_init_failed", False):
        raised = [line for line in text.splitlines() if _EXCEPTION_LINE.match(line)]
        if raised:
            return f"its start-up raised {raised[-1].strip()}"
    return text.splitlines()[0] if text else type(exc).__name__
