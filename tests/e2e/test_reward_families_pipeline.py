"""pipelines/reward_families.yaml (rule + discriminative RM + judge, weighted) runs 3 steps on Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.runtime import run_pipeline

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_reward_families_pipeline_runs_on_ray(ray_session, tmp_path):
    config, text = load_pipeline(ROOT / "pipelines/reward_families.yaml", [
        "trainer.total_steps=3", f"trainer.output_dir={tmp_path}", "tracking.enabled=false",
    ])
    seen = []
    run_pipeline(config, text, on_step=lambda step, m: seen.append(m))
    assert len(seen) == 3
    for m in seen:  # every family reported its own metric; the weighted sum is the headline
        assert {"reward/rule/mean", "reward/reward_model/mean", "reward/judge/mean"} <= set(m)
        assert 0.0 <= m["reward/rule/mean"] <= 1.0 and 0.0 <= m["reward/judge/mean"] <= 1.0
        assert m["reward/infra_failures"] < 32  # not every trajectory failed
