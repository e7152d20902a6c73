"""In-process backend: the same stages and worker states, no Ray.

Used to measure the engine's overhead (``benchmarks/engine_overhead.py``: the
DAG on Ray vs the same stage functions called inline) and to check that Ray
execution changes nothing (tests). Data-parallel roles must have one worker
here: gloo ranks need processes of their own.

Timeouts: a stage here is a Python call in this process, which nothing can
preempt. Each stage runs in a daemon thread that the executor waits on for the
node's ``timeout_s`` (:func:`~rlpipe.deadline.call_with_deadline`);
past it the run fails naming the stage, and the hung call is abandoned (it ends
with the process).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from rlpipe.deadline import call_with_deadline
from rlpipe.engine.execution.deferred import DeferredCalls
from rlpipe.engine.stage_call import run_stage, shard_rows
from rlpipe.engine.state.roles import WORKER_ROLES
from rlpipe.errors import ConfigError
from rlpipe.schemas.config import PipelineConfig
from rlpipe.stage import StageContext, StageResult


class LocalWorkerCalls(DeferredCalls):
    """``ctx.workers`` for in-process states; ``call_async`` returns plain values."""

    in_process = True

    def __init__(self, states: dict[str, list[Any]]):
        self.states = states
        super().__init__()

    def call(self, role: str, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[Any]:
        targets = self.states[role] if rank is None else [self.states[role][rank]]
        return [getattr(state, method)(*args, **kwargs) for state in targets]

    call_async = call

    def resolve(self, futures: list[Any]) -> list[Any]:
        """The values of ``call_async`` results (here they already are values)."""
        return list(futures)

    def has_role(self, role: str) -> bool:
        return role in self.states

    def take_round_trips(self) -> list[float]:
        """None: an in-process call is a function call, not a round trip."""
        return []

    def colocated(self, role: str, other: str) -> bool:
        """Never: in-process states already call each other directly (no object store between them)."""
        return False

    def handle(self, role: str, rank: int = 0) -> Any:
        """The state object of one worker (in-process: other workers call it directly)."""
        return self.states[role][rank]


class InlineBackend:
    """Runs every stage in this process against locally built worker states."""

    shared_filesystem = True
    """One process: the workers see the driver's files."""
    task_stages_in_workers = False
    """No worker chains: every node is a call of its own (a call costs nothing here)."""
    chains_tasks = False

    def __init__(self, config: PipelineConfig, roles: set[str]):
        self.sharded: dict[str, bool] = {}
        states: dict[str, list[Any]] = {}
        for role in sorted(roles):
            spec = WORKER_ROLES.get(role)
            size = spec.size(config)
            if spec.sharded and size > 1:
                raise ConfigError(f"the inline backend runs one {role} worker; set trainer.dp_size=1")
            states[role] = [spec.build(config, rank, size, None) for rank in range(size)]
            self.sharded[role] = spec.sharded
        self.states = states
        self.workers = LocalWorkerCalls(states)

    def group_size(self, role: str) -> int:
        return len(self.states.get(role, [None]))

    def host(self, role: str) -> str:
        return role

    def hosted_roles(self, role: str) -> tuple[str, ...]:
        return (role,)

    def group_nodes(self, role: str) -> list[str]:
        return []

    def overlap(self, work) -> bool:
        """Never waits on anything: the executor writes each record at once."""
        return False

    def run_task_chain(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("the inline backend runs no chains (chains_tasks is False)")

    def start_worker_chain(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("the inline backend runs no chains (task_stages_in_workers is False)")

    finish_worker_chain = start_worker_chain

    def run_task(self, kind: str, impl: str, params: dict, table: pa.Table, ctx: StageContext,
                 timeout_s: float | None = None) -> StageResult:
        return call_with_deadline(lambda: run_stage(kind, impl, params, table, ctx), timeout_s,
                                  "the inline backend (task stage in this process)")

    def run_on_workers(self, role: str, kind: str, impl: str, params: dict, tables: list[pa.Table],
                       ctxs: list[StageContext], timeout_s: float | None = None) -> list[StageResult]:
        def run_all() -> list[StageResult]:
            return [run_stage(kind, impl, params, t, c, s) for s, t, c in zip(self.states[role], tables, ctxs)]

        return call_with_deadline(run_all, timeout_s, f"the inline backend ({role} worker in this process)")

    def shards(self, role: str, table: pa.Table, dp_rank_column: str) -> list[np.ndarray]:
        return shard_rows(table, len(self.states[role]), self.sharded[role], dp_rank_column)

    def shutdown(self, finished: bool = False) -> None:
        """Close every state (a rollout replica stops the engine server it owns) and forget them (``finished``:
        nothing is kept in process)."""
        for states in self.states.values():
            for state in states:
                if callable(close := getattr(state, "close", None)):
                    close()
        self.states.clear()
