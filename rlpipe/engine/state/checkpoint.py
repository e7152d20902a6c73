"""Step checkpoints: what ``rlpipe run --resume`` needs to continue a run exactly, stored safely.

A checkpoint is taken between two global steps, in ``<output_dir>/checkpoints/step_<N>/``
(N = the next step to run):

* ``<role>_rank<r>.safetensors`` + ``<role>_rank<r>.json`` per trainer worker: model,
  optimizer and LR-schedule state, local-update count, policy version, torch RNG;
* ``engine.json`` (+ ``engine.table<i>.arrow`` for the replay buffer's tables): the driver's
  part — next step, policy version, data position, per-node carry, the MLflow run id, and the
  sampler's state with its in-flight prompts, which it re-issues as pending on resume;
* ``manifest.json``, written **last** and atomically: the pipeline name, its identity hash
  (name, model, tokenizer, mode, data source — what makes it *this* pipeline) and config
  hash (everything it computes), the next step and, per file, its size and blake2b
  checksum. Its presence marks a complete checkpoint.

With ``resources.shared_filesystem`` false the trainer ranks write nothing: they return their files'
bytes through the object store, the driver writes them (:func:`write_files`), and a resume sends each
rank its files back after checking them against the manifest again.

No pickle anywhere (see :mod:`rlpipe.engine.state.safe_io`): a crafted file is refused, never
executed. :func:`read_engine_state` verifies the manifest *before anything starts* — every
file's size and checksum (a truncated or altered file is named), and the identity hash (a
checkpoint of another pipeline is refused naming both); a changed config of the same pipeline
(the runbook's "fix the stage, then --resume") resumes with a warning naming what changed. A
refused resume touches neither Ray nor the original MLflow run. After a save, only the newest ``trainer.keep_checkpoints``
folders are kept; a save first checks the free disk space. Sampling is keyed by
(seed, step, request id), so a resumed run draws the same tokens as an uninterrupted one
(tests/engine/test_checkpoint.py). This is rlpipe's stand-in for the durable execution Ray
Workflows used to offer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlpipe.engine.state.safe_io import blake2b_file, load_state, save_state, state_files, write_atomic
from rlpipe.errors import ConfigError, RlpipeError

log = logging.getLogger(__name__)

TRAINER_ROLES = ("actor", "critic")
ENGINE_STEM = "engine"
MANIFEST = "manifest.json"
FORMAT = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")

# Fields that may differ between the run that wrote a checkpoint and the run that resumes it:
# where things go and how they are observed, not what is computed.
_NOT_COMPUTED = {"trainer": ("output_dir", "checkpoint_every", "save_every", "keep_checkpoints", "torch_threads"),
                 "resources": ("ray_address", "num_cpus", "shared_filesystem", "node_cache_dir", "worker_call_timeout_s"),
                 "tracking": None}
# What makes a pipeline the same pipeline: its checkpoint belongs to no other.
_IDENTITY = ("name", "model", "tokenizer", "mode")


class CheckpointError(ConfigError):
    """A checkpoint cannot be resumed from: incomplete, damaged, or of another pipeline."""


def checkpoint_dir(output_dir: str, next_step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{next_step}"


def _computed(config) -> dict[str, Any]:
    raw = config.model_dump(mode="json")
    for section, fields in _NOT_COMPUTED.items():
        if fields is None:
            raw.pop(section, None)
        else:
            for name in fields:
                raw.get(section, {}).pop(name, None)
    return raw


def _hash(value: Any) -> str:
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=16).hexdigest()


def config_hash(config) -> str:
    """Hash of what a pipeline computes (its config less output paths, tracking and Ray placement)."""
    return _hash(_computed(config))


def identity_hash(config) -> str:
    """Hash of what makes a pipeline itself: name, model, tokenizer, mode and data source."""
    raw = config.model_dump(mode="json")
    return _hash({**{k: raw[k] for k in _IDENTITY}, "data": [raw["data"]["source"], raw["data"]["params"]]})


def _sections(config) -> dict[str, str]:
    """Per top-level section, its hash (a warning names the sections that changed)."""
    return {key: _hash(value) for key, value in _computed(config).items()}


def _check_visible(role: str, files: list[str]) -> None:
    """The trainer ranks' files must be visible to the driver, which checksums them into the manifest."""
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise CheckpointError(
            f"the {role} workers wrote {missing[0]} (and {len(missing) - 1} more) on a node whose files this "
            "driver does not see, so the checkpoint would be incomplete: on a cluster whose nodes do not share "
            "trainer.output_dir set resources.shared_filesystem: false (the files then come to the driver through "
            "the object store), or put trainer.output_dir on storage every node mounts; see "
            "docs/trainers-and-multinode.md, 'Multi-node'"
        )


