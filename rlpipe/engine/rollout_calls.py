"""The driver's calls to the rollout replicas' services (rlpipe.engine.state.rollout_service), shared by the async
modes' training prompts and their evaluations (rlpipe.engine.evaluation.BackgroundEval): prompts split across the
replicas on a lane, and a lane's finished groups collected and scored by the generation-side nodes."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from rlpipe.engine.state.rollout_service import TRAIN_LANE
from rlpipe.stage import StageContext
from rlpipe.stages.generate import generation_seed


def submit_to_replicas(runtime, step: int, prompts: pa.Table, params: dict, lane: str = TRAIN_LANE) -> list[np.ndarray]:
    """Split ``prompts`` evenly across the rollout replicas and queue them on ``lane`` of each one's service (the
    seed of replica r is the generate stage's at ``step`` and dp_rank r); returns each replica's rows."""
    replicas = runtime.backend.group_size("rollout")
    split = np.array_split(np.arange(prompts.num_rows), replicas)
    for replica, rows in enumerate(split):
        if len(rows):
            seed = generation_seed(StageContext(step=step, seed=runtime.config.seed, dp_rank=replica))
            runtime.workers.call("rollout", "service_submit", prompts.take(pa.array(rows)), params, seed, lane,
                                 rank=replica)
    return split


def collect_scored(runtime, step: int, generate_node: Any, nodes: Sequence[Any], min_groups: int,
                   timeout: float, lane: str = TRAIN_LANE, extras: dict | None = None) -> pa.Table | None:
    """The finished groups of ``lane`` from every replica (waiting up to ``timeout`` for ``min_groups`` each),
    recorded as ``generate_node``'s execution and run through ``nodes``; None when none came back."""
    start = time.time()
    parts = [t for t in runtime.workers.call("rollout", "service_collect", min_groups, timeout, None, lane)
             if t.num_rows]
    if not parts:
        return None
    table = pa.concat_tables(parts)
    runtime.executor.record(step, generate_node, None, table, start, time.time() - start,
                            {"generate/collected_rows": float(table.num_rows)})
    scored, _ = runtime.executor.run(step, table, list(nodes), extras=extras)
    return scored
