"""Calibration of ``rlpipe simulate`` from a recorded run's lineage.

What a run records (:data:`rlpipe.engine.tracking.lineage.LINEAGE_SCHEMA`: one row per node
execution with its worker, start, duration, rows, versions and metrics; and the trajectory
lineage: per consumed trajectory its prompt step, consuming step, response tokens and token
versions) is turned into the costs the event model needs:

* **per node** (every node but ``generate``): duration as a function of the step's rows and
  response tokens (:func:`rlpipe.simulate.fit.fit_cost`); where it ran (``worker``);
* **generation**: a sync (or ``filter_groups`` refill) generate call's duration as
  ``call overhead + per_step_s × longest response + per_token_s × tokens per replica`` — the
  continuous-batching model of :mod:`rlpipe.simulate.replica` — fitted on the calls' recorded
  ``generate/response_length_max`` and ``_mean``. An async run's generate records are
  collections (how long the driver or a feeder waited for finished groups), not calls; its
  replicas record their decode iterations instead (the ``rollout/decode_*`` step metrics): an
  iteration's seconds fitted as ``per_step_s + per_token_s × requests it decoded``. Without them
  only a throughput is estimated (collection time per token, no per-step part);
* **response lengths**: every recorded group's lengths, resampled whole by the simulator, and the
  share that hit the recorded cap (``max_tokens``);
* **the gap between steps**: the driver's own time between one step's last node and the next
  one's first (writing records, drawing prompts; in an async run also the buffer's sample and the
  replicas' reports): the mean, in an async run after taking out the step's recorded wait for its
  batch (``async/guard_wait_s``; without it the 10th percentile of the gaps) — a sync run's, simulated from an
  async recording, is the driver's recorded time on a step's records (``timing/step_end_s``); and
  **between nodes**, per node, the mean time from the end of the execution before it to its start (the
  executor's work between calls);
* **what was measured** (:class:`Measured`), to print next to a prediction of the same config.

The first step recorded is left out of every fit (warm-up: caches, lazy imports) when there
are more. Environment latency is the generate params' own (``env_latency_s``, a Pareto draw per
request): the lineage does not record it per trajectory, and fitted costs of a workload with one
absorb part of it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field

from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.schemas.config import PipelineConfig, Strict
from rlpipe.simulate.fit import CostFit, fit_cost
from rlpipe.stage_kinds import step_role_of

SYNC_CALL_METRIC = "generate/response_length_max"
"""A generate record carrying this metric is a whole generate call (sync); an async collection carries
``generate/collected_rows`` instead."""


@dataclass
class Recording:
    """What calibration reads: a run's config, its node records and its trajectory lineage."""

    run_id: str
    config: PipelineConfig
    records: list[NodeRecord]
    trajectories: pa.Table | None = None
    """:data:`rlpipe.engine.tracking.lineage.TRAJECTORY_LINEAGE_SCHEMA` rows (None: not recorded)."""
    trainer_waits: dict[int, float] | None = None
    """An async run's ``async/guard_wait_s`` per step: how long the driver waited for the step's batch (None: not
    recorded, or a sync run)."""
    decode_sums: dict[str, dict[int, float]] | None = None
    """An async run's ``rollout/decode_*`` metrics (rlpipe.modes.async_common.DECODE_SUMS) per step: its replicas'
    decode iterations (None: not recorded)."""
    step_end_s: dict[int, float] | None = None
    """An async run's ``timing/step_end_s`` per step: the driver's own work on the step's records (None: not
    recorded, or a sync run, whose step gaps hold it)."""
    driver_call_s: dict[int, float] | None = None
    """An async run's ``timing/driver_call_s`` per step: the median round trip of the driver's calls to its workers
    (None: not recorded)."""


class Measured(Strict):
    """What the recorded run did, over its steps after the warm-up one."""

    steps: int = Field(ge=0)
    """Steps measured (after the warm-up step)."""
    steps_per_s: float | None = None
    """Steps per second between the end of the warm-up step and the end of the last."""
    samples_per_s: float | None = None
    """Trajectories trained on per second over the same span."""
    mean_staleness: float | None = None
    """Mean staleness of the consumed trajectories (consuming step − prompt step + 1)."""
    max_staleness: int | None = None
    """Largest staleness consumed."""
    mean_version_lag: float | None = None
    """Mean of (trainer version at the update − oldest token version) over consumed trajectories."""
    max_version_lag: int | None = None
    """Largest version lag consumed."""


