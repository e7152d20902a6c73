"""The MLflow writer in its own process: tracking off the training process's GIL and cores.

Why: in one process the writer thread (MLflow's sqlite/HTTP client, Parquet, figures) and
MLflow's trace-export threads hold the GIL between the stages' torch calls, and every
torch op releases and re-takes it: on the 2-core benchmark an inline step took ~200 ms
with tracking on vs ~105 ms with it off (issue 12). Here the training process only
pickles each call onto a bounded queue; a spawned child applies them.

The child runs the same :class:`~rlpipe.engine.tracking.background_observer.BackgroundObserver`
around the :class:`~rlpipe.engine.tracking.mlflow_observer.MLflowObserver` as the in-process
path did, so every guarantee holds unchanged: calls applied in order, ``on_run_end`` waits
at most ``tracking.drain_timeout_s``, undelivered calls go to the tracking spool
(``rlpipe spool replay``), failures are counted and logged. The child's log records are
forwarded to this process's loggers (same names), so warnings reach the console and tests.

Bounded: calls go to the child through a pipe, written by the calling thread (no feeder
thread competing for the GIL; a call is in the kernel's pipe buffer when the call returns, so
a crash right after loses nothing the child can still read); the child relays them into its
writer's queue of at most ``tracking.max_queued_calls`` calls. When that queue is full the
relay stops reading, the pipe fills, and the training process waits (backpressure) instead
of growing memory without bound.

Arrow tables cross as Arrow IPC streams (no per-value pickling). The child ignores
SIGINT/SIGTERM (a Ctrl-C reaches the whole process group; the training process ends the run
as KILLED through this observer), and if the training process dies without ending the run,
the child ends it KILLED itself.
"""

from __future__ import annotations

import logging
import logging.handlers
import multiprocessing as mp
import pickle
import queue
import signal
import sys
import threading
import time
import types
from multiprocessing.connection import Connection
from functools import partial
from typing import Any

import pyarrow as pa

from rlpipe.deadline import StageTimeout, call_with_deadline
from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.errors import RlpipeError

log = logging.getLogger(__name__)

_END_MARGIN_S = 60.0
"""How much longer than the child's own drain deadline this process waits for it (spooling, exit)."""
_POLL_S = 1.0
"""How often a blocked side checks that the other process is still alive."""


class TrackingProcessError(RlpipeError):
    """The tracking process could not start the run."""


class _Ipc:
    """An Arrow table as an IPC stream: crosses the process boundary as one buffer."""

    def __init__(self, table: pa.Table):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        self.data = sink.getvalue().to_pybytes()

    def table(self) -> pa.Table:
        return pa.ipc.open_stream(self.data).read_all()


def _pack(value: Any) -> Any:
    if isinstance(value, pa.RecordBatch):
        value = pa.Table.from_batches([value])
    if isinstance(value, pa.Table):
        return _Ipc(value)
    if isinstance(value, tuple):
        return tuple(_pack(v) for v in value)
    return value


def _unpack(value: Any) -> Any:
    if isinstance(value, _Ipc):
        return value.table()
    if isinstance(value, tuple):
        return tuple(_unpack(v) for v in value)
    return value


class _Forward(logging.handlers.QueueHandler):
    """Log records of the child, made picklable, to the parent's outbox."""

    def enqueue(self, record: logging.LogRecord) -> None:
        self.queue.put(("log", record))


