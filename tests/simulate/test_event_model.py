"""The event model on hand-built recordings whose answers are known in closed form."""

from __future__ import annotations

import pytest

from handbuilt import handbuilt
from rlpipe.simulate import calibrate, predict, simulate
from rlpipe.modes.feasibility import simulating
from rlpipe.simulate.setup import build_setup, simulated_config

G, T = 0.3, 0.5  # seconds of generation and of training per step


def test_sync_alternates_generation_and_training(tmp_path):
    rec, raw = handbuilt(tmp_path, {"generate": G, "update": T})
    p = simulate(rec, raw, steps=50).prediction
    assert p.steps_per_s == pytest.approx(1 / (G + T), rel=1e-9)
    assert p.samples_per_s == pytest.approx(4 * 2 / (G + T), rel=1e-9)
    assert p.busy_share["rollout[0]"] == pytest.approx(G / (G + T), rel=0.03)  # the first step's wait is in the span
    assert (p.mean_staleness, p.max_staleness, p.max_version_lag, p.verdict) == (1.0, 1, 0, "ok")


def test_sync_adds_the_driver_gap_and_the_pauses_between_nodes(tmp_path):
    rec, raw = handbuilt(tmp_path, {"generate": G, "update": T})
    for i, r in enumerate(rec.records):  # 10 ms between every node, 50 ms more before every step
        r.start_time += 0.01 * i + 0.05 * r.step
    p = simulate(rec, raw, steps=20).prediction
    assert p.steps_per_s == pytest.approx(1 / (G + T + 7 * 0.01 + 0.05), rel=1e-9)


@pytest.mark.parametrize("gen,train", [(G, T), (T, G)])
def test_colocate_without_release_overlaps_perfectly(tmp_path, gen, train):
    rec, raw = handbuilt(tmp_path, {"generate": gen, "update": train})
    over = ["mode=colocate_async", "mode_params.release_memory_during_update=false"]
    p = simulate(rec, raw, over, steps=60).prediction
    assert p.steps_per_s == pytest.approx(1 / max(gen, train), rel=1e-6)
    assert (p.mean_staleness, p.max_staleness, p.verdict) == (2.0, 2, "ok")


def test_colocate_release_stops_generation_from_update_to_push(tmp_path):
    # generation overlaps only old_log_prob (0.2 s); the rest of it waits for the push
    rec, raw = handbuilt(tmp_path, {"generate": 0.5, "old_log_prob": 0.2, "update": 0.3})
    p = simulate(rec, raw, ["mode=colocate_async"], steps=60).prediction
    assert p.steps_per_s == pytest.approx(1 / (0.5 + 0.3), rel=1e-6)  # (0.5 - 0.2) + 0.2 + 0.3 per step
    assert p.max_version_lag == 1 and p.mean_versions_spanned == pytest.approx(2.0)


def test_colocate_from_another_mode_s_recording_pays_its_driver_s_round_trips(tmp_path):
    """Generation (0.3 s) hides behind training (0.5 s); before each step the driver makes seven calls of round
    trip c the recording's mode did not make: a sample that finds the finished groups not yet stored, the collect,
    the store, the sample that gets the batch, and the next step's submission (a draw, the pending prompts, the
    replicas' submit) — which the last step does not make. The scoring recorded as a plain task holds its own
    round trip. Steps 1–59 are measured. Recorded in colocate_async itself, its gaps hold them: nothing is added.
    A sync generate call simulated from an async recording (whose replicas decode without calls) pays one."""
    c = 0.01
    rec, raw = handbuilt(tmp_path, {"generate": G, "update": T})
    cal = calibrate(rec).model_copy(update={"call_s": c})
    over = ["mode=colocate_async", "mode_params.release_memory_during_update=false"]
    p = simulate(rec, raw, over, steps=60, calibration=cal).prediction
    assert p.steps_per_s == pytest.approx(59 / (59 * T + (59 * 7 - 3) * c), rel=1e-6)
    own = cal.model_copy(update={"recorded_mode": "colocate_async"})
    assert simulate(rec, raw, over, steps=60, calibration=own).prediction.steps_per_s == pytest.approx(1 / T, rel=1e-6)
    from_async = cal.model_copy(update={"recorded_mode": "separate_async", "generate_source": "iterations"})
    p = simulate(rec, raw, steps=50, calibration=from_async).prediction
    assert p.steps_per_s == pytest.approx(1 / (G + T + c), rel=1e-9)


