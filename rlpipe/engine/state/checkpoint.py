"""Step checkpoints: what ``rlpipe run --resume`` needs to continue a run exactly.

A checkpoint is taken between two global steps, in ``<output_dir>/checkpoints/step_<N>/``
(N = the next step to run): one ``<role>_rank<r>.pt`` per trainer worker (model,
optimizer, LR schedule, local-update count, policy version, torch RNG) and
``engine.pkl`` for the driver's part (next step, policy version, data position,
per-node carry, the MLflow run id, and the sampler's state with its in-flight
prompts, which it re-issues as pending on resume). Sampling is keyed by (seed,
step, request id), so a resumed run draws the same tokens as an uninterrupted
one (tests/engine/test_checkpoint.py). This is rlpipe's stand-in for the
durable execution Ray Workflows used to offer.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from rlpipe.errors import ConfigError

TRAINER_ROLES = ("actor", "critic")
ENGINE_FILE = "engine.pkl"


def checkpoint_dir(output_dir: str, next_step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{next_step}"


def save(runtime, next_step: int) -> Path:
    """Write the checkpoint of ``runtime`` taken before ``next_step``; returns its folder."""
    path = checkpoint_dir(runtime.output_dir, next_step).absolute()
    path.mkdir(parents=True, exist_ok=True)
    for role in TRAINER_ROLES:
        if runtime.workers.has_role(role):
            runtime.workers.call(role, "save_checkpoint", str(path / role))
    state: dict[str, Any] = {
        "next_step": next_step,
        "policy_version": runtime.executor.policy_version,
        "loader": runtime.loader.state(),
        "carry": runtime.executor.carry,
        "run_id": runtime.run_id,
    }
    if runtime.workers.has_role("sampler"):
        state["sampler"] = runtime.workers.call("sampler", "state")[0]
    tmp = path / (ENGINE_FILE + ".tmp")
    with open(tmp, "wb") as fh:
        pickle.dump(state, fh)
    os.replace(tmp, path / ENGINE_FILE)  # the engine file last: its presence marks a complete checkpoint
    return path


def read_engine_state(path: str | Path) -> dict[str, Any]:
    """The driver part of a checkpoint, or a clear error when ``path`` is not a complete checkpoint."""
    file = Path(path) / ENGINE_FILE
    if not file.is_file():
        raise ConfigError(
            f"{path} is not a complete rlpipe checkpoint (no {ENGINE_FILE}); pass a folder like "
            "<output_dir>/checkpoints/step_<N> written by trainer.checkpoint_every"
        )
    with open(file, "rb") as fh:
        return pickle.load(fh)


def restore(runtime, path: str | Path, state: dict[str, Any]) -> None:
    """Load a checkpoint into a freshly started runtime and push the restored weights to the rollout."""
    path = Path(path).absolute()
    for role in TRAINER_ROLES:
        if runtime.workers.has_role(role):
            runtime.workers.call(role, "load_checkpoint", str(path / role))
    version = state["policy_version"]
    buckets = runtime.workers.call_async("actor", "export_weights", rank=0)[0]
    runtime.workers.call("rollout", "push_weights", buckets, version)
    runtime.loader.load_state(state["loader"])
    runtime.executor.carry = dict(state["carry"])
    runtime.executor.policy_version = version
    if "sampler" in state and runtime.workers.has_role("sampler"):
        runtime.workers.call("sampler", "load_state", state["sampler"])
    runtime.start_step = state["next_step"]
