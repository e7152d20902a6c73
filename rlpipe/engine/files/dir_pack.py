"""A directory (a Hugging Face model folder) packed once and materialized on other machines.

``pack`` reads every file of a folder once, in chunks, records each file's size and sha256 and
hands each chunk to ``put`` (``ray.put`` on the driver: the chunks go to the object store, one
copy however many workers read them). ``materialize`` rebuilds the folder under a node-local
cache from those chunks (``get``: ``ray.get`` on a worker):

* the copy is written to a private ``<name>.tmp-<pid>-<random>`` folder, every file's size and
  sha256 are checked against the packed ones (a mismatch is refused naming the file), and only
  then is the folder renamed to its final name — atomically, so a folder under its final name is
  always complete and verified;
* workers on one node share one copy: an exclusive ``flock`` on ``<name>.lock`` (waited for at
  most ``timeout_s``) lets one worker fetch and write while the others wait and then reuse it;
* the final name carries a digest of every (file, size, sha256), so another model, or a changed
  file in the source folder, gets a folder of its own and never reuses a stale copy.

Nothing here imports Ray (tests run it with plain functions as ``put`` / ``get``). Left out:
deleting old cache folders (a cache keeps every model it was sent until someone removes it), and
re-hashing a reused copy (a reused folder is checked by file sizes only: its checksums were
verified before its rename).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from rlpipe.errors import RlpipeError

CHUNK_BYTES = 64 << 20
"""Bytes per object-store chunk: a worker holds at most one chunk of a file in memory while writing it."""


class DirPackError(RlpipeError):
    """A model folder could not be packed, or its copy on this node does not match what was packed."""


@dataclass(frozen=True)
class PackedFile:
    """One file of a packed folder: where it sits in the folder, what it must be, and its chunks."""

    name: str
    """Path relative to the folder (``/``-separated)."""
    size: int
    sha256: str
    chunks: tuple[Any, ...]
    """What ``put`` returned for each chunk, in order (ObjectRefs on Ray)."""


@dataclass(frozen=True)
class PackedDir:
    """A folder as packed on the driver: its files and a digest naming exactly this content."""

    source: str
    """The folder's path on the driver (for messages, and to match config paths)."""
    files: tuple[PackedFile, ...]
    digest: str = field(default="")

    @property
    def cache_name(self) -> str:
        """``<folder name>-<digest>``: the copy's folder name under a node cache."""
        return f"{Path(self.source).name or 'model'}-{self.digest}"

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _digest(files: list[PackedFile]) -> str:
    listing = [[f.name, f.size, f.sha256] for f in sorted(files, key=lambda f: f.name)]
    return hashlib.blake2b(json.dumps(listing).encode(), digest_size=8).hexdigest()


def pack(folder: str | Path, put: Callable[[bytes], Any], chunk_bytes: int = CHUNK_BYTES) -> PackedDir:
    """Read every regular file under ``folder`` once: sizes, sha256s and chunks handed to ``put``."""
    root = Path(folder)
    if not root.is_dir():
        raise DirPackError(f"cannot pack {str(root)!r} for the workers: it is not a directory on the driver; "
                           "point model.path / tokenizer.path at a local Hugging Face folder")
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest, chunks, size = hashlib.sha256(), [], 0
        with open(path, "rb") as fh:
            while block := fh.read(chunk_bytes):
                digest.update(block)
                chunks.append(put(block))
                size += len(block)
        files.append(PackedFile(path.relative_to(root).as_posix(), size, digest.hexdigest(), tuple(chunks)))
    if not files:
        raise DirPackError(f"cannot pack {str(root)!r} for the workers: it holds no files")
    return PackedDir(str(root), tuple(files), _digest(files))


def materialize(packed: PackedDir, get: Callable[[Any], bytes], cache_root: str | Path,
                timeout_s: float = 600.0) -> Path:
    """The verified copy of ``packed`` under ``cache_root`` (written now, or reused); its path."""
    root = Path(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / packed.cache_name
    if _complete(final, packed):
        return final
    with _locked(root / f"{packed.cache_name}.lock", timeout_s):
        if _complete(final, packed):  # another worker on this node wrote it while we waited
            return final
        if final.exists():  # a folder of that name that is not a complete copy: not ours to trust
            shutil.rmtree(final)
        tmp = root / f"{packed.cache_name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            for entry in packed.files:
                _write_file(tmp, entry, get, packed.source)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_file(tmp: Path, entry: PackedFile, get: Callable[[Any], bytes], source: str) -> None:
    target = tmp / entry.name
    if not target.resolve().is_relative_to(tmp.resolve()):
        raise DirPackError(f"packed file name {entry.name!r} of {source} leaves its folder; refused")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with open(target, "wb") as fh:
        for chunk in entry.chunks:
            block = get(chunk)
            digest.update(block)
            size += len(block)
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    if size != entry.size or digest.hexdigest() != entry.sha256:
        what = f"{size} bytes instead of {entry.size}" if size != entry.size else "a different sha256"
        raise DirPackError(
            f"the copy of {source}/{entry.name} received on this node has {what} than the driver packed; "
            "it was not used. Check that the file did not change while the run started, and the object "
            "store's health (ray status); then start the run again"
        )


def _complete(final: Path, packed: PackedDir) -> bool:
    """A folder under the final name holds every packed file at its size (checksummed before its rename)."""
    if not final.is_dir():
        return False
    try:
        return all((final / f.name).stat().st_size == f.size for f in packed.files)
    except OSError:
        return False


@contextmanager
def _locked(lock_file: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_file``, waited for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with open(lock_file, "a+b") as fh:
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise DirPackError(
                        f"waited {timeout_s:.0f} s for {lock_file} (another worker on this node copying the model "
                        "there); if no rlpipe worker is alive on this node, delete that file and start again"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