def test_separate_async_at_threshold_one_is_sync(tmp_path):
    rec, raw = handbuilt(tmp_path, {"generate": G, "update": T})
    over = ["mode=separate_async", "mode_params.max_off_policy_threshold=1", "mode_params.strategy=wait"]
    p = simulate(rec, raw, over, steps=40).prediction
    assert p.steps_per_s == pytest.approx(1 / (G + T), rel=1e-6)
    assert (p.mean_staleness, p.max_staleness, p.dropped_per_step) == (1.0, 1, 0.0)


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_separate_async_overlaps_within_its_staleness_bound(tmp_path, strategy):
    # generation fast enough to regenerate what drop evicts (half again) and still hide behind training
    rec, raw = handbuilt(tmp_path, {"generate": 0.2, "update": T})
    over = ["mode=separate_async", "mode_params.max_off_policy_threshold=2", f"mode_params.strategy={strategy}"]
    p = simulate(rec, raw, over, steps=60).prediction
    assert p.steps_per_s == pytest.approx(1 / T, rel=0.02)  # training bound: generation hides behind it
    assert p.max_staleness == 2 and 1 < p.mean_staleness <= 2
    assert p.max_version_lag <= 1
    assert (p.dropped_per_step > 0) == (strategy == "drop")  # capacity 2 steps: the older half goes stale


def test_two_replicas_split_generation_whose_time_follows_its_tokens(tmp_path):
    """Recorded calls whose time is proportional to their tokens (they vary; the longest response does not): the
    cost is per token, so two replicas, each decoding half the tokens, halve generation."""
    lengths = [[8, 8], [2, 2], [8, 2], [4, 4], [6, 6]]  # four groups a step: the steps' tokens differ, all reach 8
    per_token = 0.8 / 40
    rec, raw = handbuilt(tmp_path, {"generate": lambda tokens, longest: per_token * tokens, "update": 0.1}, steps=8,
                         groups=4, lengths=lengths)
    cal = calibrate(rec)
    assert cal.generate.coef["tokens"] == pytest.approx(per_token)
    assert cal.generate.coef["decode_steps"] == pytest.approx(0, abs=1e-9)
    one = simulate(rec, raw, steps=40, calibration=cal).prediction
    two = simulate(rec, raw, ["resources.rollout_replicas=2"], steps=40, calibration=cal).prediction
    # each replica decodes two of a step's four groups: the bigger half of its tokens (50–60% of them here)
    assert 0.5 <= (two.step_s - 0.1) / (one.step_s - 0.1) <= 0.6
    assert set(two.busy_share) >= {"rollout[0]", "rollout[1]"}


def test_generation_the_recording_never_varied_is_charged_per_decode_step(tmp_path):
    """Every call the same length and tokens: nothing tells a fixed cost per decode iteration from a cost per
    token, and the guess is per iteration (a decode step costs about the same for few requests as for many at
    these batch sizes), said as unidentified: a second replica does not shorten a sync call."""
    rec, raw = handbuilt(tmp_path, {"generate": 0.8, "update": 0.1})
    cal = calibrate(rec)
    assert cal.generate.carrier == "decode_steps" and set(cal.generate.unidentified) == {"decode_steps", "tokens"}
    one = simulate(rec, raw, steps=20, calibration=cal).prediction
    two = simulate(rec, raw, ["resources.rollout_replicas=2"], steps=20, calibration=cal).prediction
    assert one.steps_per_s == pytest.approx(1 / 0.9) and two.steps_per_s == pytest.approx(1 / 0.9)


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_colocate_below_its_structural_threshold_makes_no_progress(tmp_path, strategy):
    rec, raw = handbuilt(tmp_path, {"generate": G, "update": T})
    cal = calibrate(rec)
    over = ["mode=colocate_async", "mode_params.max_off_policy_threshold=1", f"mode_params.strategy={strategy}"]
    with simulating():
        config, plan, _, _ = simulated_config(raw, over)
    p = predict(build_setup(config, plan, cal.workers, cal.overlapped), cal, 20)  # the simulation alone
    assert p.verdict == "no_progress" and p.steps_done < 3
    assert ("evicted as staler" if strategy == "drop" else "could not all be consumed") in p.verdict_reason


