"""Model folders through Ray's object store, for clusters whose nodes share no filesystem.

With ``resources.shared_filesystem`` false (the default on a Ray of several nodes) the driver packs
``model.path`` and ``tokenizer.path`` once (:func:`ship_model_dirs`); each worker, before it builds
its role, materializes them under its node's cache and reads its config with those paths in their
place (:func:`localize`). The role builders, the trainer's ``save_hf`` (which rebuilds the
architecture from ``model.path``) and engines that save the model for a server process all see only
the node-local copy.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from rlpipe.engine.files.dir_pack import PackedDir, materialize, pack
from rlpipe.schemas.config import PipelineConfig

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 600.0
"""Longest one chunk of a model file may take to arrive from the object store (and a worker may wait
for another worker on its node that is writing the copy)."""

_PATH_FIELDS = (("model", "path"), ("tokenizer", "path"))
"""Config fields that name a folder every model-building worker reads."""


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


def ship_model_dirs(config: PipelineConfig) -> ShippedDirs:
    """Pack every folder of :data:`_PATH_FIELDS` once into the object store (a folder named twice, once)."""
    import ray

    raw = config.model_dump(mode="json")
    dirs: dict[str, PackedDir] = {}
    for section, name in _PATH_FIELDS:
        path = raw[section][name]
        if path is not None and path not in dirs:
            dirs[path] = pack(path, ray.put)
            log.info("packed %s (%d files, %.1f MiB) into the object store", path, len(dirs[path].files),
                     dirs[path].total_bytes / 2**20)
    return ShippedDirs(dirs)


def localize(config: dict[str, Any], shipped: ShippedDirs) -> tuple[dict[str, Any], dict[str, str]]:
    """``config`` (a dumped PipelineConfig) with every shipped folder replaced by its verified copy on this
    node, and the replacements made (driver path → local path)."""
    import ray

    root = cache_root(config["resources"]["node_cache_dir"])
    local = {path: str(materialize(packed, lambda ref: ray.get(ref, timeout=FETCH_TIMEOUT_S), root,
                                   FETCH_TIMEOUT_S))
             for path, packed in shipped.dirs.items()}
    out = {**config}
    for section, name in _PATH_FIELDS:
        if out[section][name] in local:
            out[section] = {**out[section], name: local[out[section][name]]}
    return out, local
