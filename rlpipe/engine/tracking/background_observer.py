"""Observer calls off the critical path: a queue and one writer thread.

MLflow logging costs a few tens of milliseconds per node record and step end
(SQL writes, parquet artifacts); the driver would otherwise wait for it between
stages. ``BackgroundObserver`` wraps any observer: ``on_run_start`` stays
synchronous (it returns the run id), every later call is queued and applied in
order by one thread, and ``on_run_end`` drains the queue before it returns, so
a finished or failed run has everything logged when ``run_pipeline`` returns.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from rlpipe.engine.tracking.observer import NodeRecord, Observer

log = logging.getLogger(__name__)

_STOP = object()


class BackgroundObserver:
    """Applies the wrapped observer's calls in order on a writer thread."""

    def __init__(self, inner: Observer):
        self.inner = inner
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def on_run_start(self, config: dict[str, Any], pipeline_yaml: str, plan_summary: dict[str, Any]) -> str:
        run_id = self.inner.on_run_start(config, pipeline_yaml, plan_summary)
        self._thread = threading.Thread(target=self._drain, name="rlpipe-observer", daemon=True)
        self._thread.start()
        return run_id

    def on_node_end(self, record: NodeRecord) -> None:
        self._queue.put(("on_node_end", (record,)))

    def on_step_end(self, step: int, metrics: dict[str, float], trajectories: Any | None,
                    trajectory_lineage: Any | None = None) -> None:
        self._queue.put(("on_step_end", (step, dict(metrics), trajectories, trajectory_lineage)))

    def on_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        self._queue.put(("on_artifact", (local_path, artifact_path)))

    def on_node_input(self, step: int, node: str, table: Any, context: dict[str, Any]) -> None:
        if hasattr(self.inner, "on_node_input"):  # Arrow tables are immutable: safe to write from the thread
            self._queue.put(("on_node_input", (step, node, table, dict(context))))

    def on_run_end(self, status: str, error: str | None = None) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
        self.inner.on_run_end(status, error)

    def _drain(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            method, args = item
            try:
                getattr(self.inner, method)(*args)
            except Exception:  # tracking trouble must not kill the run; the inner observer logs what it can
                log.exception("observer call %s failed", method)