def save(runtime, next_step: int) -> Path:
    """Write the checkpoint of ``runtime`` taken before ``next_step``; returns its folder."""
    path = checkpoint_dir(runtime.output_dir, next_step).absolute()
    path.mkdir(parents=True, exist_ok=True)
    (path / MANIFEST).unlink(missing_ok=True)  # rewriting a folder: incomplete until the new manifest lands
    _check_free_disk(runtime, path)
    for role in TRAINER_ROLES:
        if not runtime.workers.has_role(role):
            continue
        if runtime.backend.shared_filesystem:
            written = runtime.workers.call(role, "save_checkpoint", str(path / role))
            _check_visible(role, [f for rank_files in written for f in (rank_files or [])])
        else:  # the ranks' files come through the object store; the driver alone writes output_dir
            for future in runtime.workers.call_async(role, "checkpoint_files", role):
                write_files(path, runtime.workers.resolve([future])[0], f"a {role} rank")  # one rank's files at a time
    state: dict[str, Any] = {
        "next_step": next_step,
        "policy_version": runtime.executor.policy_version,
        "loader": runtime.loader.state(),
        "carry": runtime.executor.carry,
        "run_id": runtime.run_id,
    }
    if runtime.workers.has_role("sampler"):
        state["sampler"] = runtime.workers.call("sampler", "state")[0]
    save_state(state, path, ENGINE_STEM)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))
    manifest = {
        "format": FORMAT,
        "pipeline": runtime.config.name,
        "identity_hash": identity_hash(runtime.config),
        "config_hash": config_hash(runtime.config),
        "sections": _sections(runtime.config),
        "next_step": next_step,
        "files": {p.name: {"bytes": p.stat().st_size, "blake2b": blake2b_file(p)} for p in files},
    }
    write_atomic(path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    prune(path.parent, runtime.config.trainer.keep_checkpoints)
    return path


def write_files(folder: Path, files: dict[str, bytes], sender: str) -> list[Path]:
    """Write files a worker sent (name → bytes) into ``folder``, each atomically; a name that is not a plain
    file name is refused (a worker never chooses where in the driver's filesystem its bytes land)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in files.items():
        if not name or "/" in name or "\\" in name or name in (".", "..") or name.endswith(".tmp"):
            raise RlpipeError(f"{sender} sent a file named {name!r} to write into {folder}; refused (only plain "
                              "file names are written)")
        written.append(folder / name)
        write_atomic(written[-1], data)
    return written


def _check_free_disk(runtime, path: Path) -> None:
    """Refuse to start a save that cannot fit: the newest earlier checkpoint's size (or the trainers'
    estimate, for the first one) with a 10% margin."""
    previous = [p for p in _step_dirs(path.parent) if p != path]
    if previous:
        needed = sum(f.stat().st_size for f in previous[-1].iterdir() if f.is_file())
    else:
        needed = sum(sum(runtime.workers.call(role, "checkpoint_bytes"))
                     for role in TRAINER_ROLES if runtime.workers.has_role(role))
    check_free_disk(path, needed, "the checkpoint", "lower trainer.keep_checkpoints, or set trainer.checkpoint_every: 0")


def model_bytes(runtime) -> int:
    """Size of the policy's weights as saved: a third of the trainers' checkpoint estimate (weights + AdamW's two
    moments), summed over the ranks when they hold shards, one rank's when each holds the whole model. With
    trainer.lora the checkpoint holds the adapters only, so the trainers say what they save (a merged model is
    whole)."""
    if runtime.config.trainer.lora is not None:
        per_rank = [3 * n for n in runtime.workers.call("actor", "saved_model_bytes")]
    else:
        per_rank = runtime.workers.call("actor", "checkpoint_bytes")
    return (max(per_rank) if runtime.config.trainer.backend == "replicated" else sum(per_rank)) // 3


def check_free_disk(path: Path, needed: int, what: str, fix: str) -> None:
    """Refuse to write ``what`` (about ``needed`` bytes, plus 10% and 1 MiB) where the disk has less free."""
    needed = int(needed * 1.1) + (1 << 20)
    existing = next(p for p in (path, *path.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise RlpipeError(
            f"not enough free disk for {what} at {path}: about {needed / 2**20:.0f} MiB needed, "
            f"{free / 2**20:.0f} MiB free; free space, point trainer.output_dir at a larger disk, or {fix}"
        )


def _step_dirs(folder: Path) -> list[Path]:
    """``step_<N>`` folders under ``folder``, oldest (smallest N) first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoint folders (0 keeps all); returns the deleted ones."""
    if not keep:
        return []
    doomed = _step_dirs(folder)[:-keep]
    for old in doomed:
        shutil.rmtree(old, ignore_errors=True)
        log.info("removed old checkpoint %s (trainer.keep_checkpoints=%d)", old, keep)
    return doomed


def read_engine_state(path: str | Path, config=None) -> dict[str, Any]:
    """The driver part of a verified checkpoint; a clear error when ``path`` is not a complete,
    intact checkpoint of this pipeline (``config``). Nothing is started before this passes."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is missing; resume from another checkpoint")
        size = file.stat().st_size
        if size != entry["bytes"] or blake2b_file(file) != entry["blake2b"]:
            what = f"{size} bytes instead of {entry['bytes']} (truncated?)" if size != entry["bytes"] else "altered"
            raise CheckpointError(
                f"checkpoint {path} is damaged: {file} is {what}; its checksum does not match manifest.json. "
                "Resume from another checkpoint (an earlier step_<N> folder)"
            )
    _check_parses(path, manifest)
    if config is not None:
        _check_pipeline(path, manifest, config)
    try:
        state = load_state(path, ENGINE_STEM)
    except Exception as exc:  # verified files that still do not parse: written by something else
        raise CheckpointError(f"checkpoint {path}: {ENGINE_STEM}.json does not parse ({exc}); "
                              "resume from another checkpoint") from None
    if not isinstance(state, dict) or state.get("next_step") != manifest["next_step"]:
        raise CheckpointError(f"checkpoint {path}: {ENGINE_STEM}.json does not match manifest.json; "
                              "resume from another checkpoint")
    return state


