"""Bounded waits: a stage execution that runs past its ``timeout_s`` fails the run.

On Ray the driver waits for a stage's task or worker calls with ``ray.get(...,
timeout=)`` and, past the deadline, cancels the task or kills the hung worker
actor (its engine server dies with it). A call in this process (driver stages,
and every stage of the inline backend) cannot be preempted: Python cannot stop
a thread. :func:`call_with_deadline` runs it in a daemon thread and stops
*waiting* at the deadline; the run then fails, and the abandoned thread dies
with the process (a daemon thread never keeps the interpreter alive).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from rlpipe.errors import RlpipeError


class StageTimeout(RlpipeError):
    """A stage execution ran longer than its node's ``timeout_s``; ``where`` names the worker it ran on."""

    def __init__(self, timeout_s: float, where: str):
        self.timeout_s = timeout_s
        self.where = where
        super().__init__(f"no result after timeout_s={timeout_s:g} s on {where}")

    def __reduce__(self):
        return (type(self), (self.timeout_s, self.where))


def call_with_deadline(fn: Callable[[], Any], timeout_s: float | None, where: str) -> Any:
    """``fn()``'s result, or :class:`StageTimeout` once ``timeout_s`` has passed (None: wait forever).

    ``fn`` runs in a daemon thread; past the deadline it is abandoned, not stopped."""
    if timeout_s is None:
        return fn()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"rlpipe-stage {where}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StageTimeout(timeout_s, f"{where} (a thread of this process; it cannot be stopped and is abandoned)")
    if "error" in box:
        raise box["error"]
    return box["value"]
