"""pipelines/quickstart_lora.yaml on Ray. In separate_async the adapters travel between actors (deferred pushes through
the object store) and LoRA learns as well as full fine-tuning does in the same mode (run in process), on the same
seeds, within a stated margin. In sync on Ray the run computes exactly what the in-process one computes (which
tests/engine/test_lora_pipeline.py compares with full fine-tuning)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import lora_quickstart_raw, with_staleness_guard
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline

pytestmark = pytest.mark.e2e

STEPS = 40
MARGIN = 0.2
"""LoRA's mean reward over the last third may trail full fine-tuning's by at most this in separate_async (reward is
0..1; in sync, in process, the margin is 0.1)."""


def _raw(tmp_path: Path, lora: bool) -> dict:
    raw = lora_quickstart_raw(tmp_path, full_fine_tuning=not lora, total_steps=STEPS)
    raw["mode"] = "separate_async"
    raw["mode_params"] = {"max_off_policy_threshold": 2, "strategy": "drop", "capacity_steps": 2}
    return with_staleness_guard(raw)


def test_lora_learns_in_separate_async_on_ray_as_well_as_full_fine_tuning(ray_session, tmp_path):
    curves, pushed = {}, []
    for name in ("lora", "full"):
        rewards: list[float] = []

        def on_step(step, metrics, rewards=rewards, name=name):
            rewards.append(metrics["reward/mean"])
            if name == "lora":
                pushed.append((metrics.get("weight_sync/deferred_bytes"),
                               metrics.get("weight_sync/deferred_full_model_bytes")))

        # the comparison runs the same mode on the same seeds in one process: it needs no second set of actors, and
        # there its curve is the same every run (0.175 -> 0.361 in 3 runs; on Ray it ended at 0.36-0.41)
        run_pipeline(validate_config(_raw(tmp_path / name, name == "lora")), "", on_step=on_step, inline=name == "full")
        curves[name] = np.array(rewards)
    third = STEPS // 3
    start, end = curves["lora"][:third].mean(), curves["lora"][-third:].mean()
    full_end = curves["full"][-third:].mean()
    print(f"separate_async: LoRA on Ray {start:.3f} -> {end:.3f}, full fine-tuning in process -> {full_end:.3f}")
    # one step off-policy learns slower than sync (in 30 steps LoRA 0.12 -> 0.23 here, 0.15 -> 0.38 in sync); full
    # fine-tuning, which also moves the embeddings and the head LoRA leaves frozen, got 0.08-0.13 further in 40 steps
    # over 4 runs on Ray (its end varied 0.36-0.41 there with the async timing, LoRA's 0.27-0.32): a wider margin
    assert end - start >= 0.1, f"LoRA did not learn: {start:.3f} -> {end:.3f}"
    assert end >= full_end - MARGIN, f"LoRA {end:.3f} trails full fine-tuning {full_end:.3f}"
    # the deferred pushes carried the adapters only (17,408 float32 parameters of the 100,992), reported once settled
    assert {p for p in pushed if p != (None, None)} == {(17408 * 4, 100992 * 4 - 17408 * 4)}, set(pushed)


def test_lora_in_sync_on_ray_learns_exactly_as_in_process(ray_session, tmp_path):
    """Sync on Ray computes what the in-process run computes, adapter pushes between actors included: the same
    rewards step for step (12 steps; from the same seeds the in-process run learns 0.15 -> 0.38 in 30, as
    tests/engine/test_lora_pipeline.py compares with full fine-tuning)."""
    curves = {}
    for where in ("in process", "on Ray"):
        raw = lora_quickstart_raw(tmp_path / where.replace(" ", "_"), total_steps=12)
        rewards: list[float] = []
        run_pipeline(validate_config(raw), "", inline=where == "in process",
                     on_step=lambda step, metrics, r=rewards: r.append(metrics["reward/mean"]))
        curves[where] = rewards
    # a push that did not reach the engine on Ray would make the rewards part from the in-process ones at step 1
    assert len(curves["on Ray"]) == 12 and curves["on Ray"] == curves["in process"]
