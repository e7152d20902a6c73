"""One line for an error Ray raised about a worker actor.

Ray reports an actor whose ``__init__`` raised as ``ActorDiedError`` whose text opens with
"The actor died because of an error raised in its creation task", then the actor's process and
its whole traceback; the worker's own exception (``SafetensorError: header too large``) is the
traceback's last line. :func:`actor_error_line` returns that line, so a run that fails while its
workers start says why in one line; other actor errors give their first line. rlpipe's workers keep a
start-up exception and raise it from their first call instead (Ray prints a raising ``__init__``'s whole
traceback on the driver's terminal): :func:`startup_error_line` names it and where it was raised.
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


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def startup_error_line(exc: BaseException) -> str:
    """One line for a worker whose start-up raised (re-raised by its ``ready``: Ray's RayTaskError): the
    exception's type and message, and where it was raised (the traceback's innermost frame)."""
    cause = getattr(exc, "cause", None) or exc
    message = _ANSI.sub("", str(cause)).strip().splitlines()
    # Ray's text of a task error holds the remote traceback
    frames = [m for line in _ANSI.sub("", str(exc)).splitlines() if (m := _FRAME.match(line))]
    where = f" (at {frames[-1].group(1)}:{frames[-1].group(2)} in {frames[-1].group(3)})" if frames else ""
    return f"its start-up raised {type(cause).__name__}: {message[0] if message else ''}{where}"
