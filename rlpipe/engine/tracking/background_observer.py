"""Observer calls off the critical path: a queue and one writer thread, drained within a deadline.

MLflow logging costs a few tens of milliseconds per node record and step end
(SQL writes, parquet artifacts); the driver would otherwise wait for it between
stages. ``BackgroundObserver`` wraps any observer: ``on_run_start`` stays
synchronous (it returns the run id), every later call is queued and applied in
order by one thread, and ``on_run_end`` (queued too) waits for the queue to
drain, so a finished or failed run has everything logged when ``run_pipeline``
returns.

Bounded: ``on_run_end`` waits at most ``drain_timeout_s``. A call that did not
reach the tracking store by then — still queued, in flight on a server that
stopped answering, or failed (the inner observer counts its failures) — is
written to a local spool file (:mod:`rlpipe.engine.tracking.spool`) that
``rlpipe spool replay PATH`` sends to MLflow later, so nothing is lost and the
process does not hang at run end. The writer thread is a daemon: one stuck in a
call does not keep the process alive.

With ``max_queued``, at most that many calls wait: a call made while the queue is full
blocks its caller until the writer catches up (backpressure; memory stays bounded when the
store is slower than the run).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from rlpipe.engine.tracking.observer import NodeRecord, Observer
from rlpipe.engine.tracking.spool import write_spool

log = logging.getLogger(__name__)

_STOP = object()


class BackgroundObserver:
    """Applies the wrapped observer's calls in order on a writer thread."""

    def __init__(self, inner: Observer, drain_timeout_s: float | None = None,
                 spool_path: Callable[[str], Path] | None = None, max_queued: int | None = None):
        """``drain_timeout_s``: longest wait at run end (None: unbounded); ``spool_path(run_id)``: where
        undelivered calls go (None: nowhere, they are only logged); ``max_queued``: most calls waiting
        (None: unbounded)."""
        self.inner = inner
        self.drain_timeout_s = drain_timeout_s
        self.spool_path = spool_path
        self.spooled: Path | None = None
        """The spool file this run wrote, if any."""
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued or 0)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._current: tuple[str, tuple] | None = None
        self._undelivered: list[tuple[str, tuple]] = []
        self._abandoned = False
        self._start_args: tuple = ()
        self._run_id = ""

    def on_run_start(self, config: dict[str, Any], pipeline_yaml: str, plan_summary: dict[str, Any]) -> str:
        run_id = self.inner.on_run_start(config, pipeline_yaml, plan_summary)
        self._start_args, self._run_id = (config, pipeline_yaml, plan_summary), run_id
        self._thread = threading.Thread(target=self._drain, name="rlpipe-observer", daemon=True)
        self._thread.start()
        return run_id

    def on_node_end(self, record: NodeRecord) -> None:
        self._put("on_node_end", (record,))

    def on_step_end(self, step: int, metrics: dict[str, float], trajectories: Any | None,
                    trajectory_lineage: Any | None = None) -> None:
        self._put("on_step_end", (step, dict(metrics), trajectories, trajectory_lineage))

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._put("on_metrics", (step, dict(metrics)))

    def on_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        self._put("on_artifact", (local_path, artifact_path))

    def on_node_input(self, step: int, node: str, table: Any, context: dict[str, Any]) -> None:
        if hasattr(self.inner, "on_node_input"):  # Arrow tables are immutable: safe to write from the thread
            self._put("on_node_input", (step, node, table, dict(context)))

    def on_run_end(self, status: str, error: str | None = None) -> None:
        if self._thread is None:
            self.inner.on_run_end(status, error)
            return
        end = ("on_run_end", (status, error))
        deadline = None if self.drain_timeout_s is None else time.monotonic() + self.drain_timeout_s
        end_queued = self._put_by(end, deadline)
        if end_queued:
            self._put_by(_STOP, deadline)
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            hung = self._thread.is_alive()
            self._abandoned = True
            pending = list(self._undelivered)
            if hung and self._current is not None:
                pending.append(self._current)
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    pending.append(item)
            if not end_queued:
                pending.append(end)  # the queue stayed full until the deadline
        self._thread = None
        unsent = getattr(self.inner, "unsent_calls", None)
        if pending and unsent is not None:
            # what the observer buffered but never wrote (node records, node metrics), first: the replayed
            # step ends write their lineage from those records; records already in `pending` stay once
            queued = {id(args[0]) for method, args in pending if method == "on_node_end"}
            pending[:0] = [(m, a) for m, a in unsent() if m != "on_node_end" or id(a[0]) not in queued]
        if pending:
            self._spool(pending, hung)

    def _put(self, method: str, args: tuple) -> None:
        if self._thread is None and self._abandoned:
            log.warning("observer call %s after the run ended; ignored", method)
            return
        self._queue.put((method, args))

    def _put_by(self, item: Any, deadline: float | None) -> bool:
        """Queue ``item`` if there is room before ``deadline`` (None: wait as long as it takes)."""
        try:
            self._queue.put(item, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return False
        return True

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            with self._lock:
                if item is _STOP or self._abandoned:
                    return
                self._current = item
            delivered = self._apply(*item)
            with self._lock:
                self._current = None
                if not delivered and not self._abandoned:
                    self._undelivered.append(item)

    def _apply(self, method: str, args: tuple) -> bool:
        """Run one call on the inner observer; whether it reached the store (no new tracking failure)."""
        failures = getattr(self.inner, "failures", None)
        before = len(failures) if failures is not None else 0
        try:
            getattr(self.inner, method)(*args)
        except Exception:  # tracking trouble must not kill the run; the call is kept for the spool
            log.exception("observer call %s failed", method)
            return False
        return failures is None or len(failures) == before

    def _spool(self, pending: list[tuple[str, tuple]], hung: bool) -> None:
        why = (f"the tracking store did not take the run's last calls within tracking.drain_timeout_s="
               f"{self.drain_timeout_s:g} s" if hung else "some tracking calls failed")
        if self.spool_path is None:
            log.error("%s; %d calls are lost (no spool configured)", why, len(pending))
            return
        inner = self.inner
        tracking = getattr(inner, "tracking", None)
        header = {
            "tracking_uri": getattr(inner, "tracking_uri", None), "run_id": self._run_id,
            "run_name": getattr(inner, "run_name", ""),
            "tracking": tracking.model_dump(mode="json") if tracking is not None else {},
            "config": self._start_args[0], "pipeline_yaml": self._start_args[1], "plan_summary": self._start_args[2],
        }
        try:
            self.spooled = write_spool(self.spool_path(self._run_id), header, pending)
        except OSError as exc:
            log.error("%s, and writing the spool failed (%s); %d calls are lost", why, exc, len(pending))
            return
        log.error("%s; %d calls were written to %s: send them with `rlpipe spool replay %s` when the server "
                  "is back", why, len(pending), self.spooled, self.spooled)
