"""Where the details of a failed ``rlpipe run`` go: a log file, so the terminal shows one line.

A run that fails prints ``error: <first line of the error> (details: PATH)`` and exits 2; PATH
holds the command line, the full error text and its traceback with every chained cause (a
stage error raised on Ray carries the worker's traceback in its text). The file lands in
``trainer.output_dir`` when the config was read, else in the system's temporary folder; the
environment variable ``RLPIPE_ERROR_LOG`` names the file instead. A folder that cannot be
written falls back to the temporary folder: the details are never the reason a failure hides.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path


def write(exc: BaseException, argv: list[str], folder: str | None = None) -> Path | None:
    """Write ``exc`` with its traceback to the error log; returns its path (None if nothing could be written)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    named = os.environ.get("RLPIPE_ERROR_LOG")
    candidates = [Path(named)] if named else []
    if folder:
        candidates.append(Path(folder) / f"rlpipe-error-{stamp}-{os.getpid()}.log")
    candidates.append(Path(tempfile.gettempdir()) / f"rlpipe-error-{stamp}-{os.getpid()}.log")
    text = (f"rlpipe {' '.join(argv)}\nat {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, python "
            f"{sys.version.split()[0]}, pid {os.getpid()}\n\n{exc}\n\n"
            + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    worker = getattr(root(exc), "details", "") or getattr(exc, "details", "")
    if worker:  # a StageError's traceback where the stage ran (a Ray worker's is not in the chain above)
        text += f"\nwhere the stage failed:\n{worker}"
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return None


def root(exc: BaseException) -> BaseException:
    """The error a Ray task or actor call raised, unwrapped from Ray's ``RayTaskError`` (whose text opens with
    the worker's process and traceback; the wrapped error is the one that says what failed)."""
    while hasattr(exc, "as_instanceof_cause") and isinstance(getattr(exc, "cause", None), BaseException):
        exc = exc.cause
    return exc


def one_line(exc: BaseException) -> str:
    """The error's first line (of the error Ray wrapped, if it did); with the count of the lines left out."""
    exc = root(exc)
    text = str(exc).strip() or type(exc).__name__
    lines = text.splitlines()
    more = f" [+{len(lines) - 1} lines]" if len(lines) > 1 else ""
    return lines[0] + more