class Calibration(Strict):
    """The costs and distributions the simulator runs on (see the module docstring)."""

    run_id: str
    """The recorded run."""
    recorded_mode: str
    """The mode the run was recorded in."""
    recorded_replicas: int = Field(1, ge=1)
    """Rollout replicas of the recorded run (generation costs are per replica)."""
    warmup_steps: list[int] = Field(default_factory=list)
    """Steps left out of the fits."""
    nodes: dict[str, CostFit] = Field(default_factory=dict)
    """Per node name (every node but generate): its duration fit on rows and tokens."""
    workers: dict[str, str] = Field(default_factory=dict)
    """Per node name: where it ran, as recorded (``actor×1``, ``task in rollout×1@…``, ``rollout[0]``)."""
    generate: CostFit = Field(default_factory=CostFit)
    """Generation: intercept = a sync call's overhead, coef ``decode_steps`` = seconds per decode iteration,
    ``tokens`` = seconds per token per iteration (per replica)."""
    generate_source: Literal["calls", "iterations", "throughput", "none"] = "none"
    """calls: fitted on sync generate calls; iterations: on an async run's recorded decode iterations (the
    ``rollout/decode_*`` metrics); throughput: estimated from async collections; none: no record."""
    group_lengths: list[list[int]] = Field(default_factory=list)
    """Response lengths of every recorded group (one list per prompt and consuming step)."""
    length_cap: int = Field(1, ge=1)
    """The recorded generate stage's max_tokens."""
    truncated_share: float = Field(0.0, ge=0, le=1)
    """Share of recorded responses at the cap (their real length is unknown: above the cap)."""
    env_latency_s: float = Field(0.0, ge=0)
    """The recorded generate stage's env_latency_s (its generate calls' durations hold part of that wait)."""
    step_gap_s: float = Field(0.0, ge=0)
    """Driver time between steps (see the module docstring)."""
    sync_gap_s: float = Field(0.0, ge=0)
    """Driver time between a sync run's steps: the step gap of a sync recording; from an async one, whose steps'
    records overlap the next step's training, the driver's recorded time on them (``timing/step_end_s``), else its
    step gap."""
    overlapped: list[tuple[str, str]] = Field(default_factory=list)
    """Pairs of nodes that ran at the same time in most recorded steps (the executor's concurrent branches);
    every other node waits for the one before it, as the executor runs them."""
    call_s: float = Field(0.0, ge=0)
    """A driver call's round trip (to the buffer, a replica): the median of an async recording's per-step medians
    (``timing/driver_call_s``); 0 when not recorded. Charged for each call of a simulated mode's protocol that the
    recording's mode does not make — its own are in its recorded gaps (rlpipe.simulate.schedules)."""
    dispatch_s: dict[str, float] = Field(default_factory=dict)
    """Per node: mean seconds between the end of the execution before it in its step and its start (the
    executor's own work between calls: lineage records, fingerprints, the next call's submission)."""
    rollout_share: float = Field(1.0, gt=0, le=1)
    """The share of its own speed a replica's decode loop runs at in an async mode, beside the trainer and the
    driver (rlpipe.simulate.contention): its iterations' CPU seconds over their wall seconds in an async recording;
    1 from a sync recording (nothing measured it) and on a GPU cluster. The fitted generation cost is its own."""
    trainer_share: float = Field(1.0, gt=0, le=1)
    """The share of its own speed a trainer node runs at while a replica decodes: from an async recording's nodes,
    their wall time less their threads' waits for a core (NodeRecord.run_queue_s) over their wall time, taken to
    the part of their time a replica decoded; 1 from a sync recording. The fitted node costs are their own."""
    measured: Measured | None = None
    """What the recorded run did."""


