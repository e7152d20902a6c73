"""How rlpipe's weight buckets travel over SGLang's weight-update endpoints.

Two paths, both through fields SGLang 0.5.23 defines:

- ``/update_weights_from_tensor`` with ``load_format="rlpipe_buckets"``.
  SGLang's own payload is ``serialized_named_tensors``: one base64 string per
  tensor-parallel rank, each a ``MultiprocessingSerializer`` (ForkingPickler)
  pickle of ``[(name, tensor), ...]`` whose storages are CUDA IPC handles. Here
  the list has one entry (one rank) and the entry is base64 of a JSON
  *manifest* instead of a pickle: per bucket its per-tensor metadata
  (:class:`rlpipe.backends.weights.TensorMeta`), its blake2b checksum and either
  ``path`` (a file under ``/dev/shm`` the client wrote and the server maps
  read-only: shared memory, no copy through HTTP) or ``data`` (the bytes,
  base64, for a server on another host). Nothing is unpickled. A real SGLang
  server does not read this format (it would try to unpickle the manifest);
  use the disk path with it.
- ``/update_weights_from_disk``: the buckets written as a Hugging Face
  checkpoint directory (``model.safetensors`` plus the model's config and
  tokenizer files), whose ``model_path`` any SGLang server on the same host or
  a shared filesystem can load.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch

from rlpipe.backends.weights import TensorMeta, WeightBucket
from rlpipe.inference.contract import EngineError

LOAD_FORMAT = "rlpipe_buckets"
SHM_PREFIX = "rlpipe-weights-"
RESUME_KEY = "rlpipe_resume_len"
"""``sampling_params.custom_params`` key: the last k input ids are a partial response being resumed
(rlpipe's embedded server continues its counter-based random stream there; real SGLang ignores it)."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def shm_dir() -> str:
    """Where shared-memory bucket files go: ``/dev/shm`` when it exists, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def encode_buckets(buckets: Sequence[WeightBucket], transport: Literal["shm", "inline"]) -> tuple[list[str], list[str]]:
    """``serialized_named_tensors`` for ``buckets`` and the files the caller deletes once the server loaded them."""
    entries, files = [], []
    try:
        for bucket in buckets:
            entry = {"checksum": bucket.checksum, "nbytes": bucket.nbytes,
                     "tensors": [asdict(meta) for meta in bucket.tensors]}
            if transport == "shm":
                fd, path = tempfile.mkstemp(prefix=SHM_PREFIX, dir=shm_dir())
                files.append(path)
                with os.fdopen(fd, "wb") as f:
                    f.write(memoryview(np.ascontiguousarray(bucket.data)))
                entry["path"] = path
            else:
                entry["data"] = base64.b64encode(memoryview(np.ascontiguousarray(bucket.data))).decode()
            entries.append(entry)
    except BaseException:
        remove_files(files)
        raise
    manifest = json.dumps({"format": LOAD_FORMAT, "buckets": entries}).encode()
    return [base64.b64encode(manifest).decode()], files


def decode_buckets(serialized: Sequence[str]) -> list[WeightBucket]:
    """The buckets a manifest from :func:`encode_buckets` describes (shm files mapped read-only)."""
    if len(serialized) != 1:
        raise EngineError(f"serialized_named_tensors holds {len(serialized)} entries; this server has one "
                          "tensor-parallel rank and reads exactly one")
    try:
        manifest = json.loads(base64.b64decode(serialized[0], validate=True))
    except (ValueError, TypeError) as exc:
        raise EngineError(f"serialized_named_tensors[0] is not base64 of an {LOAD_FORMAT} JSON manifest ({exc}); "
                          "pickled SGLang tensors are not read by this server") from exc
    buckets = []
    for entry in manifest.get("buckets", []):
        if "path" in entry:
            path = Path(entry["path"])
            if not path.name.startswith(SHM_PREFIX) or not path.is_file():
                raise EngineError(f"bucket file {path} is not an existing {SHM_PREFIX}* file; is the client on "
                                  "another host? use weight_transport 'inline' or 'disk' there")
            data = np.memmap(path, dtype=np.uint8, mode="r") if entry["nbytes"] else np.zeros(0, np.uint8)
        else:
            data = np.frombuffer(base64.b64decode(entry["data"]), dtype=np.uint8)
        metas = tuple(TensorMeta(m["name"], tuple(m["shape"]), m["dtype"], m["offset"], m["nbytes"])
                      for m in entry["tensors"])
        buckets.append(WeightBucket(data, metas, entry["checksum"]))
    return buckets


def remove_files(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def write_checkpoint(buckets: Sequence[WeightBucket], base_dir: str, out_dir: str | Path) -> Path:
    """A Hugging Face directory: ``base_dir``'s config/tokenizer files plus the buckets as ``model.safetensors``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for item in Path(base_dir).iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and not item.name.endswith(".index.json"):
            shutil.copy2(item, out / item.name)
    tensors: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        flat = torch.from_numpy(np.array(bucket.data, dtype=np.uint8, copy=True))
        for m in bucket.tensors:
            dtype = getattr(torch, m.dtype)
            tensors[m.name] = flat[m.offset: m.offset + m.nbytes].view(dtype).view(m.shape).clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
