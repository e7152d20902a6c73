"""The replay buffer's records and Arrow helpers: a prompt's live state, the events between two batches,
the column checks and splits of the tables it stores, and its error.

Kept apart from :mod:`rlpipe.engine.state.replay_buffer` so that module holds the algorithm alone
(admission, DAPO eviction, staleness, metrics, checkpoint); nothing here decides anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from rlpipe.errors import RlpipeError
from rlpipe.schemas import batch as B

PENDING, RUNNING, FINISHED = "pending", "running", "finished"


class ReplayBufferError(RlpipeError):
    """The replay buffer was used against its contract (duplicate uids, overfull groups, ...)."""


@dataclass
class _Prompt:
    uid: str
    row: pa.Table
    """The one-row prompt table (its prompt_step is the submit step)."""
    submit_step: int
    seq: int
    """Submission order: ties on submit_step go oldest first."""
    state: str = PENDING
    chunks: list[pa.Table] = field(default_factory=list)
    returned: int = 0


@dataclass
class _Window:
    """Events between two returned batches (reported with the later one)."""

    evicted_stale: int = 0
    evicted_dapo: int = 0
    evicted_failed: int = 0
    blocked: int = 0
    not_ready: int = 0
    late_rows: int = 0
    aborted_rows: int = 0


# ---------------------------------------------------------------------- helpers


def _strings(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=object)


def _require(table: pa.Table, names: tuple[str, ...], what: str) -> None:
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise ReplayBufferError(f"{what} lack columns {missing}; the replay buffer needs {list(names)}")


def _concat(tables: list[pa.Table], what: str) -> pa.Table:
    try:
        return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ReplayBufferError(f"{what} of different schemas cannot be stored together: {exc}") from exc


def _split_by_uid(table: pa.Table) -> list[tuple[str, pa.Table]]:
    """(uid, rows of that uid) per distinct uid, rows in their original order (one take, then slices)."""
    keys, inverse = np.unique(_strings(table[B.UID]).astype(str), return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    ordered = table.take(pa.array(order))
    bounds = np.concatenate([[0], np.cumsum(np.bincount(inverse, minlength=len(keys)))])
    return [(str(k), ordered.slice(int(bounds[i]), int(bounds[i + 1] - bounds[i]))) for i, k in enumerate(keys)]