def calibrate(recording: Recording) -> Calibration:
    """The :class:`Calibration` of a recorded run."""
    config = recording.config
    # the trainer's borrowed generation (separate_async's mode_params.borrow) is not modelled: left out
    records = [r for r in recording.records if not r.error and not r.worker.endswith("(borrowed)")]
    steps = sorted({r.step for r in records})
    warmup = steps[:1] if len(steps) > 1 else []
    fitted = [r for r in records if r.step not in warmup]
    per_row = _tokens_per_row(recording.trajectories, records)
    gen = next((s for s in config.stages if step_role_of(s.kind) == "generates"), None)
    cap = int((gen.params if gen else {}).get("max_tokens", 1) or 1)
    lengths = _group_lengths(recording.trajectories, records)
    flat = [x for g in lengths for x in g]
    by_node: dict[str, list[NodeRecord]] = defaultdict(list)
    workers: dict[str, str] = {}
    for r in fitted:
        if step_role_of(r.kind) != "generates":
            by_node[r.node].append(r)
        workers.setdefault(r.node, r.worker)
    for r in records:  # nodes seen only in the warm-up step still say where they ran
        workers.setdefault(r.node, r.worker)
    # an async recording whose nodes' clocks were read: each node's own time is its wall time less its waits for
    # a core (what the replicas and the driver beside it cost it)
    clocked = bool(recording.decode_sums) and all(r.run_queue_s is not None for recs in by_node.values() for r in recs)
    nodes = {}
    for name, recs in by_node.items():
        rows = np.array([float(r.rows_in or r.rows_out) for r in recs])
        tokens = rows * np.array([per_row.get(r.step, per_row.get(None, 0.0)) for r in recs])
        nodes[name] = fit_cost([_own_s(r) if clocked else r.duration_s for r in recs], {"tokens": tokens, "rows": rows})
    for name in {r.node for r in records if step_role_of(r.kind) != "generates"} - set(nodes):
        recs = [r for r in records if r.node == name]  # only in the warm-up step: its mean
        nodes[name] = CostFit.constant(float(np.mean([r.duration_s for r in recs])))
    replicas = config.resources.rollout_replicas
    generate, source = _fit_generate(fitted or records, replicas, per_row)
    measured = measure(recording, warmup)
    shares = (1.0, 1.0)
    if recording.decode_sums and source != "calls":  # an async run: its replicas' own decode iterations
        iterations = _fit_iterations(recording.decode_sums, warmup)
        if iterations is not None:
            generate, source, cpu_share, decode_s = iterations
            busy = _decoding_share(decode_s, measured, replicas)
            if clocked:
                generate, shares = generate.scaled(cpu_share), (cpu_share, _trainer_share(fitted, busy))
            else:
                generate, nodes, shares = _intrinsic(generate, nodes, cpu_share, busy, fitted, measured)
    gap = _step_gap(records, config.mode, recording.trainer_waits)
    return Calibration(
        run_id=recording.run_id, recorded_mode=config.mode, recorded_replicas=replicas, warmup_steps=warmup,
        nodes=nodes, workers=workers, generate=generate, generate_source=source, group_lengths=lengths,
        length_cap=cap, env_latency_s=float((gen.params if gen else {}).get("env_latency_s", 0.0) or 0.0),
        truncated_share=float(np.mean(np.array(flat) >= cap)) if flat else 0.0,
        step_gap_s=gap, sync_gap_s=_sync_gap(gap, recording.step_end_s, warmup, config.mode),
        dispatch_s=_dispatch(fitted, config.mode), overlapped=_overlapped(fitted),
        rollout_share=shares[0], trainer_share=shares[1], call_s=_call_s(recording.driver_call_s, warmup),
        measured=measured,
    )


def _fit_generate(records: list[NodeRecord], replicas: int, per_row: dict) -> tuple[CostFit, str]:
    gens = [r for r in records if step_role_of(r.kind) == "generates"]
    calls = [r for r in gens if SYNC_CALL_METRIC in r.metrics]
    if calls:
        longest = [r.metrics[SYNC_CALL_METRIC] for r in calls]
        tokens = [r.metrics.get("generate/response_length_mean", 0.0) * r.rows_out / replicas for r in calls]
        # decode steps first: a constant part goes to the decode loop's iterations. At the batch sizes RL engines
        # run, an iteration's cost is mostly fixed (a GPU reads the weights once per iteration whatever the batch;
        # a CPU pays per operation), so a few requests decoding alone cost almost what a full batch does
        fit = fit_cost([r.duration_s for r in calls], {"decode_steps": longest, "tokens": tokens})
        if not any(fit.coef.values()) and fit.intercept_s > 0 and np.mean(longest) > 0:
            # the lengths explained none of the calls' spread (noise larger than their effect): the time is still
            # spent decoding, so charge it per decode step (a replica's loop cannot iterate for free)
            fit = fit.model_copy(update={"intercept_s": 0.0, "carrier": "decode_steps",
                                         "coef": {**fit.coef, "decode_steps": fit.intercept_s / float(np.mean(longest))}})
        return fit, "calls"
    if gens:
        mean_len = per_row.get(None, 0.0)
        tokens = sum(r.rows_out for r in gens) * mean_len / replicas
        if tokens > 0:
            # each replica's collections, summed, bound the time it spent producing what they returned
            seconds = sum(r.duration_s for r in gens) / replicas
            return CostFit(coef={"tokens": seconds / tokens, "decode_steps": 0.0}, samples=len(gens),
                           unidentified=["decode_steps"]), "throughput"
    return CostFit(coef={"tokens": 0.0, "decode_steps": 0.0}), "none"


