"""Group bookkeeping shared by the modes and stages, checked by hand."""

import pyarrow as pa

from rlpipe.stages.algos.batch_io import groups_by_appearance


def test_groups_by_appearance_orders_groups_by_their_first_row():
    # uids sort as a < b < c, but appear as c, a, b
    batch = pa.table({"uid": ["c", "a", "c", "b", "a"]})
    first, rank = groups_by_appearance(batch)
    assert first.tolist() == [0, 1, 3]
    assert rank.tolist() == [0, 1, 0, 2, 1]
