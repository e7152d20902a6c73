"""Fingerprints, params hashes, policy versions and lineage tables on hand-built Arrow tables."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from rlpipe.engine.tracking.lineage import (
    LazyFingerprint,
    LINEAGE_SCHEMA,
    TRAJECTORY_LINEAGE_SCHEMA,
    fingerprint,
    params_hash,
    policy_versions,
    records_to_table,
    table_to_records,
    trajectory_lineage,
)
from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.errors import BatchError


def batch() -> pa.Table:
    """Six trajectories covering the column kinds of a batch, with nulls and empty lists."""
    return pa.table(
        {
            "uid": ["p0", "p0", "p1", "p1", "p2", "p2"],
            "sample_index": pa.array([0, 1, 0, 1, 0, 1], pa.int32()),
            "prompt_step": pa.array([3, 3, 4, 4, 4, None], pa.int32()),
            "response_ids": pa.array([[5, 6, 7], [8], [], [9, 10], None, [11, 12, 13, 14]], pa.list_(pa.int32())),
            "token_versions": pa.array([[2, 2, 3], [3], [], [4, 4], None, [1, 2, 2, 5]], pa.list_(pa.int32())),
            "reward": pa.array([1.0, 0.0, None, 0.5, 0.25, -1.0], pa.float32()),
            "response_text": ["abc", "d", "", None, "xyz", "w"],
            "ok": [True, False, None, True, True, False],
            "source": pa.array(["gsm8k", "math", "gsm8k", "math", "gsm8k", "gsm8k"]).dictionary_encode(),
            "info": pa.array([{"a": 1, "b": "x"}, None, {"a": 3, "b": None}, {"a": 4, "b": "y"}, {"a": 5, "b": "z"}, {"a": 6, "b": "w"}]),
            "fixed": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], None, [7.0, 8.0], [9.0, 0.0]], pa.list_(pa.float64(), 2)),
        }
    )


def rechunked(t: pa.Table, cuts: list[int]) -> pa.Table:
    bounds = [0, *cuts, t.num_rows]
    return pa.concat_tables([t.slice(a, b - a) for a, b in zip(bounds, bounds[1:])])


def test_fingerprint_is_stable_and_hex():
    fp = fingerprint(batch())
    assert fp == fingerprint(batch())
    assert len(fp) == 32 and int(fp, 16) >= 0


def test_fingerprint_ignores_chunking():
    t = batch()
    for cuts in ([1], [2, 3], [1, 2, 3, 4, 5]):
        other = rechunked(t, cuts)
        assert other.column("uid").num_chunks == len(cuts) + 1
        assert fingerprint(other) == fingerprint(t)
    assert fingerprint(rechunked(t, [3]).combine_chunks()) == fingerprint(t)


def test_fingerprint_of_slices_equals_fresh_copies():
    t = batch()
    big = pa.concat_tables([t, t, t]).combine_chunks()  # slices into one set of buffers, odd offsets
    for start, length in [(1, 4), (5, 6), (7, 3), (13, 5), (0, 0)]:
        sliced = big.slice(start, length)
        fresh = pa.Table.from_pylist(sliced.to_pylist(), schema=sliced.schema)
        assert sliced.column("response_ids").chunk(0).offset == start
        assert fingerprint(sliced) == fingerprint(fresh), (start, length)


def test_fingerprint_ignores_bytes_under_nulls():
    values = pa.array([1, 99, 3], pa.int64())
    with_garbage = pa.Array.from_buffers(pa.int64(), 3, [pa.py_buffer(np.packbits([1, 0, 1], bitorder="little").tobytes()), values.buffers()[1]])
    clean = pa.array([1, None, 3], pa.int64())
    assert fingerprint(pa.table({"x": with_garbage})) == fingerprint(pa.table({"x": clean}))


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["response_ids"][0].__setitem__(1, 60),  # one token of one row
        lambda d: d["token_versions"][5].__setitem__(3, 4),
        lambda d: d["reward"].__setitem__(3, 0.75),
        lambda d: d["response_text"].__setitem__(0, "abd"),
        lambda d: d["reward"].__setitem__(2, 0.0),  # null → value
        lambda d: d["ok"].__setitem__(1, True),
        lambda d: d["info"][0].__setitem__("b", "q"),
    ],
)
def test_fingerprint_changes_with_one_value(change):
    t = batch()
    d = t.to_pydict()
    change(d)
    changed = pa.Table.from_pydict(d, schema=t.schema)
    assert fingerprint(changed) != fingerprint(t)


def test_fingerprint_sees_schema_and_row_boundaries():
    t = pa.table({"a": pa.array([[1, 2], [3]], pa.list_(pa.int32()))})
    regrouped = pa.table({"a": pa.array([[1], [2, 3]], pa.list_(pa.int32()))})
    renamed = t.rename_columns(["b"])
    widened = t.cast(pa.schema([("a", pa.list_(pa.int64()))]))
    fps = {fingerprint(x) for x in (t, regrouped, renamed, widened)}
    assert len(fps) == 4
    assert fingerprint(pa.table({"a": pa.array([], pa.int32())})) != fingerprint(pa.table({"a": pa.array([0], pa.int32())}))


def test_a_fingerprint_built_on_its_inputs_digests_equals_a_fresh_one():
    before = batch()
    base = LazyFingerprint(before)
    assert str(base) == fingerprint(before)  # hashed once: the table is released, its column digests kept
    scores = pa.array([0.5, 1.0, -2.0, 0.0, 3.0, 1.5], pa.float32())
    text = pa.array(["x", "y", "z", "u", "v", "w"])
    after = before.set_column(before.schema.get_field_index("response_text"), "response_text", text)
    after = after.append_column("score", scores)
    derived = LazyFingerprint(after, base, ["response_text", "score"])
    assert str(derived) == fingerprint(after) != str(base)
    # the columns named changed are the ones rehashed: a replaced column left off the list keeps its old digest
    stale = LazyFingerprint(after, LazyFingerprint(before), ["score"])
    assert str(stale) != fingerprint(after)


def test_fingerprint_rejects_unsupported_types_with_advice():
    u = pa.UnionArray.from_sparse(pa.array([0, 1], pa.int8()), [pa.array([1, 2]), pa.array(["a", "b"])])
    with pytest.raises(BatchError, match="column 'u'.*cast the column"):
        fingerprint(pa.table({"u": u}))


def test_params_hash_is_order_independent_and_sensitive():
    a = params_hash({"lr": 1e-6, "clip": {"low": 0.2, "high": 0.28}, "steps": [1, 2]})
    b = params_hash({"steps": [1, 2], "clip": {"high": 0.28, "low": 0.2}, "lr": 1e-6})
    assert a == b and len(a) == 16
    assert params_hash({"lr": 2e-6, "clip": {"low": 0.2, "high": 0.28}, "steps": [1, 2]}) != a
    assert params_hash({"x": np.int64(3)}) == params_hash({"x": 3})


def test_policy_versions():
    t = batch()
    assert policy_versions(t) == [1, 2, 3, 4, 5]
    assert policy_versions(rechunked(t, [2, 4])) == [1, 2, 3, 4, 5]
    assert policy_versions(t.slice(0, 2)) == [2, 3]
    assert policy_versions(t.drop_columns(["token_versions"])) == []
    assert policy_versions(t.slice(2, 1)) == []  # one empty list


def test_trajectory_lineage_per_row():
    t = rechunked(batch(), [1, 4])  # parent indices must not restart per chunk
    out = trajectory_lineage(t, step=7)
    assert out.schema == TRAJECTORY_LINEAGE_SCHEMA
    d = out.to_pydict()
    assert d["uid"] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert d["sample_index"] == [0, 1, 0, 1, 0, 1]
    assert d["prompt_step"] == [3, 3, 4, 4, 4, None]
    assert d["consumed_step"] == [7] * 6
    assert d["num_tokens"] == [3, 1, 0, 2, 0, 4]
    assert d["min_version"] == [2, 3, None, 4, None, 1]
    assert d["max_version"] == [3, 3, None, 4, None, 5]
    assert d["versions_spanned"] == [2, 1, 0, 1, 0, 3]
    assert d["replica"] == [None] * 6
    with_replicas = trajectory_lineage(t, step=7, replicas={"p0": 1, "p2": 0, "other": 3})
    assert with_replicas.column("replica").to_pylist() == [1, 1, None, None, 0, 0]


def test_trajectory_lineage_without_optional_columns():
    out = trajectory_lineage(pa.table({"uid": ["a", "b"]}), step=0)
    d = out.to_pydict()
    assert d["sample_index"] == [None, None] and d["min_version"] == [None, None]
    assert d["versions_spanned"] == [0, 0]
    assert trajectory_lineage(batch().slice(0, 0), step=1).num_rows == 0


def record(step: int, node: str, **kw) -> NodeRecord:
    base = dict(
        run_id="r1", step=step, node=node, kind=node, impl=f"{node}_impl", params={"lr": 0.1, "nested": {"k": [1, 2]}},
        params_hash="ph", code_hash="ch", input_fingerprint="in", output_fingerprint="out", rows_in=4, rows_out=4,
        policy_versions=[step], trainer_version=step, start_time=1000.0 + step, duration_s=0.5, metrics={f"{node}/m": 1.5},
    )
    base.update(kw)
    return NodeRecord(**base)


def test_records_round_trip_through_the_lineage_table():
    records = [record(s, n) for s in (0, 1) for n in ("generate", "reward", "update")]
    records[0].input_fingerprint = ""  # source node
    records[1].policy_versions = []
    records[2].cpu_s = 0.25
    table = records_to_table(records)
    assert table.schema == LINEAGE_SCHEMA
    assert table.num_rows == 6
    assert table.column("node").to_pylist() == ["generate", "reward", "update"] * 2
    assert table_to_records(table) == records
    older = table.drop_columns(["cpu_s"])  # a run recorded before the field: read back as not measured
    assert [r.cpu_s for r in table_to_records(older)] == [None] * 6
