"""Open the run's tracking record while the workers start.

Opening an MLflow run costs seconds (the tracking process imports MLflow, a new SQLite store creates its tables,
a server answers over HTTP) and so does starting Ray and the workers (each imports torch and builds its model).
Neither needs the other until the first step: the workers do not know the run id, and the observer is told
nothing between its start and the step loop. So ``run_pipeline`` starts the run in a thread (:class:`RunStart`)
and builds the workers meanwhile; :meth:`RunStart.run_id` is where the two meet.
"""

from __future__ import annotations

import threading
from typing import Any


class RunStart:
    """``observer.on_run_start(...)`` running in a thread of its own, started at construction.

    The wait in :meth:`run_id` has the observer's own bound: the tracking process gives up after
    ``tracking.start_timeout_s`` (and raises), the in-process observers return at once."""

    def __init__(self, observer, config: dict[str, Any], pipeline_yaml: str, plan_summary: dict[str, Any]):
        self._result: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._open, args=(observer, config, pipeline_yaml, plan_summary),
                                        name="rlpipe-run-start", daemon=True)
        self._thread.start()

    def _open(self, observer, config, pipeline_yaml, plan_summary) -> None:
        try:
            self._result = observer.on_run_start(config, pipeline_yaml, plan_summary)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by run_id()
            self._error = exc

    def done(self) -> bool:
        """Whether the observer has answered (with a run id or an error)."""
        return not self._thread.is_alive()

    def run_id(self) -> str:
        """The run id, once the observer has opened the run; the observer's error if it could not."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def raise_if_failed(self) -> None:
        """The observer's error now if it has already failed (a bad store fails the run before its workers)."""
        if not self._thread.is_alive() and self._error is not None:
            raise self._error

    def opened(self) -> str | None:
        """The run id if the run is open by now, else None (never waits): what a failure on the way must end."""
        if self._thread.is_alive() or self._error is not None:
            return None
        return self._result
