"""The execution backend interface: where the step executor's calls physically run.

Implemented by :class:`rlpipe.engine.execution.ray_runtime.RayBackend` (Ray tasks and worker actors) and
:class:`rlpipe.engine.execution.inline.InlineBackend` (this process).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from rlpipe.stage import StageContext, StageResult


class Backend(Protocol):
    """Where stages physically run (Ray: rlpipe.engine.execution.ray_runtime; in-process: rlpipe.engine.execution.inline)."""

    workers: Any
    shared_filesystem: bool
    """Workers see the driver's paths (resources.shared_filesystem): trainer ranks write checkpoints and saved
    models into the output folder themselves; otherwise their files come to the driver through the object store."""

    def group_size(self, role: str) -> int: ...

    def run_task(self, kind: str, impl: str, params: dict, table: pa.Table, ctx: StageContext,
                 timeout_s: float | None = None) -> StageResult:
        """The stage as a task; :class:`StageTimeout` after ``timeout_s`` (None: no limit)."""
        ...

    def run_on_workers(self, role: str, kind: str, impl: str, params: dict, tables: list[pa.Table],
                       ctxs: list[StageContext], timeout_s: float | None = None) -> list[StageResult]:
        """The stage on every worker of ``role``; :class:`StageTimeout` naming the late ones after ``timeout_s``."""
        ...

    def shards(self, role: str, table: pa.Table, dp_rank_column: str) -> list[np.ndarray]: ...

    def shutdown(self) -> None: ...

    # optional: ``overlap(work)``: call ``work()`` whenever the backend waits on a remote call (Ray). The executor
    # then writes each node's lineage record while the next node runs instead of before it starts.
    # ``task_stages_in_workers`` with ``host(role)``, ``start_worker_chain(role, stages, table | started call, ctxs,
    # hand_on)`` and ``finish_worker_chain(call, timeout_s)``: a role with one worker runs the task nodes next to
    # its own in one call (Ray); ``run_task_chain(stages, table, ctxs, timeout_s)``: consecutive task nodes in one.
