"""Reading the RL math's inputs out of an Arrow batch (vectorized, through :mod:`rlpipe.jagged`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rlpipe.errors import BatchError
from rlpipe.jagged import from_padded, lengths, to_padded
from rlpipe.schemas.batch import RESPONSE_MASK, ROLLOUT_LOGPROBS, STATUS, STATUS_FAILED, UID
from rlpipe.stages.algos.ops import group_ids


def response_lengths(batch: pa.Table) -> np.ndarray:
    """Response length of every row (the length of every token-level column)."""
    return lengths(batch[RESPONSE_MASK])


def padded(
    batch: pa.Table, name: str, width: int, dtype: torch.dtype = torch.float32, allow_null: bool = False
) -> torch.Tensor:
    """Token-level column ``name`` as a right-padded ``[B, width]`` tensor; checks its rows match the mask.

    ``allow_null``: null rows (e.g. no reward for an infra failure) read as zeros instead of raising.
    """
    column = batch[name]
    nulls = column.is_null().to_numpy(zero_copy_only=False) if column.null_count else np.zeros(len(column), bool)
    if nulls.any() and not allow_null:
        raise BatchError(f"column {name!r} has {int(nulls.sum())} null rows; the stage writing it must fill every row")
    if not np.array_equal(lengths(column)[~nulls], response_lengths(batch)[~nulls]):
        raise BatchError(f"column {name!r} is not aligned with response_mask (different row lengths)")
    return to_padded(column, 0, dtype, width)


def mask_tensor(batch: pa.Table) -> torch.Tensor:
    """``response_mask`` as a float32 ``[B, R]`` tensor (R = longest response)."""
    return to_padded(batch[RESPONSE_MASK], 0, torch.float32)


def scalar(batch: pa.Table, name: str) -> torch.Tensor:
    """A numeric scalar column as a float32 ``[B]`` tensor."""
    return torch.from_numpy(batch[name].to_numpy(zero_copy_only=False).astype(np.float32))


def uids(batch: pa.Table) -> np.ndarray:
    return batch[UID].to_numpy(zero_copy_only=False)


def groups_by_appearance(batch: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """``(first_rows, rank)``: each group's first row, in order of first appearance, and every
    row's group number in that order (0 = the group that appears first)."""
    _, first, inverse = np.unique(uids(batch).astype(str), return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return first[order], rank[inverse.reshape(-1)]


def groups(batch: pa.Table) -> torch.Tensor:
    """Dense group ids of the rows (rows sharing a uid)."""
    return group_ids(uids(batch))


def failed_rows(batch: pa.Table) -> np.ndarray:
    """Bool ``[B]``: rows whose status is ``failed`` (infrastructure failure)."""
    return pc.fill_null(pc.equal(batch[STATUS], STATUS_FAILED), False).to_numpy(zero_copy_only=False)


def jagged(tensor: torch.Tensor, lens: np.ndarray) -> pa.ListArray:
    """Padded float tensor → ``list<float32>`` column with the rows' response lengths."""
    return from_padded(tensor.float(), lens, pa.float32())


def require_rollout_logprobs(batch: pa.Table, width: int | None = None) -> torch.Tensor:
    """The rollout's sampled-token logprobs ``[B, R]``, or an error saying how to get them.

    Bypass mode (π_old := π_rollout) and rollout correction both need them for every row.
    """
    column = batch.column(ROLLOUT_LOGPROBS) if ROLLOUT_LOGPROBS in batch.column_names else None
    if column is None or column.null_count:
        missing = "the batch has no such column" if column is None else f"{column.null_count} rows have none"
        raise BatchError(
            f"bypass mode and rollout correction need `{ROLLOUT_LOGPROBS}` for every row, but {missing}; "
            "make the generate stage return sampled-token logprobs, or use old_log_prob/trainer "
            "and drop the rollout_correction stage"
        )
    return padded(batch, ROLLOUT_LOGPROBS, int(response_lengths(batch).max(initial=0)) if width is None else width)
