"""What ``--resume`` may do with a checkpoint: continue, fork, or extend a finished run.

A checkpoint names its run (``engine.pkl``'s ``run_id``). Resuming an unfinished
run (FAILED, KILLED, still marked RUNNING after a crash) continues it in the same
MLflow run and output folder. A **finished** run — MLflow status FINISHED, or a
``final`` model folder in its output folder — is not touched unless asked:

* ``fork`` — a new MLflow run and output folder start from the checkpoint; the new
  run is tagged ``rlpipe.forked_from = <old run id>`` (and the checkpoint path);
  the old run and its model stay as they are.
* ``extend`` — the same run gets more steps: ``trainer.total_steps`` must exceed
  the steps it finished; its old ``final`` model is kept as ``final_step_<N>``
  before training goes on, so nothing is overwritten.

Without either, resuming a finished run is refused with what to pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.engine.state import checkpoint
from rlpipe.errors import ConfigError
from rlpipe.schemas.config import PipelineConfig

log = logging.getLogger(__name__)

FORKED_FROM_TAG = "rlpipe.forked_from"
EXTENDED_TAG = "rlpipe.extended_to"
"""Tag of a run given more steps by ``--extend``: its new trainer.total_steps."""


@dataclass
class ResumePlan:
    """How a run goes on from a checkpoint."""

    state: dict[str, Any]
    """The checkpoint's driver state (checkpoint.read_engine_state)."""
    run_id: str | None
    """The MLflow run to continue; None starts a new one (a fork)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags to set on the run (fork and extend links)."""


def _finished_steps(config: PipelineConfig, run_id: str, output_dir: Path) -> int | None:
    """Steps the run finished if it is FINISHED (MLflow status or a final model), else None."""
    if config.tracking.enabled:
        from rlpipe.engine.tracking import runs

        try:
            run = runs.client(config.tracking.uri).get_run(run_id)
        except Exception:  # noqa: BLE001 - not in this store: fall back to the output folder
            run = None
        if run is not None:
            if run.info.status != "FINISHED":
                return None
            return int(run.data.metrics.get("step", -1)) + 1
    if (output_dir / "final").is_dir():  # untracked: the final model marks a finished run
        names = [p.name.removeprefix("step_") for p in (output_dir / "checkpoints").glob("step_*")]
        return max((int(n) for n in names if n.isdigit()), default=0)
    return None


def _step_number(folder: Path) -> int | None:
    name = folder.name.removeprefix("step_")
    return int(name) if folder.name.startswith("step_") and name.isdigit() else None


def _complete_steps(checkpoints: Path) -> list[Path]:
    """The complete checkpoints (a manifest, written last) in a ``checkpoints/`` folder, oldest step first."""
    steps = [p for p in checkpoints.glob("step_*") if _step_number(p) is not None and (p / checkpoint.MANIFEST).is_file()]
    return sorted(steps, key=_step_number)


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``--resume PATH`` means: a checkpoint folder itself; or, for a run's output folder or its
    ``checkpoints/`` folder, the newest complete checkpoint in it. An incomplete checkpoint (its write was
    interrupted: no manifest) is refused naming the last complete one before it."""
    path = Path(path)
    if (path / checkpoint.MANIFEST).is_file():
        return path
    for folder in (path / "checkpoints", path):
        complete = _complete_steps(folder) if folder.is_dir() and _step_number(folder) is None else []
        if complete:
            log.info("--resume %s: the newest complete checkpoint there is %s", path, complete[-1])
            return complete[-1]
    if _step_number(path) is not None and path.is_dir():
        earlier = [p for p in _complete_steps(path.parent) if _step_number(p) < _step_number(path)]
        hint = (f"the last complete one is {earlier[-1]}: --resume {earlier[-1]}" if earlier else
                f"no complete checkpoint precedes it in {path.parent}")
        raise ConfigError(f"--resume {path}: an incomplete checkpoint (no {checkpoint.MANIFEST}, written last: its "
                          f"write was interrupted); {hint}")
    if path.is_dir() and ((path / "checkpoints").is_dir() or path.name == "checkpoints"):
        raise ConfigError(f"--resume {path}: no complete checkpoint in {path if path.name == 'checkpoints' else path / 'checkpoints'}"
                          "; start the run anew")
    return path  # read_engine_state says what is wrong with it


def latest_checkpoint(config: PipelineConfig) -> Path:
    """The newest complete checkpoint (by the time its manifest was written) of any run of this pipeline:
    ``<trainer.output_dir>/<name>-*/checkpoints/step_*``; a clear error when there is none."""
    root = Path(config.trainer.output_dir)
    manifests = [m for m in root.glob(f"{config.name}-*/checkpoints/step_*/{checkpoint.MANIFEST}") if m.is_file()]
    if not manifests:
        every = config.trainer.checkpoint_every
        raise ConfigError(
            f"--resume latest: no complete checkpoint of pipeline {config.name!r} under "
            f"{root}/{config.name}-*/checkpoints/ (checkpoints are written "
            + (f"every trainer.checkpoint_every={every} steps" if every else "only with trainer.checkpoint_every > 0")
            + "); pass --resume CHECKPOINT_DIR, or start the run anew")
    return max(manifests, key=lambda m: m.stat().st_mtime_ns).parent


def plan_resume(config: PipelineConfig, path: str, fork: bool = False, extend: bool = False) -> ResumePlan:
    """Check that resuming from ``path`` is allowed as asked; returns how the run goes on."""
    if fork and extend:
        raise ConfigError("--fork and --extend exclude each other: fork starts a new run, extend continues the old one")
    state = checkpoint.read_engine_state(path, config)
    run_id = state["run_id"]
    output_dir = Path(config.trainer.output_dir) / f"{config.name}-{run_id[:8]}"
    done = _finished_steps(config, run_id, output_dir)
    if fork:
        return ResumePlan(state, None, {FORKED_FROM_TAG: run_id, "rlpipe.forked_from_checkpoint": str(path)})
    if done is None:
        return ResumePlan(state, run_id)
    if not extend:
        raise ConfigError(
            f"run {run_id} is FINISHED ({done} steps; model in {output_dir / 'final'}); resuming it would train it "
            "again and overwrite that model. Pass --fork to go on in a new run linked to it, or --extend with a larger "
            f"trainer.total_steps (e.g. -o trainer.total_steps={done + max(done, 1)}) to add steps to the same run"
        )
    if config.trainer.total_steps <= done:
        raise ConfigError(
            f"--extend: run {run_id} already finished {done} steps and trainer.total_steps is "
            f"{config.trainer.total_steps}; raise it (e.g. -o trainer.total_steps={done + max(done, 1)})"
        )
    final = output_dir / "final"
    if final.is_dir():
        kept = output_dir / f"final_step_{done}"
        final.rename(kept)
        log.warning("--extend: the finished run's model %s is kept as %s", final, kept)
    return ResumePlan(state, run_id, {EXTENDED_TAG: str(config.trainer.total_steps)})
