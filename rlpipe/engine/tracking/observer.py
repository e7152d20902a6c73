"""Execution records and the observer interface.

The executor produces one :class:`NodeRecord` per (step, node) execution and
hands it to the run's observers. Stages only return metrics; lineage (which
weights, which impl, which input produced which output) is added here, by the
engine. :mod:`rlpipe.engine.tracking.mlflow_observer` is the MLflow implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class NodeRecord:
    """Lineage of one node execution."""

    run_id: str
    """Engine run id (the MLflow parent run id when tracking is on)."""
    step: int
    """Global step of the DAG execution."""
    node: str
    """Node name in the pipeline."""
    kind: str
    """Stage kind."""
    impl: str
    """Registered implementation name."""
    params: dict[str, Any]
    """Resolved params of the implementation."""
    params_hash: str
    """Hash of the resolved params (stable across runs)."""
    code_hash: str
    """Hash of the implementation's source."""
    input_fingerprint: str
    """Fingerprint of the input batch (empty for source nodes)."""
    output_fingerprint: str
    """Fingerprint of the batch after this node."""
    rows_in: int
    """Rows of the input batch."""
    rows_out: int
    """Rows of the output batch."""
    policy_versions: list[int]
    """Distinct policy versions present in the output's token_versions (sorted)."""
    trainer_version: int
    """The trainer's policy version when the node ran."""
    start_time: float
    """Seconds since the epoch when the node started."""
    duration_s: float
    """Wall time of the execution in seconds."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The stage's own metrics."""
    worker: str = ""
    """Where it ran: ``task``, ``driver``, or the worker role with its replica count (``rollout×2``)."""
    error: str = ""
    """The error that ended this execution (empty when it succeeded)."""
    cpu_s: float | None = None
    """CPU seconds of the thread that ran the stage, where a worker's or a task's call measured it (None: not
    measured: a node on several workers, a driver stage, a replica's collection)."""
    run_queue_s: float | None = None
    """Seconds that thread was ready to run but waited for a core (rlpipe.engine.thread_clock; None: not measured
    or not reported): the part of ``duration_s`` other processes on its cores cost it (``rlpipe simulate``
    calibrates a node's own cost on ``duration_s − run_queue_s``)."""


class Observer(Protocol):
    """Receives the life of a run. Implementations must not raise on tracking trouble they can survive."""

    def on_run_start(self, config: dict[str, Any], pipeline_yaml: str, plan_summary: dict[str, Any]) -> str:
        """Called once before step 0; returns the run id."""
        ...

    def on_node_end(self, record: NodeRecord) -> None:
        """Called after every node execution."""
        ...

    def on_step_end(self, step: int, metrics: dict[str, float], trajectories: Any | None,
                    trajectory_lineage: Any | None = None) -> None:
        """Called after every global step with headline metrics, (optionally) a pyarrow table of sampled
        trajectories, and the lineage of every consumed trajectory (uid, versions, consuming step)."""
        ...

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics that belong to ``step`` but were measured later (an async run's evaluation of the weights
        that step pushed), logged at that step."""
        ...

    def on_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """A file or directory produced by the run (a saved model, a checkpoint)."""
        ...

    def on_node_input(self, step: int, node: str, table: Any, context: dict[str, Any]) -> None:
        """The input batch of a node execution and its stage context (step, seed, policy version, extras,
        carry), on steps chosen by ``tracking.record_batches_every``: what ``rlpipe replay`` re-runs.
        Optional: the executor skips observers without it."""
        ...

    def on_run_end(self, status: str, error: str | None = None) -> None:
        """Called once; status is FINISHED, FAILED or KILLED. Everything produced so far must be persisted."""
        ...


class NullObserver:
    """Tracking off. ``run_id``: the run a resume continues (its output folder is named by it), else a new id."""

    def __init__(self, run_id: str | None = None):
        self.run_id = run_id

    def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
        import uuid

        return self.run_id or uuid.uuid4().hex

    def on_node_end(self, record: NodeRecord) -> None:
        pass

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None) -> None:
        pass

    def on_metrics(self, step, metrics) -> None:
        pass

    def on_artifact(self, local_path, artifact_path=None) -> None:
        pass

    def on_node_input(self, step, node, table, context) -> None:
        pass

    def on_run_end(self, status, error=None) -> None:
        pass