def test_a_threshold_that_evicts_every_long_rollout_starves(tmp_path):
    # one group in eight generates 16× longer; generation costs 2 ms per token, 0.18 s per step
    lengths = [[2, 2]] * 7 + [[32, 32]]
    rec, raw = handbuilt(tmp_path, {"generate": lambda tokens, longest: 0.002 * tokens, "update": 0.2},
                         groups=8, lengths=lengths, max_tokens=32)
    over = ["mode=separate_async", "mode_params.max_off_policy_threshold=1", "mode_params.strategy=drop"]
    p = simulate(rec, raw, over, steps=60).prediction
    assert p.verdict == "starves" and "longest rollouts" in p.verdict_reason
    assert p.long_dropped_share > 0.75
    ok = simulate(rec, raw, [*over[:1], "mode_params.max_off_policy_threshold=4"], steps=60).prediction
    assert ok.long_dropped_share < 0.5


def test_a_rollout_bound_async_run_starves_the_trainer(tmp_path):
    rec, raw = handbuilt(tmp_path, {"generate": 1.0, "update": 0.1})
    p = simulate(rec, raw, ["mode=separate_async"], steps=30).prediction
    assert p.verdict == "starves" and p.trainer_wait_share > 0.5
    # the call's second goes per decode step (nothing varied): the buffer keeps two steps' groups in flight and
    # each iteration decodes them all, so about two batches a second
    assert p.steps_per_s == pytest.approx(2.0, rel=0.1)


def test_a_guard_stricter_than_the_buffer_stops_the_run(tmp_path):
    rec, raw = handbuilt(tmp_path, {"generate": G, "update": T})
    over = ["mode=separate_async", "mode_params.max_off_policy_threshold=3"]
    raw["stages"].insert(2, {"kind": "staleness_guard", "impl": "max_staleness", "params": {"max_staleness": 1}})
    p = simulate(rec, raw, over, steps=30).prediction
    assert p.verdict == "no_progress" and "max_staleness=1" in p.verdict_reason


def test_a_simulated_100_step_run_is_fast(tmp_path):
    rec, raw = handbuilt(tmp_path, {"generate": G, "update": T})
    p = simulate(rec, raw, ["mode=separate_async", "resources.rollout_replicas=4"], steps=100).prediction
    assert p.steps_done == 100 and p.wall_s < 1.0


def test_generation_whose_lengths_explain_none_of_its_time_is_still_charged_per_decode_step(tmp_path):
    """Recorded calls that took longer when their responses were shorter (noise beyond the lengths' effect): the
    fit keeps no length term, and the time goes per decode step instead of making the async modes' replica
    iterate for free (it looped without end)."""
    lengths = [[8, 8], [4, 2], [6, 6], [2, 3]]
    rec, raw = handbuilt(tmp_path, {"generate": lambda tokens, longest: 0.4 - 0.01 * longest, "update": T},
                         steps=8, groups=1, lengths=lengths)
    cal = calibrate(rec)
    assert cal.generate.carrier == "decode_steps" and cal.generate.intercept_s == 0
    assert cal.generate.coef["decode_steps"] > 0 and cal.generate.coef["tokens"] == 0
    p = simulate(rec, raw, ["mode=colocate_async"], steps=20, calibration=cal).prediction
    assert p.verdict == "ok" and p.steps_per_s > 0


def test_simulating_sync_from_an_async_recording_drops_the_async_params_and_keeps_given_ones_checked():
    """`-o mode=sync` on a separate_async run: its max_off_policy_threshold, strategy and capacity_steps mean
    nothing to sync and are dropped with a note; a mode param the user gives is still validated."""
    from conftest import quickstart_raw, with_staleness_guard
    from rlpipe.errors import ConfigError

    raw = with_staleness_guard(quickstart_raw(mode="separate_async", mode_params={
        "max_off_policy_threshold": 4, "strategy": "drop", "capacity_steps": 2}))
    config, _, changed, notes = simulated_config(raw, ["mode=sync"])
    assert config.mode == "sync" and changed["mode_params"] == {}
    assert notes == ["dropped the recorded separate_async run's mode_params capacity_steps, max_off_policy_threshold, "
                     "strategy (sync does not take them)"]
    assert simulated_config(raw, ["mode=separate_async", "mode_params.max_off_policy_threshold=2"])[2][
        "mode_params"] == {"max_off_policy_threshold": 2, "strategy": "drop", "capacity_steps": 2}  # same mode: kept
    with pytest.raises(ConfigError, match="max_off_policy_threshold"):
        simulated_config(raw, ["mode=sync", "mode_params.max_off_policy_threshold=2"])