def _fit_iterations(sums: dict[str, dict[int, float]], warmup: list[int]
                    ) -> tuple[CostFit, str, float, float] | None:
    """An engine step's seconds as ``per_step + per_token × requests decoded``: the least-squares line through
    every decode iteration the replicas recorded after the warm-up (from the sums of DECODE_SUMS), coefficients
    ≥ 0; with the share of a core the decode loop got (its CPU seconds over its seconds) and its seconds. None
    when no iteration was recorded."""
    from rlpipe.modes.async_common import DECODE_SUMS

    total = {key: sum(_past_warmup(sums[name], warmup)) for key, name in DECODE_SUMS.items()}
    n, k, k2, t, kt = (total[key] for key in ("decode_steps", "decode_tokens", "decode_tokens_sq", "decode_s",
                                                "decode_token_s"))
    if n <= 0 or t <= 0:
        return None
    spread = n * k2 - k * k
    per_token = (n * kt - k * t) / spread if spread > 1e-9 * max(1.0, n * k2) else 0.0
    per_step = (t - per_token * k) / n
    if per_token < 0:  # more requests, no more time: noise; the iteration's cost is its fixed part
        per_step, per_token = t / n, 0.0
    elif per_step < 0:
        per_step, per_token = 0.0, kt / k2
    fit = CostFit(coef={"decode_steps": per_step, "tokens": per_token}, samples=int(n))
    return fit, "iterations", min(1.0, max(1e-3, total["decode_cpu_s"] / t)), t


def _own_s(r: NodeRecord) -> float:
    """A node execution's own time: its wall time less its thread's waits for a core."""
    return max(0.0, r.duration_s - (r.run_queue_s or 0.0))


def _decoding_share(decode_s: float, measured: "Measured", replicas: int) -> float:
    """The share of the recorded span during which at least one replica decoded (each replica's decode seconds
    over the span, taken as independent)."""
    if not measured.steps_per_s or not measured.steps:
        return 0.0
    each = min(1.0, decode_s / (measured.steps / measured.steps_per_s) / replicas)
    return 1.0 - (1.0 - each) ** replicas


def _trainer_share(fitted: list[NodeRecord], decoding: float) -> float:
    """The share of its own speed a trainer node had while a replica decoded: its own time over its wall time is
    ``1 − f (1 − share)`` when a part ``f`` of it overlapped decoding (``f``: the share of the run a replica
    decoded)."""
    recs = [r for r in fitted if _trainer_side(r)]
    wall = sum(r.duration_s for r in recs)
    if wall <= 0 or decoding <= 0:
        return 1.0
    own = sum(_own_s(r) for r in recs) / wall
    return min(1.0, max(0.1, 1.0 - (1.0 - own) / decoding))


def _intrinsic(generate: CostFit, nodes: dict[str, CostFit], cpu_share: float, decoding: float,
               fitted: list[NodeRecord], measured: "Measured"
               ) -> tuple[CostFit, dict[str, CostFit], tuple[float, float]]:
    """Each side's own costs and shares from an async recording whose nodes' clocks were not read (recorded before
    NodeRecord.run_queue_s, or where the kernel does not report it): the decode loop got ``cpu_share`` of a core;
    taking its whole loss to the time the trainer computed (a share ``u_t`` of the run), the trainer lost as much
    while both ran: ``c = 1 − (1 − cpu_share) / u_t``, and a node, beside decoding a share ``decoding`` of its time,
    took ``1 + decoding (1/c − 1)`` times its own."""
    if not measured.steps_per_s or not measured.steps:
        return generate, nodes, (1.0, 1.0)
    span = measured.steps / measured.steps_per_s
    u_t = min(1.0, sum(r.duration_s for r in fitted if _trainer_side(r)) / span)
    if u_t <= 0:
        return generate.scaled(cpu_share), nodes, (cpu_share, 1.0)
    share = min(1.0, max(0.1, 1.0 - (1.0 - cpu_share) / u_t))
    slowed = 1.0 + decoding * (1.0 / share - 1.0)
    own = {name: fit.scaled(1.0 / slowed) for name, fit in nodes.items()}
    return generate.scaled(cpu_share), own, (cpu_share, share)


