"""Lineage primitives: batch fingerprints, params hashes, policy versions, record tables.

A node's execution record (:class:`rlpipe.engine.tracking.observer.NodeRecord`) names its
input and output batches by *fingerprint*: a content hash of the Arrow table, so
two runs that fed a node the same data can be recognised without storing the data.

:func:`fingerprint` hashes the schema (field names and types, not metadata) and,
per column, the *logical* bytes of every Arrow buffer with BLAKE2b: chunks are
combined first, slice offsets are applied, list and string offsets are rebased
to zero and null slots are dropped (their validity is hashed instead), so equal
content gives an equal fingerprint however the table was chunked or sliced.
Work is per column and per buffer, never per row; the table's hash combines its
columns' digests, and a column whose buffers were hashed recently (the columns a node
passes through unchanged, and the input a node shares with the previous node's output)
is not hashed again (:func:`_column_digest`). Floats are hashed bitwise
(``0.0`` and ``-0.0`` differ; NaNs with different payloads differ). Union,
run-end-encoded and list-view columns are not supported (:class:`BatchError`).

:func:`records_to_table` turns NodeRecords into the lineage table
(:data:`LINEAGE_SCHEMA`, one row per record, params and metrics as JSON) that
:mod:`rlpipe.engine.tracking.mlflow_observer` stores as ``lineage/lineage.parquet``;
:func:`table_to_records` reads it back. :func:`trajectory_lineage` describes each
trajectory of a batch: which prompt step it came from, which step consumed it and
which policy versions produced its tokens (what the async modes' staleness is
about).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.errors import BatchError
from rlpipe.schemas import batch as B

PROMPT_TEXT = "prompt_text"
"""Column the runtime adds to the trajectories it samples for MLflow: the decoded prompt."""

_DIGEST_SIZE = 16  # 128 bits: collisions are not a concern for lineage, short hex is

# ---------------------------------------------------------------------------
# fingerprints


def fingerprint(table: pa.Table) -> str:
    """Content hash (32 hex chars) of an Arrow table: schema plus every column's logical buffers."""
    return _table_fingerprint(table, _digests_of(table, {}, ()))


def _table_fingerprint(table: pa.Table, digests: dict[str, bytes]) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(b"rlpipe-fp-v2")
    h.update(table.num_rows.to_bytes(8, "little"))
    h.update(_schema_frames(table.schema))
    for name in table.column_names:
        h.update(digests[name])
    return h.hexdigest()


def _digests_of(table: pa.Table, known: dict[str, bytes], changed) -> dict[str, bytes]:
    """Each column's digest: ``known``'s for the columns not ``changed``, hashed for the others."""
    digests = {}
    for name, col in zip(table.column_names, table.columns):
        if name in known and name not in changed:
            digests[name] = known[name]
            continue
        try:
            digests[name] = _column_digest(col)
        except BatchError as exc:
            raise BatchError(f"cannot fingerprint column {name!r}: {exc}") from None
    return digests


_schemas: OrderedDict[pa.Schema, bytes] = OrderedDict()


def _schema_frames(schema: pa.Schema) -> bytes:
    """The hashed bytes of a schema (names and types, length-framed), remembered per schema."""
    with _cache_lock:
        frames = _schemas.get(schema)
    if frames is None:
        frames = b"".join(_frame(f.name.encode()) + _frame(str(f.type).encode()) for f in schema)
        with _cache_lock:
            _schemas[schema] = frames
            while len(_schemas) > _CACHE_SIZE:
                _schemas.popitem(last=False)
    return frames


class LazyFingerprint:
    """The fingerprint of a table, hashed the first time it is read (``str()``): the executor writes a node's
    lineage record while the driver waits on the next node, and each table is still hashed once.

    ``base``: the fingerprint of the table this one was made from by setting or appending the columns
    ``changed`` (a node's output from its input); the other columns' digests are taken from it, not recomputed."""

    __slots__ = ("_table", "_value", "_base", "_changed", "_digests")

    def __init__(self, table: pa.Table, base: "LazyFingerprint | None" = None, changed: Iterable[str] = ()):
        self._table: pa.Table | None = table
        self._value: str | None = None
        self._base = base
        self._changed = frozenset(changed)
        self._digests: dict[str, bytes] | None = None

    def column_digests(self) -> dict[str, bytes]:
        """Each column's digest (kept after the table is released: the next table's fingerprint reuses them)."""
        if self._digests is None:
            known = self._base.column_digests() if self._base is not None else {}
            self._digests = _digests_of(self._table, known, self._changed)
            self._base = None
        return self._digests

    def __str__(self) -> str:
        if self._value is None:
            self._value = _table_fingerprint(self._table, self.column_digests())
            self._table = None  # the record keeps its tables alive only until they are hashed
        return self._value


