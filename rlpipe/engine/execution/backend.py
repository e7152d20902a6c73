"""The execution backend interface: where the step executor's calls physically run.

Implemented by :class:`rlpipe.engine.execution.ray_runtime.RayBackend` (Ray tasks and worker actors) and
:class:`rlpipe.engine.execution.inline.InlineBackend` (this process).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np
import pyarrow as pa

from rlpipe.engine.stage_call import ChainedStage, ChainStep
from rlpipe.stage import StageContext, StageResult


class Backend(Protocol):
    """Where stages physically run (Ray: rlpipe.engine.execution.ray_runtime; in-process: rlpipe.engine.execution.inline).

    The executor asks what a backend can do through ``task_stages_in_workers`` and ``chains_tasks`` once, when it
    compiles its calls (rlpipe.engine.execution.call_plan); a backend that cannot chain never gets a chain."""

    workers: Any
    shared_filesystem: bool
    """Workers see the driver's paths (resources.shared_filesystem): trainer ranks write checkpoints and saved
    models into the output folder themselves; otherwise their files come to the driver through the object store."""
    task_stages_in_workers: bool
    """A role with one worker runs the task nodes next to its own in one call (:meth:`start_worker_chain`)."""
    chains_tasks: bool
    """Consecutive task nodes run as one task (:meth:`run_task_chain`)."""

    def group_size(self, role: str) -> int: ...

    def host(self, role: str) -> str:
        """The role whose workers run ``role``'s stages: itself, or the role it is colocated with."""
        ...

    def hosted_roles(self, role: str) -> tuple[str, ...]:
        """Every role the workers of ``role`` host (just ``role`` unless colocated)."""
        ...

    def group_nodes(self, role: str) -> list[str]:
        """The cluster nodes of the role's workers, for lineage (empty: this machine)."""
        ...

    def overlap(self, work: Callable[[], None]) -> bool:
        """Call ``work()`` whenever the backend waits on a remote call; True when it will (the executor then
        writes each node's lineage record while the next call runs), False when it never waits (in-process: the
        records are written at once)."""
        ...

    def run_task(self, kind: str, impl: str, params: dict, table: pa.Table, ctx: StageContext,
                 timeout_s: float | None = None) -> StageResult:
        """The stage as a task; :class:`StageTimeout` after ``timeout_s`` (None: no limit)."""
        ...

    def run_task_chain(self, stages: list[ChainedStage], table: pa.Table, ctxs: list[StageContext],
                       timeout_s: float | None = None) -> list[ChainStep]:
        """Consecutive task stages as one task (only where ``chains_tasks``)."""
        ...

    def start_worker_chain(self, role: str, stages: list[ChainedStage], table: Any, ctxs: list[StageContext],
                           hand_on: bool = False) -> Any:
        """Submit a worker chain (only where ``task_stages_in_workers``): ``table`` is the input or the handle of a
        started chain that hands its last table on; returns this call's handle."""
        ...

    def finish_worker_chain(self, call: Any, timeout_s: float | None = None) -> list[ChainStep]:
        """Wait for a started worker chain; its steps."""
        ...

    def run_on_workers(self, role: str, kind: str, impl: str, params: dict, tables: list[pa.Table],
                       ctxs: list[StageContext], timeout_s: float | None = None) -> list[StageResult]:
        """The stage on every worker of ``role``; :class:`StageTimeout` naming the late ones after ``timeout_s``."""
        ...

    def shards(self, role: str, table: pa.Table, dp_rank_column: str) -> list[np.ndarray]: ...

    def shutdown(self, finished: bool = False) -> None:
        """Release the workers; ``finished``: the run ended by finishing (its workers may be kept for the next
        run, rlpipe.engine.execution.worker_pool)."""
        ...