def _tokens_per_row(trajectories: pa.Table | None, records: list[NodeRecord]) -> dict:
    """Mean response tokens per trajectory: per consuming step, and for the whole run (key None)."""
    out: dict = {}
    if trajectories is not None and trajectories.num_rows:
        steps = trajectories.column("consumed_step").to_numpy(zero_copy_only=False)
        tokens = trajectories.column("num_tokens").to_numpy(zero_copy_only=False).astype(np.float64)
        for s in np.unique(steps):
            out[int(s)] = float(tokens[steps == s].mean())
        out[None] = float(tokens.mean())
        return out
    means = [(r.step, r.metrics["generate/response_length_mean"]) for r in records
             if "generate/response_length_mean" in r.metrics]
    for step, mean in means:
        out[step] = mean
    if means:
        out[None] = float(np.mean([m for _, m in means]))
    return out


def _group_lengths(trajectories: pa.Table | None, records: list[NodeRecord]) -> list[list[int]]:
    """Every recorded group's response lengths; without trajectory lineage, groups of the mean length."""
    if trajectories is not None and trajectories.num_rows:
        uids = trajectories.column("uid").to_pylist()
        steps = trajectories.column("consumed_step").to_pylist()
        tokens = trajectories.column("num_tokens").to_pylist()
        groups: dict[tuple, list[int]] = {}
        for uid, step, n in zip(uids, steps, tokens):  # one pass over the rows a run consumed: not a hot path
            groups.setdefault((uid, step), []).append(int(n or 0))
        return list(groups.values())
    out = []
    for r in records:
        mean = r.metrics.get("generate/response_length_mean")
        if mean is not None and r.rows_in:
            n = max(1, r.rows_out // r.rows_in)
            out.extend([[int(round(mean))] * n for _ in range(r.rows_in)])
    return out


def _on_path(r: NodeRecord, mode: str) -> bool:
    """A record on the step's own path: every one in sync; in an async run not the generation side's (its
    collections and the replicas' scoring overlap the trainer's steps and are labelled by the step that
    drained them)."""
    return mode == "sync" or _trainer_side(r)


def _trainer_side(r: NodeRecord) -> bool:
    """A record of the trainer's path (an async run's generation-side records overlap it)."""
    return step_role_of(r.kind) != "generates" and not r.worker.startswith("rollout[")


def _step_gap(records: list[NodeRecord], mode: str, waits: dict[int, float] | None = None) -> float:
    """Driver time between steps (see the module docstring)."""
    spans: dict[int, list[float]] = {}
    for r in records:
        if not _on_path(r, mode):
            continue
        lo, hi = spans.get(r.step, [np.inf, -np.inf])
        spans[r.step] = [min(lo, r.start_time), max(hi, r.start_time + r.duration_s)]
    steps = sorted(spans)
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if b == a + 1]
    async_unknown = mode != "sync" and not (waits and all(b in waits for _, b in pairs))
    gaps = [max(0.0, spans[b][0] - spans[a][1] - (0.0 if mode == "sync" or async_unknown else waits[b]))
            for a, b in pairs]
    if len(gaps) > 1:
        gaps = gaps[1:]  # the gap after the warm-up step holds its late work (figures, first records)
    if not gaps:
        return 0.0
    return float(np.percentile(gaps, 10) if async_unknown else np.mean(gaps))


def _past_warmup(per_step: dict[int, float] | None, warmup: list[int]) -> list[float]:
    """A step metric's values of the steps after the warm-up."""
    return [v for step, v in (per_step or {}).items() if step not in warmup]


def _sync_gap(gap: float, step_ends: dict[int, float] | None, warmup: list[int], mode: str) -> float:
    """Driver time between a sync run's steps (Calibration.sync_gap_s)."""
    ends = _past_warmup(step_ends, warmup)
    return float(np.mean(ends)) if mode != "sync" and ends else gap


def _call_s(calls: dict[int, float] | None, warmup: list[int]) -> float:
    """A driver call's round trip (Calibration.call_s)."""
    trips = _past_warmup(calls, warmup)
    return float(np.median(trips)) if trips else 0.0


