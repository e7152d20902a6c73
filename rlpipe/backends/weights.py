"""The weight transport format: a model's tensors flattened into byte buckets.

Implements boundaries 1-3 of a weight push (SPEC R6) for the embedded backends:

1. export: training names → inference names through a ``name_map`` hook
   (identity for the embedded engine: both sides are the same HF model);
2. transport format: every parameter's bytes packed into contiguous ``uint8``
   numpy buckets of about ``bucket_bytes`` each, with per-tensor metadata
   (name, shape, dtype, offset, nbytes) and an XXH3-128 checksum per bucket.
   Numpy (not torch) so a bucket crosses Ray's object store zero-copy;
3. load: checksums, names, shapes and dtypes are all checked *before* the first
   parameter is written, so a bad push leaves the engine's weights untouched.

Delta format: :func:`delta_bucket` / :func:`apply_delta` send only the changed 4-byte
words of a bucket, checksummed at both ends (pushed by weight_sync impl ``delta``, see
:mod:`rlpipe.backends.weight_delta`).
Left out here: double buffering, fused-QKV splitting (they belong to the transports /
exporters built on top of this format), and buffers such as rotary frequencies
(non-persistent, derived from the model config).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import xxhash

from rlpipe.errors import RlpipeError

DEFAULT_BUCKET_BYTES = 64 << 20
_ALIGN = 64  # every tensor starts at a multiple of this, so byte views can be re-typed in place

NameMap = Callable[[str], str]


class WeightTransportError(RlpipeError):
    """A weight bucket does not match the model it is loaded into, or was corrupted in transit."""


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightBucket:
    """Contiguous bytes of several tensors, their metadata and a checksum of the bytes."""

    data: np.ndarray  # uint8, 1-D
    tensors: tuple[TensorMeta, ...]
    checksum: str

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True)
class WeightPush:
    """One weight push as it leaves the trainer (boundary 1, export): the buckets and when they were made.

    ``exported_at`` (wall clock) lets the receiving replica time boundary 2 (transport:
    object store or shared memory, serialization included) without another round trip.
    """

    buckets: tuple[WeightBucket, ...]
    export_s: float
    exported_at: float

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def checksum(data: np.ndarray) -> str:
    """XXH3-128 digest (hex) of a bucket's bytes: it catches bytes changed in transit (not an adversary) at
    ~10 GB/s on one core, where blake2b's ~0.6 GB/s made the two checksums of a push most of its time."""
    return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(data)))


_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
"""Pushed floating dtypes by name: a parameter of another floating dtype takes them converted."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def export_buckets(
    model: torch.nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    name_map: NameMap | None = None,
) -> list[WeightBucket]:
    """Pack ``model``'s parameters (tied ones once) into buckets of about ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own; tensors are
    never split. ``name_map`` renames training names to the engine's names.
    """
    return pack_buckets(((name, p.detach()) for name, p in model.named_parameters()), bucket_bytes, name_map)


def pack_buckets(
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    name_map: NameMap | None = None,
) -> list[WeightBucket]:
    """Pack named tensors into buckets, consuming ``named`` lazily: a bucket is packed as soon as it
    is full and its source tensors are dropped, so a producer that materializes each tensor on
    demand (a sharded trainer all-gathering one parameter at a time) holds at most one bucket's
    worth of full tensors."""
    if bucket_bytes < 1:
        raise WeightTransportError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[WeightBucket] = []
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        need = _aligned(tensor.numel() * tensor.element_size())
        if group and size + need > bucket_bytes:
            buckets.append(_pack(group))
            group, size = [], 0
        group.append(((name_map or str)(name), tensor))
        size += need
    if group:
        buckets.append(_pack(group))
    return buckets


def _pack(named: Sequence[tuple[str, torch.Tensor]]) -> WeightBucket:
    metas, offset = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        metas.append(TensorMeta(name, tuple(tensor.shape), _dtype_name(tensor.dtype), offset, nbytes))
        offset += _aligned(nbytes)
    data = np.zeros(offset, dtype=np.uint8)
    flat = torch.from_numpy(data)
    for meta, (_, tensor) in zip(metas, named):
        # Reinterpreting as bytes works for every dtype, bfloat16 included (numpy has none).
        flat[meta.offset : meta.offset + meta.nbytes] = tensor.cpu().contiguous().reshape(-1).view(torch.uint8)
    return WeightBucket(data, tuple(metas), checksum(data))


def _byte_view(data: np.ndarray) -> torch.Tensor:
    # Buckets arriving through Ray's object store are read-only; we only read them,
    # so torch's warning about non-writable arrays does not apply.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data, dtype=np.uint8).reshape(-1))


def _check(bucket: WeightBucket, params: dict[str, torch.nn.Parameter]) -> None:
    if checksum(bucket.data) != bucket.checksum:
        names = ", ".join(m.name for m in bucket.tensors[:3])
        raise WeightTransportError(
            f"weight bucket checksum mismatch (bucket holding {names}...): the bytes changed in "
            "transit; push the weights again"
        )
    for meta in bucket.tensors:
        _check_tensor(meta.name, meta.shape, meta.dtype, params)
        if meta.offset + meta.nbytes > bucket.nbytes:
            raise WeightTransportError(f"weight {meta.name!r} extends past the end of its bucket; it is truncated")


def _check_tensor(name: str, shape: tuple[int, ...], dtype: str, params: dict[str, torch.nn.Parameter]) -> None:
    param = params.get(name)
    if param is None:
        raise WeightTransportError(
            f"weight {name!r} is not a parameter of the engine's model; the trainer and the "
            "rollout engine must build the same architecture (or pass a name_map on export)"
        )
    same_dtype = _dtype_name(param.dtype) == dtype
    if tuple(param.shape) != tuple(shape) or not (same_dtype or (dtype in _FLOATS and param.is_floating_point())):
        raise WeightTransportError(
            f"weight {name!r}: pushed {dtype}{list(shape)} but the engine holds "
            f"{_dtype_name(param.dtype)}{list(param.shape)}; build both sides from the same model config"
        )


def _check_complete(params: dict[str, torch.nn.Parameter], loaded: list[str], strict: bool) -> None:
    if len(set(loaded)) != len(loaded):
        raise WeightTransportError("a weight push holds some tensor twice; export each parameter once")
    missing = sorted(set(params) - set(loaded))
    if strict and missing:
        raise WeightTransportError(
            f"a full weight push misses {len(missing)} parameter(s), e.g. {missing[:3]}; "
            "export every parameter (or load with strict=False for a partial push)"
        )


@dataclass(frozen=True)
class LocalTensors:
    """A weight push that never leaves its process (the inline backend, or a trainer colocated with the engine):
    the trainer's parameter tensors themselves, not copies. The receiver copies them into its engine in the
    same call (:func:`load_tensors`: one copy, where buckets take two and two checksums); they are valid only
    until the trainer's next update, so a deferred push never takes this form."""

    tensors: tuple[tuple[str, torch.Tensor], ...]
    export_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@torch.no_grad()