_CACHE_SIZE = 256  # columns: a few steps' tables (nodes add a handful of columns each)
_cache: OrderedDict[tuple, tuple[pa.ChunkedArray, bytes]] = OrderedDict()
_cache_lock = threading.Lock()  # the async modes fingerprint from several threads


def _column_digest(col: pa.ChunkedArray) -> bytes:
    """Digest of one column's logical content, remembered by the identity of its buffers.

    Every node's output table shares most columns (the same Arrow buffers) with its input, and its
    input is the previous node's output: without this, each step re-hashed every column once per
    node. The key is the chunks' buffer addresses, sizes, offsets and lengths; the cache holds a
    reference to the column, so those buffers stay alive and their addresses cannot be reused for
    other data while the entry exists (Arrow buffers are immutable)."""
    key = (str(col.type), tuple(
        (chunk.offset, len(chunk), tuple((b.address, b.size) if b is not None else None for b in chunk.buffers()))
        for chunk in col.chunks))
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit[1]
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    _update_array(h, _combined(col))
    digest = h.digest()
    with _cache_lock:
        _cache[key] = (col, digest)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return digest


def _frame(b: bytes) -> bytes:
    # Length-prefix names so ("ab", "c") and ("a", "bc") hash differently.
    return len(b).to_bytes(8, "little") + b


def _combined(col: pa.ChunkedArray) -> pa.Array:
    """One contiguous array per column; zero-copy when it already is one chunk."""
    if col.num_chunks == 1:
        return col.chunk(0)
    if col.num_chunks == 0:
        return pa.array([], type=col.type)
    return pa.concat_arrays(col.chunks)


def _update_offsets(h: Any, offsets: np.ndarray) -> tuple[int, int]:
    """Hash offsets rebased to start at 0; returns the (start, end) value range they cover."""
    start, end = int(offsets[0]), int(offsets[-1])
    h.update((offsets - offsets[0]).tobytes() if start else offsets.tobytes())
    return start, end


def _update_array(h: Any, arr: pa.Array) -> None:
    n = len(arr)
    h.update(n.to_bytes(8, "little"))
    if n == 0:
        return
    t = arr.type
    if pa.types.is_null(t):
        return
    if arr.null_count:
        # Bytes under null slots are unspecified: hash where the nulls are, then only the valid rows.
        valid = pc.is_valid(arr)
        h.update(b"V" + np.packbits(valid.to_numpy(zero_copy_only=False)).tobytes())
        arr = arr.filter(valid)
        n = len(arr)
        if n == 0:
            return
    if isinstance(t, pa.ExtensionType):
        _update_array(h, arr.storage)
    elif pa.types.is_dictionary(t):
        _update_array(h, arr.dictionary_decode())
    elif pa.types.is_boolean(t):
        # Bit-packed with an arbitrary bit offset: one byte per value is canonical and still vectorized.
        _update_array(h, pc.cast(arr, pa.uint8()))
    elif _is_fixed_width(t):
        w = t.bit_width // 8
        h.update(memoryview(arr.buffers()[1])[arr.offset * w : (arr.offset + n) * w])
    elif pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        large = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        dtype = np.int64 if large else np.int32
        bufs = arr.buffers()
        offs = np.frombuffer(bufs[1], dtype=dtype, count=n + 1, offset=arr.offset * np.dtype(dtype).itemsize)
        start, end = _update_offsets(h, offs)
        if end > start:
            h.update(memoryview(bufs[2])[start:end])
    elif pa.types.is_map(t):
        # No flatten kernel for maps: view as list<struct<key, value>> (offsets are absolute into .values).
        _update_array(h, pa.ListArray.from_arrays(arr.offsets, arr.values))
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        # .offsets and .flatten() already apply the slice offset; .flatten() is zero-copy.
        _update_offsets(h, arr.offsets.to_numpy())
        _update_array(h, arr.flatten())
    elif pa.types.is_fixed_size_list(t):
        _update_array(h, arr.flatten())
    elif pa.types.is_struct(t):
        for i in range(t.num_fields):
            _update_array(h, arr.field(i))
    else:
        raise BatchError(f"Arrow type {t} is not supported; cast the column to a primitive, string, list or struct type")