def _check_pipeline(path: Path, manifest: dict[str, Any], config) -> None:
    if manifest["identity_hash"] != identity_hash(config):
        raise CheckpointError(
            f"checkpoint {path} was written by pipeline {manifest['pipeline']!r} (identity hash "
            f"{manifest['identity_hash']}), not by this one, {config.name!r} (identity hash {identity_hash(config)}; "
            "name, model, tokenizer, mode and data source must match): resume with the pipeline YAML that wrote it, "
            "or start a new run without --resume"
        )
    if manifest["config_hash"] != config_hash(config):
        ours = _sections(config)
        changed = sorted(k for k in set(ours) | set(manifest["sections"]) if ours.get(k) != manifest["sections"].get(k))
        log.warning("resuming %s with a changed config of pipeline %r (changed: %s; config hash %s, was %s)",
                    path, config.name, ", ".join(changed), config_hash(config), manifest["config_hash"])


def _check_parses(path: Path, manifest: dict[str, Any]) -> None:
    """Every listed file parses as what its name says (headers only), before any worker loads one."""
    from safetensors import safe_open

    for name in manifest["files"]:
        file = path / name
        try:
            if name.endswith(".json"):
                json.loads(file.read_text())
            elif name.endswith(".safetensors"):
                with safe_open(str(file), framework="pt") as handle:
                    list(handle.keys())
            elif name.endswith(".arrow"):
                pa.ipc.open_file(pa.BufferReader(file.read_bytes())).schema
            else:
                raise ValueError("not a file rlpipe writes into a checkpoint")
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {path}: {file} is not a valid {file.suffix.lstrip('.') or 'checkpoint'} file "
                f"({type(exc).__name__}); it was refused unread. Resume from a checkpoint rlpipe wrote"
            ) from None


