"""Files a checkpoint is made of, written without pickle and read without running code.

A nested state (dicts, lists, tuples, numbers, strings, ``torch.Tensor``, ``pyarrow.Table``)
is split in three: the tensors go to one safetensors file, each Arrow table to its own
Arrow IPC file, and the rest — with a reference in place of each tensor or table — to JSON.
Reading them back parses data only: safetensors holds raw buffers behind a JSON header,
Arrow IPC holds buffers and a schema, JSON holds values; none of them can carry code, so a
crafted file is refused as unparsable instead of executed. Dicts with non-string keys
(``torch.optim`` state is keyed by parameter index) and tuples are tagged so they come back
as they were; floats round-trip exactly (``repr``), so a resumed run stays bit-identical.

Every file is written to ``<name>.tmp`` and renamed (``os.replace``), so a file is either
complete or absent; :func:`blake2b_file` is the checksum the manifest records.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

_TENSOR, _ARROW, _TUPLE, _DICT = "__tensor__", "__arrow__", "__tuple__", "__dict__"


class UnsafeStateError(TypeError):
    """A state holds a value that has no pickle-free encoding here."""


def split_state(state: Any, arrow_prefix: str) -> tuple[Any, dict[str, torch.Tensor], dict[str, pa.Table]]:
    """``state`` as a JSON-able tree plus the tensors and tables it referenced (by key / file name)."""
    tensors: dict[str, torch.Tensor] = {}
    tables: dict[str, pa.Table] = {}
    storages: set[tuple[int, int]] = set()

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
            if key in storages or tensor.untyped_storage().nbytes() != tensor.nbytes:
                tensor = tensor.clone()  # safetensors refuses shared storage (e.g. tied embeddings)
            storages.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
            tensors[path] = tensor
            return {_TENSOR: path}
        if isinstance(value, pa.Table):
            name = f"{arrow_prefix}{len(tables)}.arrow"
            tables[name] = value
            return {_ARROW: name}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and not ({_TENSOR, _ARROW, _TUPLE, _DICT} & value.keys()):
                return {k: encode(v, f"{path}/{k}") for k, v in value.items()}
            return {_DICT: [[encode(k, f"{path}/key{i}"), encode(v, f"{path}/{i}")]
                            for i, (k, v) in enumerate(value.items())]}
        if isinstance(value, tuple):
            return {_TUPLE: [encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy scalars
            return value.item()
        raise UnsafeStateError(f"checkpoint state at {path!r} is a {type(value).__name__}; only JSON values, "
                               "tensors and Arrow tables are stored (no pickle)")

    return encode(state, ""), tensors, tables


def join_state(tree: Any, tensors: dict[str, torch.Tensor], tables: dict[str, pa.Table]) -> Any:
    """Inverse of :func:`split_state`."""
    if isinstance(tree, list):
        return [join_state(v, tensors, tables) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if _TENSOR in tree:
        return tensors[tree[_TENSOR]]
    if _ARROW in tree:
        return tables[tree[_ARROW]]
    if _TUPLE in tree:
        return tuple(join_state(v, tensors, tables) for v in tree[_TUPLE])
    if _DICT in tree:
        return {_hashable(join_state(k, tensors, tables)): join_state(v, tensors, tables) for k, v in tree[_DICT]}
    return {k: join_state(v, tensors, tables) for k, v in tree.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through ``path.tmp`` + fsync + ``os.replace``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def encode_state(state: Any, stem: str) -> dict[str, bytes]:
    """``state`` as the bytes of ``<stem>.safetensors`` (if it holds tensors), ``<stem>.table<i>.arrow`` and
    ``<stem>.json`` (last), by file name: what :func:`save_state` writes, or what travels to another node."""
    from safetensors.torch import save as save_tensors

    tree, tensors, tables = split_state(state, f"{stem}.table")
    files: dict[str, bytes] = {}
    if tensors:
        files[f"{stem}.safetensors"] = save_tensors(tensors)
    for name, table in tables.items():
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        files[name] = sink.getvalue().to_pybytes()
    files[f"{stem}.json"] = json.dumps({"format": 1, "state": tree}, allow_nan=True).encode()
    return files


def decode_state(files: dict[str, bytes], stem: str) -> Any:
    """Inverse of :func:`encode_state`; parses data only (JSON, safetensors, Arrow IPC)."""
    from safetensors.torch import load as load_tensors

    document = json.loads(files[f"{stem}.json"])
    tensor_bytes = files.get(f"{stem}.safetensors")
    tensors = load_tensors(tensor_bytes) if tensor_bytes is not None else {}
    prefix = f"{stem}.table"
    tables = {name: pa.ipc.open_file(pa.BufferReader(data)).read_all()
              for name, data in files.items() if name.startswith(prefix) and name.endswith(".arrow")}
    return join_state(document["state"], tensors, tables)


def state_files(folder: Path, stem: str) -> dict[str, bytes]:
    """The bytes of every file :func:`save_state` wrote for ``stem`` in ``folder`` (no mmap: may be pruned)."""
    names = [f"{stem}.json", f"{stem}.safetensors"] + sorted(p.name for p in folder.glob(f"{stem}.table*.arrow"))
    return {name: (folder / name).read_bytes() for name in names if (folder / name).is_file()}


def save_state(state: Any, folder: Path, stem: str) -> list[Path]:
    """Write ``state`` as ``<stem>.json`` (+ ``<stem>.safetensors``, ``<stem>.table<i>.arrow``); returns the files.
    Each file is atomic; the JSON, which refers to the others, is written last."""
    files = []
    for name, data in encode_state(state, stem).items():
        files.append(folder / name)
        write_atomic(files[-1], data)
    return files


def load_state(folder: Path, stem: str) -> Any:
    """Read what :func:`save_state` wrote; parses data only (JSON, safetensors, Arrow IPC)."""
    return decode_state(state_files(folder, stem), stem)


def blake2b_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex blake2b (32-byte digest) of a file, read in chunks."""
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
