"""``rlpipe simulate``: predict other configurations of a workload from one recorded run.

A discrete-event model of the step DAG under a mode (:mod:`~rlpipe.simulate.schedules`: sync,
colocate_async, separate_async), its rollout replicas as continuous-batching decode loops
(:mod:`~rlpipe.simulate.replica`), the trainer and other workers, and the replay buffer with its
staleness rules (:mod:`~rlpipe.simulate.buffer`), run on a simulated clock
(:mod:`~rlpipe.simulate.kernel`). Costs and distributions come from the run's own lineage
(:mod:`~rlpipe.simulate.calibration`); the simulated configuration is the recorded one changed by
``-o`` overrides and validated as ``rlpipe run`` would (:mod:`~rlpipe.simulate.setup`). The result
(:mod:`~rlpipe.simulate.predict`): steps/s, samples/s, busy shares, staleness and version lag,
drop and refill rates, and a verdict. Configurations that cannot make progress whatever the
timing are refused by ``rlpipe validate`` too (:mod:`~rlpipe.modes.feasibility`).

What it leaves out is said where it is left out: contention between workers that share cores or
devices (each worker runs at its recorded speed), memory limits of the engines, prefill cost,
DAPO's group filtering, failures and retries, checkpoints and evaluations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlpipe.simulate.calibration import Calibration, Recording, calibrate
from rlpipe.simulate.predict import Prediction, predict
from rlpipe.simulate.setup import SimSetup, build_setup, simulated_config

__all__ = ["Calibration", "Prediction", "Recording", "Simulated", "calibrate", "predict", "simulate",
           "simulate_recording"]


@dataclass
class Simulated:
    """One simulated configuration: what was simulated, on what, and what it predicts."""

    prediction: Prediction
    calibration: Calibration
    setup: SimSetup
    raw_config: dict[str, Any]
    """The simulated config as a plain dict (what ``--write-config`` saves and ``rlpipe run`` takes)."""
    notes: list[str] = field(default_factory=list)


def simulate(recording: Recording, raw: dict[str, Any], overrides: list[str] | None = None,
             steps: int | None = None, calibration: Calibration | None = None) -> Simulated:
    """Calibrate on ``recording`` (or use ``calibration``), change its raw config by ``overrides``, validate and
    plan it as ``rlpipe run`` would, and simulate ``steps`` steps (default: the config's total_steps)."""
    from rlpipe.errors import ConfigError
    from rlpipe.modes.async_common import AsyncParams, sampler_settings
    from rlpipe.modes.feasibility import progress_blockers, simulating
    from rlpipe.simulate.schedules import SCHEDULES

    cal = calibration or calibrate(recording)
    with simulating():  # a configuration validate refuses is still simulated: its verdict says why it stops
        config, plan, changed, notes = simulated_config(raw, list(overrides or []))
    if config.mode not in SCHEDULES:
        raise ConfigError(f"rlpipe simulate models the modes {', '.join(sorted(SCHEDULES))}; mode {config.mode!r} "
                          "has no simulated schedule (rlpipe/simulate/schedules.py)")
    setup = build_setup(config, plan, cal.workers, cal.overlapped)
    sampler = sampler_settings(config, plan.mode_params)[1] if isinstance(plan.mode_params, AsyncParams) else None
    blockers = progress_blockers(config, plan, sampler)
    prediction = predict(setup, cal, steps or config.trainer.total_steps, blockers)
    prediction.notes[:0] = notes
    return Simulated(prediction, cal, setup, changed, notes)


def simulate_recording(run_ref: str, overrides: list[str] | None = None, steps: int | None = None,
                       tracking_uri: str | None = None, experiment: str | None = None) -> Simulated:
    """:func:`simulate` on a run recorded in MLflow (an id, a prefix, a name or ``latest``)."""
    from rlpipe.simulate.recorded import load_recording

    recording, raw = load_recording(run_ref, tracking_uri, experiment)
    return simulate(recording, raw, overrides, steps)
