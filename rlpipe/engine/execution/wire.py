"""Arrow tables across Ray process lines as Arrow IPC streams.

Ray's own reducer for ``pa.Table`` (ray._private.arrow_serialization) turns each
column into Python payload objects; for the batches the engine moves (tens of
columns, list-typed token columns) that costs 2-4× more than one Arrow IPC
stream, which Ray then ships as a single out-of-band buffer and the receiver
maps without copying (64 rows × 18 columns: 2.5-4.7 ms → 1.2-1.3 ms per actor
call on this machine, measured in the session that added this). The stream carries only
the rows a sliced table references, like Ray's reducer.

The reducer is registered per process (cloudpickle's dispatch table) by every
process that sends tables: the driver after ``ray.init`` and each worker
before it runs engine code. The receiving side needs nothing: the deserializer
travels by reference with the payload.
"""

from __future__ import annotations

import pyarrow as pa


def table_to_ipc(table: pa.Table) -> pa.Buffer:
    """One Arrow IPC stream holding ``table`` (schema with metadata, every chunk)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def table_from_ipc(buffer: pa.Buffer) -> pa.Table:
    """The table of an Arrow IPC stream (zero-copy over ``buffer``)."""
    return pa.ipc.open_stream(buffer).read_all()


_registered = False


def register_arrow_ipc() -> None:
    """Make this (Ray-connected) process send ``pa.Table`` as Arrow IPC; idempotent."""
    global _registered
    if _registered:
        return
    import ray.util

    ray.util.register_serializer(pa.Table, serializer=table_to_ipc, deserializer=table_from_ipc)
    _registered = True