def _verified(path: Path, manifest: dict[str, Any], files: dict[str, bytes]) -> dict[str, bytes]:
    """``files`` (read from checkpoint ``path`` to send to a worker), each checked against the manifest again:
    the folder may have changed since :func:`read_engine_state` verified it."""
    if not files:
        raise CheckpointError(f"checkpoint {path} holds no trainer files for a worker of this run; resume with the "
                              "trainer.dp_size that wrote it")
    for name, data in files.items():
        entry = manifest["files"].get(name)
        digest = hashlib.blake2b(data, digest_size=32).hexdigest()
        if entry is None or entry["bytes"] != len(data) or entry["blake2b"] != digest:
            raise CheckpointError(f"checkpoint {path} is damaged: {path / name} does not match manifest.json (changed "
                                  "after the resume started?); resume from another checkpoint")
    return files


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"{path} is not a complete rlpipe checkpoint (no {MANIFEST}); pass a folder like "
            "<output_dir>/checkpoints/step_<N> written by trainer.checkpoint_every"
        )
    try:
        manifest = json.loads(file.read_text())
        files = manifest["files"]
        ok = manifest.get("format") == FORMAT and isinstance(files, dict) and all(
            isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("blake2b"), str)
            for e in files.values()) and all("/" not in n and "\\" not in n and n not in ("", ".", "..") for n in files)
        ok = ok and all(isinstance(manifest.get(k), str) for k in ("config_hash", "identity_hash", "pipeline"))
        ok = ok and isinstance(manifest.get("sections"), dict) and isinstance(manifest.get("next_step"), int)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise CheckpointError(f"checkpoint {path} is damaged: {file} is not a valid rlpipe manifest (format {FORMAT}); "
                              "resume from another checkpoint")
    return manifest


def restore(runtime, path: str | Path, state: dict[str, Any]) -> None:
    """Load a checkpoint into a freshly started runtime and push the restored weights to the rollout."""
    path = Path(path).absolute()
    for role in TRAINER_ROLES:
        if not runtime.workers.has_role(role):
            continue
        if runtime.backend.shared_filesystem:
            runtime.workers.call(role, "load_checkpoint", str(path / role))
            continue
        manifest = _read_manifest(path)
        futures = []
        for rank in range(runtime.backend.group_size(role)):  # each rank gets its own files, verified again here
            files = _verified(path, manifest, state_files(path, f"{role}_rank{rank}"))
            futures += runtime.workers.call_async(role, "load_checkpoint_files", role, files, rank=rank)
        runtime.workers.resolve(futures)
    version = state["policy_version"]
    buckets = runtime.workers.call_async("actor", "export_weights")[0]
    runtime.workers.call("rollout", "push_weights", buckets, version)
    runtime.loader.load_state(state["loader"])
    runtime.executor.carry = dict(state["carry"])
    runtime.executor.policy_version = version
    if "sampler" in state and runtime.workers.has_role("sampler"):
        runtime.workers.call("sampler", "load_state", state["sampler"])
    runtime.start_step = state["next_step"]
