"""SIGINT and SIGTERM stop a run cleanly.

``rlpipe run`` installs :func:`install`: the first SIGINT or SIGTERM raises
:class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread, so
``run_pipeline`` marks the MLflow run KILLED and closes the workers (Ray actors
killed, engine servers stopped) before the command exits with 128 + the
signal number (130, 143) and one line. A second signal while stopping is
ignored (the stop is bounded: workers close within their timeout, tracking
within ``tracking.drain_timeout_s``). Ray's driver installs its own SIGTERM
handler (``sys.exit``) in ``ray.init``; :func:`keep_over_ray` puts ours back.

A signal that lands while the main thread waits inside Ray's C++ code (``ray.get``,
``ray.wait``) reaches Python as Ray's own bare ``KeyboardInterrupt()``: our exception is
dropped on the way. The handler therefore also records the signal, and :func:`stop_of`
names it from the record, whatever exception came up.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stopping = False
_received: int | None = None  # the signal that started the stop, whatever exception carried it up


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; ``exit_code`` is 128 + its number."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum: int, frame) -> None:
    global _stopping, _received
    if _stopping:
        log.warning("%s received while stopping; the run is already stopping", signal.Signals(signum).name)
        return
    _stopping = True
    _received = signum
    raise Interrupted(signum)


def stop_of(exc: KeyboardInterrupt) -> Interrupted:
    """The stop ``exc`` stands for: itself, the signal our handler recorded (Ray re-raises it as a bare
    ``KeyboardInterrupt``), or SIGINT (a Ctrl-C with no handler of ours installed)."""
    if isinstance(exc, Interrupted):
        return exc
    return Interrupted(_received if _received is not None else signal.SIGINT)


_handler.rlpipe_stop = True  # how keep_over_ray recognizes it


def install() -> None:
    """Make SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (call from the main thread)."""
    global _stopping, _received
    _stopping, _received = False, None
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def installed() -> bool:
    return getattr(signal.getsignal(signal.SIGTERM), "rlpipe_stop", False)


def keep_over_ray(was_installed: bool) -> None:
    """After ``ray.init``: restore our handlers if they were installed before it."""
    if was_installed and threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _handler)