def _is_fixed_width(t: pa.DataType) -> bool:
    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_temporal(t)
        or pa.types.is_decimal(t)
        or pa.types.is_fixed_size_binary(t)
    ) and t.bit_width % 8 == 0


# ---------------------------------------------------------------------------
# params and versions


def _jsonable(obj: Any) -> Any:
    """Fallback for json.dumps: pydantic models, numpy scalars, sets, paths, anything else as str."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


def params_json(params: dict[str, Any]) -> str:
    """Stable JSON of a params dict (sorted keys, compact); the text :func:`params_hash` hashes."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"), default=_jsonable)


def params_hash(params: dict[str, Any]) -> str:
    """Hash (16 hex chars) of resolved params, stable across runs and processes."""
    return hashlib.blake2b(params_json(params).encode(), digest_size=8).hexdigest()


def policy_versions(table: pa.Table) -> list[int]:
    """Distinct policy versions in the ``token_versions`` column, sorted; [] when the column is absent."""
    if B.TOKEN_VERSIONS not in table.column_names:
        return []
    flat = pc.list_flatten(table.column(B.TOKEN_VERSIONS))
    distinct = pc.unique(flat).drop_null().to_numpy()
    return [int(v) for v in np.sort(distinct)]


def execution_fields(table_in: pa.Table | None, table_out: pa.Table, start: float, duration: float,
                     metrics: dict[str, float], input_fp: str | LazyFingerprint | None = None,
                     output_fp: LazyFingerprint | None = None) -> dict[str, Any]:
    """The NodeRecord fields of one node execution that come from its data (fingerprints, rows,
    versions) and its timing; whoever ran it adds run, step and node (the executor, or a rollout
    replica's feeder whose records the driver forwards). ``input_fp`` / ``output_fp`` save re-hashing
    a table whose fingerprint is known or shared with the next record."""
    if input_fp is None:
        input_fp = fingerprint(table_in) if table_in is not None else ""
    return {
        "input_fingerprint": str(input_fp),
        "output_fingerprint": str(output_fp) if output_fp is not None else fingerprint(table_out),
        "rows_in": table_in.num_rows if table_in is not None else 0,
        "rows_out": table_out.num_rows,
        "policy_versions": policy_versions(table_out),
        "start_time": start,
        "duration_s": duration,
        "metrics": dict(metrics),
    }


# ---------------------------------------------------------------------------
# lineage table (one row per NodeRecord)

LINEAGE_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("kind", pa.string()),
        pa.field("impl", pa.string()),
        pa.field("params", pa.string()),  # JSON, see params_json
        pa.field("params_hash", pa.string()),
        pa.field("code_hash", pa.string()),
        pa.field("input_fingerprint", pa.string()),
        pa.field("output_fingerprint", pa.string()),
        pa.field("rows_in", pa.int64()),
        pa.field("rows_out", pa.int64()),
        pa.field("policy_versions", pa.list_(pa.int64())),
        pa.field("trainer_version", pa.int64()),
        pa.field("start_time", pa.float64()),  # seconds since the epoch
        pa.field("duration_s", pa.float64()),
        pa.field("metrics", pa.string()),  # JSON object of float metrics
        pa.field("worker", pa.string()),
        pa.field("error", pa.string()),
        pa.field("cpu_s", pa.float64()),
        pa.field("run_queue_s", pa.float64()),
    ]
)
"""Schema of the lineage table: the fields of NodeRecord, params and metrics as JSON text."""

_JSON_FIELDS = ("params", "metrics")


def records_to_table(records: Iterable[NodeRecord]) -> pa.Table:
    """The lineage table of some NodeRecords (one row each, in the given order)."""
    rows = []
    for r in records:  # one row per node execution, not per trajectory: not a hot path
        d = dataclasses.asdict(r)
        d["params"] = params_json(d["params"])
        d["metrics"] = json.dumps({k: float(v) for k, v in d["metrics"].items()}, sort_keys=True)
        rows.append(d)
    return pa.Table.from_pylist(rows, schema=LINEAGE_SCHEMA)


