"""pipelines/quickstart_lora.yaml end to end, in process: it learns as well as full fine-tuning (same seeds, a stated
margin), a resumed LoRA run equals the uninterrupted one, and `rlpipe validate` refuses a bad trainer.lora in one
line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import Recorder, lora_quickstart_raw
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

STEPS = 30
MARGIN = 0.1
"""LoRA's mean reward over the last third may trail full fine-tuning's by at most this (reward is 0..1)."""


def lora_raw(tmp_path: Path, full_fine_tuning: bool = False, **trainer) -> dict:
    raw = lora_quickstart_raw(tmp_path, full_fine_tuning, **trainer)
    raw["tracking"]["sample_trajectories"] = 100000  # the recorder sees every row
    return raw


def test_lora_learns_as_well_as_full_fine_tuning_on_the_same_seeds(tmp_path):
    """Both runs: the LoRA quickstart's seeds, data and sampling temperature, 30 steps. Full fine-tuning drops
    trainer.lora and takes the quickstart's lr (3e-3; at LoRA's 5e-3 it learns less)."""
    curves = {}
    for name in ("lora", "full"):
        raw = lora_raw(tmp_path / name, name == "full", total_steps=STEPS)
        rewards, pushed = [], []

        def on_step(step, metrics, rewards=rewards, pushed=pushed):
            rewards.append(metrics["reward/mean"])
            pushed.append((metrics["weight_sync/bytes"], metrics.get("weight_sync/full_model_bytes")))

        run_pipeline(validate_config(raw), "", on_step=on_step, inline=True)
        curves[name] = np.array(rewards)
        if name == "lora":  # every push carried the adapters only: 17,408 float32 parameters of a 100,992 model
            assert set(pushed) == {(17408 * 4, 100992 * 4 - 17408 * 4)}
    third = STEPS // 3
    lora_start, lora_end = curves["lora"][:third].mean(), curves["lora"][-third:].mean()
    full_end = curves["full"][-third:].mean()
    print(f"LoRA {lora_start:.3f} -> {lora_end:.3f}, full fine-tuning -> {full_end:.3f}")
    assert lora_end - lora_start >= 0.15, f"LoRA did not learn: {lora_start:.3f} -> {lora_end:.3f}"
    assert lora_end >= full_end - MARGIN, f"LoRA {lora_end:.3f} trails full fine-tuning {full_end:.3f}"


def _final(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path / "final", local_files_only=True).state_dict()


def test_a_resumed_lora_run_equals_the_uninterrupted_run(tmp_path):
    first = Recorder()
    uninterrupted = run_pipeline(validate_config(lora_raw(tmp_path / "a", total_steps=4, checkpoint_every=2)), "",
                                 observer=first, inline=True)
    checkpoint = Path(uninterrupted.output_dir) / "checkpoints" / "step_2"
    resumed = Recorder()
    resumed_result = run_pipeline(validate_config(lora_raw(tmp_path / "b", total_steps=4)), "", observer=resumed,
                                  inline=True, resume_from=str(checkpoint))
    assert sorted(resumed.batches) == [2, 3]
    for step in (2, 3):
        for column in ("uid", "response_ids", "reward", "advantages", "old_logprobs", "token_versions"):
            assert resumed.batches[step].column(column).equals(first.batches[step].column(column)), (step, column)
        assert resumed.metrics[step]["policy_version"] == first.metrics[step]["policy_version"] == step + 1
    expected, got = _final(Path(uninterrupted.output_dir)), _final(Path(resumed_result.output_dir))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("change,message", [
    ({"trainer": {"lora": {"target_modules": ["q_proj", "qkv"]}}},
     r"^trainer\.lora\.target_modules: 'qkv' is not a linear module of Qwen2ForCausalLM \(its linear modules, LM head "
     r"aside: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj\); use those names$"),
    ({"trainer": {"lora": {}, "backend": "megatron"}, "resources": {"device": "cuda"}},
     r"^trainer\.lora is not implemented for trainer\.backend megatron"),
])
def test_validate_refuses_a_bad_lora_config_naming_the_field(tmp_path, change, message):
    raw = lora_raw(tmp_path)
    for section, values in change.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=message):
        build_plan(validate_config(raw))


def test_validate_refuses_lora_with_sglang(tmp_path):
    raw = lora_raw(tmp_path)
    raw["stages"][0]["impl"] = "sglang"  # vLLM takes adapter pushes: tests/inference/test_vllm_lora.py
    with pytest.raises(ConfigError, match=r"trainer\.lora: stages\[generate\] impl sglang cannot take adapter pushes"):
        build_plan(validate_config(raw))


def test_the_cli_says_it_in_one_line_and_exits_two(capsys):
    from rlpipe.cli import main

    assert main(["validate", str(ROOT / "pipelines/quickstart_lora.yaml"), "-o",
                 "trainer.lora.target_modules=[q_proj, qkv]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: trainer.lora.target_modules: 'qkv' is not a linear module") and "\n" not in err