def load_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> list[str]:
    """:func:`load_buckets` for a :class:`LocalTensors` push: every name, shape and dtype checked first, then
    each tensor copied into the parameter of its name (a floating dtype converted)."""
    named = list(named)
    params = dict(model.named_parameters())
    for name, tensor in named:
        _check_tensor(name, tuple(tensor.shape), _dtype_name(tensor.dtype), params)
    loaded = [name for name, _ in named]
    _check_complete(params, loaded, strict)
    for name, tensor in named:
        params[name].copy_(tensor)
    return loaded


@torch.no_grad()
def load_buckets(model: torch.nn.Module, buckets: Iterable[WeightBucket], strict: bool = True) -> list[str]:
    """Copy bucketed tensors into ``model``'s parameters in place; returns the names loaded.

    Everything is verified first (checksums, names, shapes, dtypes and, when
    ``strict``, that every parameter is covered), then copied, so an error
    leaves the model as it was. A floating-point tensor pushed to a parameter of
    another floating dtype is converted as it is copied (``model.rollout_dtype``:
    float32 training, bfloat16 rollouts).
    """
    buckets = list(buckets)
    params = dict(model.named_parameters())
    for bucket in buckets:
        _check(bucket, params)
    loaded = [meta.name for bucket in buckets for meta in bucket.tensors]
    _check_complete(params, loaded, strict)
    for bucket in buckets:
        flat = _byte_view(bucket.data)
        for meta in bucket.tensors:
            param = params[meta.name]
            src = flat[meta.offset : meta.offset + meta.nbytes].view(_FLOATS.get(meta.dtype, param.dtype))
            param.copy_(src.view(meta.shape))
    return loaded


# --- delta transport format ------------------------------------------------------------------
# A push that sends only the 4-byte words that changed since the receiver's copy of a bucket.
# Buckets are 64-byte aligned, so every bucket is a whole number of words; a changed float32
# element is one word (a bfloat16 pair shares one). The pushes built on it (the trainer keeps
# its last export, each replica its last buckets) are rlpipe.backends.weight_delta.


@dataclass(frozen=True)
class DeltaBucket:
    """The words of a bucket that differ from a base bucket, and checksums of both ends."""

    base_checksum: str
    """Checksum of the bucket this delta applies to (the receiver's current copy)."""
    indices: np.ndarray  # word positions (uint32, or int64 for buckets of 2**32 words or more)
    values: np.ndarray  # uint32 new words
    tensors: tuple[TensorMeta, ...]
    checksum: str
    """Checksum of the bucket after applying the delta (verified by :func:`apply_delta`)."""

    @property
    def nbytes(self) -> int:
        return int(self.indices.nbytes + self.values.nbytes)


def delta_bucket(base: WeightBucket, new: WeightBucket) -> DeltaBucket:
    """The delta turning ``base`` into ``new`` (same tensors, same layout)."""
    if base.tensors != new.tensors:
        raise WeightTransportError("a delta needs two buckets of the same tensors and layout; send a full bucket")
    old_words, new_words = base.data.view(np.uint32), new.data.view(np.uint32)
    indices = np.flatnonzero(old_words != new_words)
    # 4-byte positions while a bucket has < 2**32 words (every bucket of a sane bucket_bytes)
    index_type = np.uint32 if len(new_words) < 2**32 else np.int64
    return DeltaBucket(base.checksum, indices.astype(index_type), new_words[indices].copy(), new.tensors, new.checksum)


def apply_delta(base: WeightBucket, delta: DeltaBucket) -> WeightBucket:
    """``base`` with ``delta`` applied, as a new bucket; both checksums are verified."""
    if checksum(base.data) != delta.base_checksum or base.tensors != delta.tensors:
        raise WeightTransportError(
            "this delta was made against another copy of the bucket (the receiver missed a push or holds another "
            "version); send a full push"
        )
    data = np.array(base.data, dtype=np.uint8, copy=True)
    data.view(np.uint32)[delta.indices] = delta.values
    if checksum(data) != delta.checksum:
        raise WeightTransportError("the bucket after applying a delta does not match its checksum; send a full push")
    return WeightBucket(data, delta.tensors, delta.checksum)
