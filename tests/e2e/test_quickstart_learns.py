"""The quickstart really learns: mean reward rises by ≥ 0.3 from the first to the last fifth.

Run in-process (the same stages; Ray execution is shown to give identical results by
tests/e2e/test_sync_pipeline.py and the engine-overhead benchmark) with tracking off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.runtime import run_pipeline

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_reward_rises(tmp_path):
    config, text = load_pipeline(ROOT / "pipelines/quickstart.yaml",
                                 ["tracking.enabled=false", f"trainer.output_dir={tmp_path}"])
    rewards: list[float] = []
    run_pipeline(config, text, on_step=lambda step, m: rewards.append(m["reward/mean"]), inline=True)
    fifth = len(rewards) // 5
    first, last = np.mean(rewards[:fifth]), np.mean(rewards[-fifth:])
    assert last - first >= 0.3, f"reward/mean first fifth {first:.3f}, last fifth {last:.3f}"