def _dispatch(records: list[NodeRecord], mode: str) -> dict[str, float]:
    """Per node: the mean time from the latest end before its start, within its step's path, to its start (the
    first node of a step has none: the step gap holds its wait)."""
    by_step: dict[int, list[NodeRecord]] = defaultdict(list)
    for r in records:
        if _on_path(r, mode):
            by_step[r.step].append(r)
    gaps: dict[str, list[float]] = defaultdict(list)
    for recs in by_step.values():
        recs = sorted(recs, key=lambda r: r.start_time)
        for i, r in enumerate(recs):
            ends = [q.start_time + q.duration_s for q in recs[:i] if q.start_time + q.duration_s <= r.start_time]
            if ends:
                gaps[r.node].append(r.start_time - max(ends))
    return {node: float(np.mean(g)) for node, g in gaps.items()}


def _overlapped(records: list[NodeRecord]) -> list[tuple[str, str]]:
    """Pairs of trainer-side nodes whose executions overlapped in time in at least half the steps both ran in."""
    by_step: dict[int, list[NodeRecord]] = defaultdict(list)
    for r in records:
        if _trainer_side(r):
            by_step[r.step].append(r)
    together: dict[tuple[str, str], int] = defaultdict(int)
    seen: dict[tuple[str, str], int] = defaultdict(int)
    for recs in by_step.values():
        for i, a in enumerate(recs):
            for b in recs[i + 1:]:
                pair = tuple(sorted((a.node, b.node)))
                seen[pair] += 1
                if a.start_time < b.start_time + b.duration_s and b.start_time < a.start_time + a.duration_s:
                    together[pair] += 1
    return sorted(pair for pair, n in together.items() if 2 * n >= seen[pair])


def step_ends(records: list[NodeRecord]) -> dict[int, float]:
    """When each step's training ended: its weight push's end (else its last record's)."""
    ends: dict[int, float] = {}
    pushes: dict[int, float] = {}
    for r in records:
        end = r.start_time + r.duration_s
        if step_role_of(r.kind) == "pushes_weights":
            pushes[r.step] = max(pushes.get(r.step, end), end)
        elif _trainer_side(r):
            ends[r.step] = max(ends.get(r.step, end), end)
    return {**ends, **pushes}


def measure(recording: Recording, warmup: list[int]) -> Measured:
    """Throughput, staleness and version lag of the recorded run after its warm-up steps."""
    ends = step_ends([r for r in recording.records if not r.error])
    steps = sorted(ends)
    first = max(warmup) if warmup else None
    measured = [s for s in steps if first is None or s > first]
    out: dict = {"steps": len(measured)}
    start = ends[first] if first is not None else None
    if start is not None and measured and ends[measured[-1]] > start:
        span = ends[measured[-1]] - start
        out["steps_per_s"] = len(measured) / span
        traj = recording.trajectories
        if traj is not None and traj.num_rows:
            consumed = traj.column("consumed_step").to_numpy(zero_copy_only=False)
            out["samples_per_s"] = float(np.isin(consumed, measured).sum()) / span
    traj = recording.trajectories
    if traj is not None and traj.num_rows:
        consumed = traj.column("consumed_step").to_numpy(zero_copy_only=False).astype(np.int64)
        prompt = traj.column("prompt_step").to_numpy(zero_copy_only=False)
        keep = np.isin(consumed, measured) if measured else np.ones(len(consumed), bool)
        if keep.any():
            staleness = consumed[keep] - prompt[keep].astype(np.int64) + 1
            out["mean_staleness"], out["max_staleness"] = float(staleness.mean()), int(staleness.max())
            lags = _version_lags(recording.records, traj, keep)
            if len(lags):
                out["mean_version_lag"], out["max_version_lag"] = float(lags.mean()), int(lags.max())
    return Measured(**out)


def _version_lags(records: list[NodeRecord], traj: pa.Table, keep: np.ndarray) -> np.ndarray:
    """Trainer version at the consuming step's update − each kept trajectory's oldest token version."""
    trainer = {r.step: r.trainer_version for r in records if step_role_of(r.kind) == "updates_policy"}
    consumed = traj.column("consumed_step").to_pylist()
    oldest = traj.column("min_version").to_pylist()
    lags = [trainer[s] - v for s, v, k in zip(consumed, oldest, keep) if k and v is not None and s in trainer]
    return np.array(lags, dtype=np.int64)
