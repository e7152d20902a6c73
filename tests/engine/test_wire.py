"""Arrow tables cross Ray process lines as Arrow IPC streams (rlpipe.engine.execution.wire)."""

import numpy as np
import pyarrow as pa
import pytest
import ray

from rlpipe.engine.execution.wire import table_from_ipc, table_to_ipc
from rlpipe.jagged import contiguous, from_flat


def batch(rows=64) -> pa.Table:
    lens = np.arange(rows) % 7 + 1
    return pa.table({
        "uid": pa.array([f"u{i // 4}" for i in range(rows)]),
        "response_ids": from_flat(np.arange(lens.sum(), dtype=np.int32), lens, pa.int32()),
        "reward": pa.array(np.linspace(0, 1, rows), pa.float32()),
        "note": pa.array([None if i % 3 else "x" for i in range(rows)]),
    }).replace_schema_metadata({"rlpipe": "1"})


@pytest.mark.parametrize("table", [
    batch(),
    batch().slice(10, 7),  # a slice: only its rows travel
    pa.concat_tables([batch(5), batch(3)]),  # chunked
    batch().slice(0, 0),  # empty
])
def test_ipc_round_trip_is_exact(table):
    back = table_from_ipc(table_to_ipc(table))
    assert back.equals(table) and back.schema.metadata == table.schema.metadata


def test_a_slice_sends_only_its_rows():
    whole, part = batch(4096), batch(4096).slice(100, 8)
    assert table_to_ipc(part).size < table_to_ipc(whole).size / 50


def test_contiguous_combines_only_when_chunked():
    one = batch()
    assert contiguous(one) is one
    chunked = pa.concat_tables([batch(5), batch(3)])
    out = contiguous(chunked)
    assert out.equals(chunked) and all(c.num_chunks == 1 for c in out.columns)


@ray.remote(num_cpus=0)
def _echo(table: pa.Table) -> tuple[pa.Table, str]:
    from ray import cloudpickle

    from rlpipe.engine.execution.wire import register_arrow_ipc

    register_arrow_ipc()  # as every engine worker does
    reducer = cloudpickle.CloudPickler.dispatch.get(pa.Table)
    return table, getattr(reducer, "__qualname__", "")


def test_tables_travel_as_ipc_through_ray_both_ways(ray_session):
    from ray import cloudpickle

    table = batch().slice(3, 40)
    assert "_register_cloudpickle_serializer" in cloudpickle.CloudPickler.dispatch[pa.Table].__qualname__
    back, worker_reducer = ray.get(_echo.remote(table))
    assert back.equals(table)
    assert "_register_cloudpickle_serializer" in worker_reducer
