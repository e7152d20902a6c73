"""Calibrating on an async recording: decode iterations, shared cores and the driver's turnaround, on hand-built
sums and records with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.modes.async_common import DECODE_SUMS
from rlpipe.simulate.calibration import (Measured, _call_s, _decoding_share, _fit_iterations, _intrinsic, _own_s,
                                         _step_gap, _sync_gap, _trainer_share)
from rlpipe.simulate.fit import CostFit


def _sums(per_step: dict[int, list[tuple[int, float, float]]]) -> dict[str, dict[int, float]]:
    """Step metrics of DECODE_SUMS from each step's iterations (requests k, seconds t, CPU seconds c)."""
    out = {name: {} for name in DECODE_SUMS.values()}
    for step, its in per_step.items():
        k, t, c = (np.array(x, dtype=float) for x in zip(*its))
        for key, value in {"decode_steps": len(k), "decode_tokens": k.sum(), "decode_s": t.sum(),
                           "decode_tokens_sq": (k * k).sum(), "decode_token_s": (k * t).sum(),
                           "decode_cpu_s": c.sum()}.items():
            out[DECODE_SUMS[key]][step] = float(value)
    return out


def test_decode_iterations_give_the_fixed_and_per_request_cost_of_an_iteration():
    """t = 2 ms + 0.05 ms × k over iterations decoding 64 down to 1 requests (a long tail): the least-squares line
    recovers both; the warm-up step's odd iterations are left out; CPU 3/4 of the time."""
    its = [(k, 0.002 + 0.00005 * k, 0.75 * (0.002 + 0.00005 * k)) for k in range(64, 0, -1)]
    sums = _sums({0: [(5, 1.0, 1.0)], 1: its[:30], 2: its[30:]})
    fit, source, cpu_share, decode_s = _fit_iterations(sums, warmup=[0])
    assert source == "iterations"
    assert fit.coef["decode_steps"] == pytest.approx(0.002) and fit.coef["tokens"] == pytest.approx(0.00005)
    assert cpu_share == pytest.approx(0.75) and decode_s == pytest.approx(sum(t for _, t, _ in its))


def test_iterations_all_of_one_size_charge_the_fixed_part():
    sums = _sums({1: [(8, 0.004, 0.004)] * 10})
    fit, *_ = _fit_iterations(sums, warmup=[])
    assert fit.coef == pytest.approx({"decode_steps": 0.004, "tokens": 0.0})


def _record(node: str, step: int, start: float, duration: float, worker: str = "actor×1",
            run_queue_s: float | None = None) -> NodeRecord:
    return NodeRecord(run_id="r", step=step, node=node, kind=node, impl="x", params={}, params_hash="", code_hash="",
                      input_fingerprint="", output_fingerprint="", rows_in=8, rows_out=8, policy_versions=[step],
                      trainer_version=step, start_time=start, duration_s=duration, metrics={}, worker=worker,
                      run_queue_s=run_queue_s)


def test_the_trainer_s_share_beside_decoding_from_its_nodes_waits_for_a_core():
    """Nodes of 0.5 s that waited 0.1 s for a core: their own time is 0.4 s, 0.8 of their wall time. A replica
    decoded 80% of the run (4 s span, 3.2 s of decoding), so 80% of a node's time overlapped it: 1 − 0.8 (1 − s)
    = 0.8 gives s = 0.75. Two replicas each decoding half the run: at least one decodes 1 − 0.5² = 75% of it."""
    measured = Measured(steps=4, steps_per_s=1.0)
    fitted = [_record("update", s, 10.0 + s, 0.5, run_queue_s=0.1) for s in range(1, 5)]
    assert _own_s(fitted[0]) == pytest.approx(0.4)
    decoding = _decoding_share(3.2, measured, replicas=1)
    assert decoding == pytest.approx(0.8)
    assert _trainer_share(fitted, decoding) == pytest.approx(0.75)
    assert _decoding_share(4.0, measured, replicas=2) == pytest.approx(0.75)
    assert _trainer_share(fitted, 0.0) == 1.0  # nothing decoded beside them: no share to measure


def test_without_the_nodes_clocks_the_replica_s_loss_is_taken_to_the_trainer_s_time():
    """(Recordings before NodeRecord.run_queue_s.) The decode loop got 3/4 of a core; the trainer computed half the
    run (u_t = 0.5): while both ran each got c = 1 − 0.25 / 0.5 = 0.5. The replica decoded 80% of the run, so a
    node ran at 0.5 for 80% of its time: its own cost is its recorded one / (1 + 0.8 × (1/0.5 − 1)) = / 1.8; an
    iteration's own cost is 3/4 of the recorded one, and the replica decodes at 3/4 of its speed."""
    measured = Measured(steps=4, steps_per_s=1.0)  # a 4 s span
    fitted = [_record("update", s, 10.0 + s, 0.5) for s in range(1, 5)]  # 2 s of trainer work
    generate = CostFit(coef={"decode_steps": 0.004, "tokens": 0.0001})
    nodes = {"update": CostFit(coef={"rows": 0.9 / 8}, floor_s=0.1)}
    gen, own, shares = _intrinsic(generate, nodes, cpu_share=0.75, decoding=0.8, fitted=fitted, measured=measured)
    assert shares == pytest.approx((0.75, 0.5))
    assert gen.coef == pytest.approx({"decode_steps": 0.003, "tokens": 0.000075})
    assert own["update"](rows=8) == pytest.approx(0.9 / 1.8) and own["update"].floor_s == pytest.approx(0.1 / 1.8)


def test_an_async_step_gap_is_the_driver_s_turnaround_without_its_wait_for_a_batch():
    """Steps 1–3 end 0.10, 0.30 and 0.12 s before the next starts; the driver waited 0, 0.2 and 0 s of that for a
    batch: its own turnaround is 0.1, 0.1 and 0.12 (the first gap, after the warm-up step, left out)."""
    records, t = [], 0.0
    gaps = {0: 0.5, 1: 0.10, 2: 0.30, 3: 0.12}
    for step in range(5):
        records.append(_record("update", step, t, 1.0))
        t += 1.0 + gaps.get(step, 0.0)
    waits = {1: 0.4, 2: 0.0, 3: 0.2, 4: 0.0}
    assert _step_gap(records, "separate_async", waits) == pytest.approx((0.1 + 0.1 + 0.12) / 3)
    assert _step_gap(records, "separate_async", None) == pytest.approx(np.percentile([0.1, 0.3, 0.12], 10))


def test_a_sync_run_simulated_from_an_async_one_charges_the_driver_s_records_between_steps():
    """An async run's steps overlap the driver's records of the previous one; a sync run waits for them: its gap is
    their recorded time (warm-up left out), a sync recording's its own gap."""
    assert _sync_gap(0.04, {0: 0.9, 1: 0.004, 2: 0.006}, [0], "separate_async") == pytest.approx(0.005)
    assert _sync_gap(0.04, None, [0], "separate_async") == 0.04
    assert _sync_gap(0.005, {1: 0.5}, [0], "sync") == 0.005


def test_a_driver_call_s_round_trip_is_the_median_of_the_steps_medians_after_the_warm_up():
    assert _call_s({0: 1.0, 1: 0.004, 2: 0.009, 3: 0.005}, [0]) == pytest.approx(0.005)
    assert _call_s(None, [0]) == 0.0  # not recorded: no call is charged