def table_to_records(table: pa.Table) -> list[NodeRecord]:
    """Inverse of :func:`records_to_table` (used to continue the lineage of a resumed run)."""
    out = []
    names = [n for n in LINEAGE_SCHEMA.names if n in table.column_names]  # tables of older runs lack newer fields
    for d in table.select(names).to_pylist():
        for k in _JSON_FIELDS:
            d[k] = json.loads(d[k]) if d[k] else {}
        d["policy_versions"] = d["policy_versions"] or []
        d["worker"], d["error"] = d.get("worker") or "", d.get("error") or ""
        out.append(NodeRecord(**d))
    return out


# ---------------------------------------------------------------------------
# per-trajectory lineage

TRAJECTORY_LINEAGE_SCHEMA = pa.schema(
    [
        pa.field(B.UID, pa.string()),
        pa.field(B.SAMPLE_INDEX, pa.int32()),
        pa.field(B.PROMPT_STEP, pa.int32()),
        pa.field("consumed_step", pa.int32()),
        pa.field("num_tokens", pa.int32()),
        pa.field("min_version", pa.int32()),
        pa.field("max_version", pa.int32()),
        pa.field("versions_spanned", pa.int32()),
        pa.field("replica", pa.int32()),
    ]
)
"""Schema of :func:`trajectory_lineage`; version columns are null for rows without stamped tokens,
``replica`` where the rollout replica is unknown (:data:`BORROWED_REPLICA` where the trainer generated it)."""

BORROWED_REPLICA = -1
"""The ``replica`` of a trajectory the trainer generated (separate_async's hybrid borrow, rlpipe.modes.borrow)."""


def _replicas(table: pa.Table, replicas: dict[str, int] | None) -> pa.Array:
    """The rollout replica of each row from a uid → replica map (looked up once per distinct uid)."""
    n = table.num_rows
    if not replicas or B.UID not in table.column_names or not n:
        return pa.nulls(n, pa.int32())
    uids = _combined(table.column(B.UID))
    keys = pc.unique(uids).drop_null()
    values = pa.array([replicas.get(u) for u in keys.to_pylist()], pa.int32())
    return pc.take(values, pc.index_in(uids, value_set=keys))


def trajectory_lineage(table: pa.Table, step: int, replicas: dict[str, int] | None = None) -> pa.Table:
    """Per trajectory: uid, sample_index, prompt_step, the step consuming it, and its token versions.

    ``versions_spanned`` is the number of distinct policy versions among the
    row's tokens (1 for a trajectory generated under one policy; more when a
    weight push happened mid-generation). Columns missing from ``table`` come
    out null. ``replicas`` maps a prompt uid to the rollout replica that generated it.
    """
    n = table.num_rows
    names = table.column_names

    def scalar(name: str) -> pa.ChunkedArray | pa.Array:
        typ = TRAJECTORY_LINEAGE_SCHEMA.field(name).type
        return table.column(name).cast(typ) if name in names else pa.nulls(n, typ)

    num_tokens = np.zeros(n, dtype=np.int32)
    vmin = np.zeros(n, dtype=np.int32)
    vmax = np.zeros(n, dtype=np.int32)
    spanned = np.zeros(n, dtype=np.int32)
    has = np.zeros(n, dtype=bool)
    if B.TOKEN_VERSIONS in names and n:
        tv = _combined(table.column(B.TOKEN_VERSIONS))  # parent indices must be table-global
        num_tokens[:] = pc.fill_null(pc.list_value_length(tv), 0).to_numpy()
        flat = pc.list_flatten(tv)
        if len(flat):
            g = (
                pa.table({"row": pc.list_parent_indices(tv), "v": flat.cast(pa.int32())})
                .group_by("row")
                .aggregate([("v", "min"), ("v", "max"), ("v", "count_distinct")])
                .drop_null()  # rows whose tokens are all unstamped (null)
            )
            rows = g.column("row").to_numpy()
            vmin[rows] = g.column("v_min").to_numpy()
            vmax[rows] = g.column("v_max").to_numpy()
            spanned[rows] = g.column("v_count_distinct").to_numpy()
            has[rows] = True
    missing = ~has
    return pa.table(
        [
            scalar(B.UID),
            scalar(B.SAMPLE_INDEX),
            scalar(B.PROMPT_STEP),
            pa.array(np.full(n, step, dtype=np.int32)),
            pa.array(num_tokens),
            pa.array(vmin, mask=missing),
            pa.array(vmax, mask=missing),
            pa.array(spanned),
            _replicas(table, replicas),
        ],
        schema=TRAJECTORY_LINEAGE_SCHEMA,
    )
