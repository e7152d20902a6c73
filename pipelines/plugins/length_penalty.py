"""A new stage kind in one file: a length penalty between reward and advantage.

Name the file in a pipeline and put a node of the kind in its stages
(pipelines/quickstart_length_penalty.yaml)::

    plugins: [pipelines/plugins/length_penalty.py]
    stages:
      - {kind: reward, impl: rule}
      - {kind: length_penalty, impl: linear, params: {coef: 0.05}}
      - {kind: advantage, impl: grpo}

The node reads ``token_rewards`` and writes it back, so the planner runs it after the reward node that
wrote them and before every node that reads them (the advantage). It runs as a Ray task, or inside the
rollout worker's call next to the reward task; the driver ships this file's source to the workers.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pydantic import Field

from rlpipe.jagged import from_flat, last_token_placement, offsets_and_values
from rlpipe.stage import StageParams, StageResult, cols, stage
from rlpipe.stage_kinds import stage_kind

stage_kind("length_penalty", doc="Lowers each response's reward by its length (rewrites token_rewards).")


class LinearPenalty(StageParams):
    """Reward minus ``coef`` per valid response token, taken at the last one (where the score sits)."""

    coef: float = Field(0.01, ge=0)
    """Penalty per valid response token."""


@stage("length_penalty", "linear", params=LinearPenalty, reads=cols("token_rewards", "response_mask"),
       writes=cols("token_rewards"))
def linear(batch: pa.Table, params: LinearPenalty, ctx) -> StageResult:
    """token_rewards minus coef × (valid response tokens), on each row's last valid token."""
    mask = batch.column("response_mask")
    offsets, mask_values = offsets_and_values(mask)
    valid = np.add.reduceat(mask_values.astype(np.int64), offsets[:-1]) if len(mask_values) else \
        np.zeros(batch.num_rows, np.int64)
    valid[np.diff(offsets) == 0] = 0  # reduceat reads the next row's first value for an empty row
    penalty = params.coef * valid
    _, rewards = offsets_and_values(batch.column("token_rewards"))
    _, placed = offsets_and_values(last_token_placement(-penalty, mask))
    rewritten = from_flat((rewards + placed).astype(np.float32), np.diff(offsets), pa.float32())
    return StageResult(columns={"token_rewards": rewritten},
                       metrics={"length_penalty/mean": float(penalty.mean()) if len(penalty) else 0.0})
