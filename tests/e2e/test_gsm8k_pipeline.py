"""The realistic GSM8K pipeline runs a few steps on Ray with a tiny model substituted by overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.runtime import run_pipeline

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

TINY_MODEL = [
    "model.path=null",
    "model.architecture={hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, max_position_embeddings: 512}",
    "tokenizer.path=null",
    "tokenizer.byte_level=true",
    "data.apply_chat_template=false",  # the byte-level test tokenizer has no chat template
]


def test_gsm8k_pipeline_runs_with_a_tiny_model(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the data path in the YAML is relative to the repository root
    config, text = load_pipeline(ROOT / "pipelines/gsm8k_grpo.yaml", TINY_MODEL + [
        "trainer.total_steps=2", "data.prompts_per_step=4", "trainer.ppo_mini_batch_size=2",
        "stages.generate.params.max_tokens=12", "stages.generate.params.n=4",
        f"trainer.output_dir={tmp_path}", "tracking.enabled=false",
    ])
    seen = []
    result = run_pipeline(config, text, on_step=lambda step, m: seen.append(m))
    assert len(seen) == 2
    # an untrained byte-level model answers nonsense: the math verifier scores it 0, not an error
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in seen)
    assert seen[-1]["actor/local_updates"] == 4.0  # 2 steps × (4 prompts / mini-batch 2)
    assert "actor/kl_loss" in seen[-1]
    assert (Path(result.output_dir) / "final" / "config.json").is_file()
