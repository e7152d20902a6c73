"""Predictions of ``rlpipe simulate``: run a simulated configuration and say what it does, and whether it works.

:func:`predict` runs the mode's schedule (:mod:`rlpipe.simulate.schedules`) for ``steps`` steps
and summarises it as a :class:`Prediction`: throughput over the steps after the first (the
recorded run's warm-up step is measured the same way), per-worker busy shares, the staleness
and version-lag distributions of what the trainer consumed, how many groups the buffer dropped
and how many prompts were submitted per step, and a verdict:

* ``no_progress`` — the run cannot go on: a config-alone blocker
  (:mod:`rlpipe.modes.feasibility`), a batch that can never come (nothing in flight, nothing
  the buffer would admit), a buffer that refuses the mode's submissions, or a staleness guard that
  refuses what the buffer lets through;
* ``starves`` — it goes on, badly: the trainer waits for batches most of the time, the buffer drops
  most of what is generated, or the longest rollouts are nearly all dropped (a threshold that
  evicts every long rollout trains on a biased sample);
* ``ok``.
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np
from pydantic import Field

from rlpipe.schemas.config import Strict
from rlpipe.simulate.calibration import Calibration
from rlpipe.simulate.schedules import SCHEDULES
from rlpipe.simulate.setup import SimSetup
from rlpipe.simulate.simrun import SimRun

STARVED_WAIT_SHARE = 0.5
"""An async trainer that waits for batches more than this share of the time starves."""
STARVED_DROP_SHARE = 0.5
"""A buffer that drops more than this share of the finished groups starves the run of what it generates."""
LONG_TAIL_QUANTILE = 0.9
"""Groups whose longest response is at or above this quantile are the long rollouts whose eviction is checked."""


class Prediction(Strict):
    """What a simulated configuration does (the figures ``rlpipe simulate`` prints, and ``--json`` writes)."""

    mode: str
    """The simulated mode."""
    steps: int = Field(ge=0)
    """Steps simulated."""
    steps_done: int = Field(ge=0)
    """Steps that finished (fewer than ``steps`` when the run cannot go on)."""
    steps_per_s: float | None = None
    """Steps per second after the first step."""
    samples_per_s: float | None = None
    """Trajectories trained on per second after the first step."""
    step_s: float | None = None
    """Mean seconds per step after the first."""
    busy_share: dict[str, float] = Field(default_factory=dict)
    """Per worker (``rollout[i]`` decoding, ``actor``, ``driver`` ...): share of the simulated time it was busy."""
    trainer_wait_share: float | None = None
    """Async modes: share of the time the trainer waited for a batch."""
    mean_staleness: float | None = None
    """Mean staleness (consuming step − submission step + 1) of the groups consumed after the first step."""
    max_staleness: int | None = None
    """Largest staleness consumed."""
    staleness_hist: dict[int, int] = Field(default_factory=dict)
    """Consumed groups per staleness."""
    mean_version_lag: float | None = None
    """Mean of (trainer version − oldest token version) over consumed groups."""
    max_version_lag: int | None = None
    """Largest version lag consumed."""
    mean_versions_spanned: float | None = None
    """Mean weight versions per group (2 where a push came mid-generation)."""
    dropped_per_step: float = Field(0.0, ge=0)
    """Groups evicted as stale per step (the drop rate)."""
    submitted_per_step: float = Field(0.0, ge=0)
    """Prompts submitted per step (the refill rate; the consumed ones plus the dropped ones, in the long run)."""
    dropped_share: float = Field(0.0, ge=0, le=1)
    """Evicted / (evicted + consumed) groups."""
    long_dropped_share: float | None = None
    """The same among the long rollouts (longest response at or above the LONG_TAIL_QUANTILE of all groups)."""
    verdict: Literal["ok", "starves", "no_progress"] = "ok"
    """ok, starves (goes on, badly) or no_progress (cannot go on)."""
    verdict_reason: str = ""
    """Why, with the numbers and what to change."""
    notes: list[str] = Field(default_factory=list)
    """What the simulation assumed (uncalibrated nodes, lengths above the recorded cap, added stages)."""
    simulated_s: float = Field(0.0, ge=0)
    """Simulated seconds."""
    events: int = Field(0, ge=0)
    """Events the simulation ran."""
    wall_s: float = Field(0.0, ge=0)
    """Seconds the simulation itself took."""


def predict(setup: SimSetup, calibration: Calibration, steps: int, blockers: list[str] | None = None) -> Prediction:
    """Simulate ``steps`` steps of ``setup`` with ``calibration``'s costs (``blockers``: config-alone reasons the
    configuration cannot make progress, which the simulation then confirms or not)."""
    started = time.perf_counter()
    run = SimRun(setup, calibration, steps)
    trainer = run.kernel.process(SCHEDULES[setup.mode](run), "trainer")
    finished = run.kernel.run(until=lambda: trainer.finished or run.failure is not None)
    if not finished and run.failure is None:  # every process waits on something that will never happen
        run.fail(f"the simulation stopped at step {len(run.stats.step_end)}: every worker waits")
    prediction = summarise(run, steps)
    prediction.notes.extend(_notes(setup, calibration, run))
    if blockers:  # certain from the config alone, with the right fix: they say it better than the symptom
        prediction.verdict, prediction.verdict_reason = "no_progress", "; ".join(blockers)
    prediction.wall_s = time.perf_counter() - started
    return prediction


def summarise(run: SimRun, steps: int) -> Prediction:
    st, s = run.stats, run.setup
    ends = np.array(st.step_end)
    out: dict = {"mode": s.mode, "steps": steps, "steps_done": len(ends), "simulated_s": run.kernel.now,
                 "events": run.kernel.events}
    if len(ends) >= 2 and ends[-1] > ends[0]:
        span = float(ends[-1] - ends[0])
        out["steps_per_s"] = (len(ends) - 1) / span
        out["samples_per_s"] = out["steps_per_s"] * s.groups_per_step * s.group_size
        out["step_s"] = span / (len(ends) - 1)
    total = max(run.kernel.now, 1e-12)
    busy = {f"rollout[{r.index}]": r.busy_s / total for r in run.replicas}
    busy.update({name: w.busy_s / total for name, w in sorted(run.workers.items())})
    out["busy_share"] = {k: min(1.0, v) for k, v in busy.items()}
    if st.trainer_wait_s:  # the async schedules record the trainer's waits for a batch
        out["trainer_wait_share"] = min(1.0, sum(st.trainer_wait_s) / total)
    # like the recorded run's measure: after the first step (the pipeline fills during it)
    consumed = [c for c in st.consumed if c.step > 0] or st.consumed
    if consumed:
        stale = np.array([c.staleness for c in consumed])
        lag = np.array([c.version_lag for c in consumed])
        out.update(mean_staleness=float(stale.mean()), max_staleness=int(stale.max()),
                   staleness_hist={int(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))},
                   mean_version_lag=float(lag.mean()), max_version_lag=int(lag.max()),
                   mean_versions_spanned=float(np.mean([c.versions_spanned for c in consumed])))
    evicted = [g for g in _evicted(run) if g is not None]
    done = max(1, len(ends))
    out["dropped_per_step"] = len(evicted) / done
    out["submitted_per_step"] = st.submitted / done
    kept = len(st.consumed)
    out["dropped_share"] = len(evicted) / (len(evicted) + kept) if evicted or kept else 0.0
    longest = np.array([c.longest for c in st.consumed] + [max(g.lengths, default=0) for g in evicted])
    if len(longest) and longest.max() > longest.min():
        cut = np.quantile(longest, LONG_TAIL_QUANTILE)
        long_kept = sum(c.longest >= cut for c in st.consumed)
        long_dropped = sum(max(g.lengths, default=0) >= cut for g in evicted)
        if long_kept + long_dropped:
            out["long_dropped_share"] = long_dropped / (long_kept + long_dropped)
    prediction = Prediction(**out)
    prediction.verdict, prediction.verdict_reason = _verdict(run, prediction)
    return prediction


def _evicted(run: SimRun) -> list:
    buf = getattr(run, "buffer", None)
    return list(buf.evicted) if buf is not None else []


def _verdict(run: SimRun, p: Prediction) -> tuple[str, str]:
    s = run.setup
    if run.failure is not None:
        return "no_progress", run.failure
    reasons = []
    if p.trainer_wait_share is not None and p.trainer_wait_share > STARVED_WAIT_SHARE:
        reasons.append(f"the trainer waits for batches {p.trainer_wait_share:.0%} of the time: {s.replicas} rollout "
                       "replica(s) cannot keep up; raise resources.rollout_replicas, "
                       "mode_params.max_off_policy_threshold or capacity_steps")
    if p.dropped_share > STARVED_DROP_SHARE:
        reasons.append(f"{p.dropped_share:.0%} of the finished groups are dropped as staler than "
                       f"max_off_policy_threshold={s.threshold}; raise it, lower capacity_steps "
                       f"({s.capacity_steps}) or use strategy: wait")
    if p.long_dropped_share is not None and p.long_dropped_share > STARVED_DROP_SHARE:
        reasons.append(f"{p.long_dropped_share:.0%} of the longest rollouts are dropped as stale (threshold "
                       f"{s.threshold}): the trainer sees mostly short ones; raise "
                       "mode_params.max_off_policy_threshold or use strategy: wait")
    return ("starves", "; ".join(reasons)) if reasons else ("ok", "")


def _notes(setup: SimSetup, cal: Calibration, run: SimRun) -> list[str]:
    notes = [f"not modelled: {what}" for what in setup.unmodeled]
    if setup.checkpoint_every and setup.checkpoint_every < run.steps:
        notes.append(f"not modelled: checkpoints every {setup.checkpoint_every} steps take no time")
    if run.stats.uncalibrated:
        notes.append(f"no recorded executions of {', '.join(sorted(run.stats.uncalibrated))}: costed 0 s")
    if setup.max_tokens > cal.length_cap and cal.truncated_share > 0:
        notes.append(f"max_tokens {setup.max_tokens} > the recorded {cal.length_cap}, which truncated "
                     f"{cal.truncated_share:.0%} of the responses: lengths above {cal.length_cap} are unknown "
                     "(kept at the recorded cap), so generation is predicted short")
    if cal.env_latency_s and cal.generate_source == "calls":
        notes.append("the recording waited for environments (env_latency_s): its generate calls' fitted costs hold "
                     "part of that wait, which the simulation draws again, so generation is predicted slow")
    if cal.generate_source == "throughput":
        notes.append(f"generation costs from a throughput (the recording is {cal.recorded_mode}, its engine recorded "
                     "no decode iterations): no per-step part, so a long tail's latency is predicted short")
    if min(cal.rollout_share, cal.trainer_share) < 1:
        notes.append(f"shared cores: in the recording a replica decoded at {cal.rollout_share:.0%} of its own speed "
                     f"and the trainer's nodes ran at {cal.trainer_share:.0%} of theirs while a replica decoded; the "
                     "async modes are simulated at those shares, a sync run's phases at their own speed")
    elif cal.recorded_mode == "sync" and setup.mode != "sync":
        notes.append("a sync recording does not show how the trainer and the replicas slow each other where they "
                     "share cores (they never overlap in it): each runs at its own speed; record an async run to "
                     "calibrate that")
    gen = cal.generate
    if gen.carrier is not None and cal.generate_source == "calls":
        what = {"tokens": "per token", "decode_steps": "per decode step"}.get(gen.carrier, f"per {gen.carrier}")
        notes.append(f"the recording did not vary {', '.join(gen.unidentified)} of generation: the time the rest "
                     f"does not explain is charged {what} (a guess: vary the batch or the lengths to measure it)")
    return notes
