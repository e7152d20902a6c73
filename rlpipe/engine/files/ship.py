"""Model folders through Ray's object store, for clusters whose nodes share no filesystem.

With ``resources.shared_filesystem`` false (the default on a Ray of several nodes) the driver packs
every folder the config names once (:func:`ship_model_dirs`): ``model.path``, ``tokenizer.path`` and
any stage param named ``path`` or ``model_path`` that is a folder on the driver (a reward model, a
judge's model and tokenizer, an SGLang server's ``model_path``). Each worker, before it builds its
role, materializes them under its node's cache and reads its config with those paths in their place
(:func:`localize`). The role builders, the trainer's ``save_hf`` (which rebuilds the architecture from
``model.path``) and engines that save the model for a server process all see only the node-local copy.
Paths that name files (a dataset, a reward function's source) are not shipped: the driver reads them.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from rlpipe.engine.files.dir_pack import PackedDir, materialize, pack
from rlpipe.schemas.config import PipelineConfig

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 600.0
"""Longest one chunk of a model file may take to arrive from the object store (and a worker may wait
for another worker on its node that is writing the copy)."""

_PATH_KEYS = ("path", "model_path")
"""Config keys (at any depth) whose value, when it is a folder on the driver, a worker reads a model from."""


def _slots(node: Any) -> Iterator[tuple[dict, str]]:
    """(container, key) of every string under a :data:`_PATH_KEYS` key in a dumped config."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _PATH_KEYS and isinstance(value, str):
                yield node, key
            else:
                yield from _slots(value)
    elif isinstance(node, list):
        for value in node:
            yield from _slots(value)


def shares_filesystem(config: PipelineConfig, inline: bool) -> bool:
    """``resources.shared_filesystem``, with None resolved: true inline and on a one-node Ray."""
    if inline:
        return True  # one process: there is no other node
    if config.resources.shared_filesystem is not None:
        return config.resources.shared_filesystem
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive")) <= 1


def cache_root(node_cache_dir: str | None) -> str:
    """``resources.node_cache_dir``, or ``<system temp dir>/rlpipe-cache`` of this node."""
    return node_cache_dir or os.path.join(tempfile.gettempdir(), "rlpipe-cache")


@dataclass(frozen=True)
class ShippedDirs:
    """The packed model folders, keyed by the path the config gives them."""

    dirs: dict[str, PackedDir]


def ship_model_dirs(config: PipelineConfig, put: Callable[[bytes], Any] | None = None) -> ShippedDirs:
    """Pack every folder the config names (see the module docstring) once into the object store (``put``:
    ``ray.put``); a folder named twice is packed once."""
    if put is None:
        import ray

        put = ray.put
    dirs: dict[str, PackedDir] = {}
    for node, key in _slots(config.model_dump(mode="json")):
        path = node[key]
        if path not in dirs and Path(path).is_dir():
            dirs[path] = pack(path, put)
            log.info("packed %s (%d files, %.1f MiB) into the object store", path, len(dirs[path].files),
                     dirs[path].total_bytes / 2**20)
    return ShippedDirs(dirs)


def localize(config: dict[str, Any], shipped: ShippedDirs,
             get: Callable[[Any], bytes] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """``config`` (a dumped PipelineConfig) with every shipped folder replaced by its verified copy on this
    node (``get``: ``ray.get`` with a timeout), and the replacements made (driver path → local path)."""
    if get is None:
        import ray

        def get(ref):
            return ray.get(ref, timeout=FETCH_TIMEOUT_S)

    root = cache_root(config["resources"]["node_cache_dir"])
    local = {path: str(materialize(packed, get, root, FETCH_TIMEOUT_S)) for path, packed in shipped.dirs.items()}
    out = copy.deepcopy(config)
    for node, key in _slots(out):
        if node[key] in local:
            node[key] = local[node[key]]
    return out, local