def _serve(inbox: Connection, outbox, make_inner, drain_timeout_s: float, spool_path, max_queued: int, level: int) -> None:
    """The child: build the observer, relay calls to its writer thread, end the run, report the spool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process ends the run (KILLED) through us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    root = logging.getLogger()
    root.handlers[:] = [_Forward(outbox)]
    root.setLevel(level)
    from rlpipe.engine.tracking.background_observer import BackgroundObserver

    observer = BackgroundObserver(make_inner(), drain_timeout_s, spool_path=spool_path, max_queued=max_queued)
    started = False
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):  # the training process is gone without ending its run
            if started:
                observer.on_run_end("KILLED", "the training process ended without ending its run")
            outbox.put(("ended", None))
            return
        kind = message[0]
        if kind == "start":
            try:
                outbox.put(("started", observer.on_run_start(*message[1:])))
                started = True
            except Exception as exc:  # noqa: BLE001 - the parent raises it (a TrackingError names the store)
                try:
                    pickle.dumps(exc)
                except Exception:  # noqa: BLE001 - an exception that does not pickle crosses as its text
                    exc = TrackingProcessError(f"{type(exc).__name__}: {exc}")
                outbox.put(("start_failed", exc))
                return
        elif kind == "call":
            _, method, args = message
            getattr(observer, method)(*_unpack(args))  # blocks while the writer's queue is full: backpressure
        elif kind == "end":
            observer.on_run_end(*message[1:])
            outbox.put(("ended", str(observer.spooled) if observer.spooled else None))
            return


class ProcessObserver:
    """An :class:`~rlpipe.engine.tracking.observer.Observer` whose MLflow writing happens in a child process.

    ``make_inner`` builds the real observer in the child (picklable: a module-level class or
    ``functools.partial``); ``spool_path(run_id)`` likewise."""

    def __init__(self, make_inner, drain_timeout_s: float, spool_path=None, max_queued: int = 256,
                 start_timeout_s: float = 300.0):
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self.spooled: str | None = None
        """The spool file the run wrote, if any (known after on_run_end)."""
        ctx = mp.get_context("spawn")  # not fork: Ray and torch threads live in this process
        self._reader, self._inbox = ctx.Pipe(duplex=False)
        self._outbox = ctx.Queue()
        self._send_lock = threading.Lock()  # the async modes report from several threads
        self._process = ctx.Process(
            target=_serve, name="rlpipe-tracking", daemon=True,
            args=(self._reader, self._outbox, make_inner, drain_timeout_s, spool_path, max_queued,
                  logging.getLogger().getEffectiveLevel()))
        self._replies: queue.Queue = queue.Queue()
        self._listener: threading.Thread | None = None
        self._ended = False

    # -- Observer protocol -------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the child process (once). ``run_pipeline`` calls it in its main thread and opens the run from
        another (rlpipe.engine.tracking.run_start): the swap of ``__main__`` below must not race other imports."""
        if self._listener is not None:
            return
        # the child needs nothing from the caller's script; without this, spawn re-imports it (a script without
        # an `if __name__ == "__main__":` guard would run again in the child)
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            self._process.start()
        finally:
            sys.modules["__main__"] = main
        self._reader.close()  # the child has its own copy; without ours, a dead child makes our writes fail
        # reads the child's replies and log records; blocked on a pipe (no GIL) between them
        self._listener = threading.Thread(target=self._listen, name="rlpipe-tracking-listener", daemon=True)
        self._listener.start()

    def on_run_start(self, config: dict[str, Any], pipeline_yaml: str, plan_summary: dict[str, Any]) -> str:
        self.spawn()
        self._send(("start", config, pipeline_yaml, plan_summary), self.start_timeout_s)
        kind, value = self._reply(self.start_timeout_s)
        if kind != "started":
            hung = kind == "gone" and self._process.is_alive()
            if hung:  # no answer in time: a store that hangs (an unreachable server, a stuck file system)
                self._process.kill()  # SIGKILL: the child ignores SIGTERM (it ends runs only when told to)
            self._process.join(10)
            self._ended = True  # nothing more goes to a child that is gone
            self._stop_listener()
            if kind == "start_failed":
                raise value
            if hung:
                raise TrackingProcessError(
                    f"the tracking process did not open the MLflow run within tracking.start_timeout_s="
                    f"{self.start_timeout_s:g} s (is the tracking store reachable?); it was stopped and no step "
                    "ran. Check tracking.uri / MLFLOW_TRACKING_URI, raise tracking.start_timeout_s, or set "
                    "tracking.enabled: false")
            raise TrackingProcessError(f"the tracking process died at start (exit code {self._process.exitcode})")
        return value

    def on_node_end(self, record: NodeRecord) -> None:
        self._call("on_node_end", (record,))

    def on_step_end(self, step: int, metrics: dict[str, float], trajectories: Any | None,
                    trajectory_lineage: Any | None = None) -> None:
        self._call("on_step_end", (step, dict(metrics), trajectories, trajectory_lineage))

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._call("on_metrics", (step, dict(metrics)))

    def on_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        self._call("on_artifact", (local_path, artifact_path))

    def on_node_input(self, step: int, node: str, table: Any, context: dict[str, Any]) -> None:
        self._call("on_node_input", (step, node, table, dict(context)))

    def on_run_end(self, status: str, error: str | None = None) -> None:
        if self._ended or self._listener is None:
            return
        self._ended = True
        if self._send(("end", status, error), self.drain_timeout_s + _END_MARGIN_S):
            kind, value = self._reply(self.drain_timeout_s + _END_MARGIN_S)
            if kind == "ended":
                self.spooled = value
            else:
                log.error("the tracking process did not end the run within tracking.drain_timeout_s=%g s + %g s; "
                          "stopping it (its undelivered calls are lost)", self.drain_timeout_s, _END_MARGIN_S)
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
        self._stop_listener()

    def _stop_listener(self) -> None:
        self._outbox.put(("stop", None))  # ends the listener (after the child's last log records)
        if self._listener is not None:
            self._listener.join(5)
        self._outbox.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, method: str, args: tuple) -> None:
        if self._ended or self._listener is None:
            log.warning("observer call %s %s; ignored", method, "after the run ended" if self._ended
                        else "before the run started")
            return
        self._send(("call", method, _pack(args)))

    def _send(self, message: tuple, timeout: float | None = None) -> bool:
        """Write a message to the child, waiting while the pipe is full (backpressure) or until ``timeout``
        (then the child is stuck); False: the child is gone or stuck."""
        try:
            return call_with_deadline(lambda: self._write(message), timeout, "writing to the tracking process",
                                      lane="tracking")
        except StageTimeout:
            log.error("the tracking process is stuck (it read nothing for %g s); %s is lost", timeout, message[0])
            return False

    def _write(self, message: tuple) -> bool:
        try:
            with self._send_lock:
                self._inbox.send(message)
            return True
        except (BrokenPipeError, OSError):
            log.error("the tracking process is gone (exit code %s); %s is lost", self._process.exitcode,
                      message[1] if message[0] == "call" else message[0])
            return False

    def _listen(self) -> None:
        while True:
            kind, value = self._outbox.get()
            if kind == "stop":
                return
            if kind == "log":
                logging.getLogger(value.name).handle(value)
            else:
                self._replies.put((kind, value))

    def _reply(self, timeout: float | None) -> tuple[str, Any]:
        """The child's next reply; ("gone", None) when it died or ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            try:
                return self._replies.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._process.is_alive():
                    try:  # its last reply may have arrived just before it exited
                        return self._replies.get(timeout=_POLL_S)
                    except queue.Empty:
                        return "gone", None
        return "gone", None


def _mlflow_observer(tracking, run_name: str, resume_run_id: str | None, tags: dict[str, str] | None):
    # imported here, in the child: the training process never loads MLflow for tracking
    from rlpipe.engine.tracking.mlflow_observer import MLflowObserver

    return MLflowObserver(tracking, run_name, resume_run_id=resume_run_id, tags=tags)


def mlflow_process_observer(tracking, run_name: str, spool_path, resume_run_id: str | None = None,
                            tags: dict[str, str] | None = None) -> ProcessObserver:
    """The MLflow observer of a run, in its own process (``tracking``: a TrackingConfig; ``spool_path``
    picklable)."""
    make_inner = partial(_mlflow_observer, tracking, run_name, resume_run_id, tags)
    return ProcessObserver(make_inner, tracking.drain_timeout_s, spool_path, tracking.max_queued_calls,
                           tracking.start_timeout_s)
