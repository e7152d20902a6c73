"""pipelines/qwen05b_gsm8k_cpu.yaml, the CPU twin of the Qwen2.5-0.5B GSM8K GPU pipeline, runs two steps on Ray
with its own vLLM server (CPU build): the verl-format parquet's chat prompts reach the model rendered in ChatML,
each row's reward_model.ground_truth reaches the gsm8k scorer, and TensorBoard gets the step metrics. That the
twin differs from the GPU pipeline only in size and device: tests/test_pipelines.py."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.runtime import run_pipeline
from vllm_runs import ROOT, skip_without_vllm

from conftest import Recorder

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


def test_the_cpu_twin_runs_the_gpu_pipelines_path_on_ray_with_vllm(ray_session, tmp_path, monkeypatch):
    skip_without_vllm()
    monkeypatch.chdir(ROOT)  # the data path in the YAML is relative to the repository root
    config, text = load_pipeline(ROOT / "pipelines/qwen05b_gsm8k_cpu.yaml", [
        "trainer.total_steps=2", f"trainer.output_dir={tmp_path}", "tracking.enabled=false",
        "tracking.sample_trajectories=20"])  # every trajectory of a step reaches the observer
    recorder = Recorder()
    result = run_pipeline(config, text, observer=recorder)
    assert recorder.status == "FINISHED" and sorted(recorder.metrics) == [0, 1]

    tok = build_tokenizer(config.tokenizer)
    truths = {row["prompt"][0]["content"]: row["reward_model"]["ground_truth"]
              for row in pq.read_table(ROOT / "pipelines/data/gsm8k_sample_verl.parquet").to_pylist()}
    for step, batch in recorder.batches.items():
        assert batch.num_rows == 4 * 5
        for row in batch.select(["prompt_ids", "ground_truth", "data_source"]).to_pylist():
            prompt = tok.decode(row["prompt_ids"])
            assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
            question = prompt.removeprefix("<|im_start|>user\n").removesuffix("<|im_end|>\n<|im_start|>assistant\n")
            assert truths[question] == row["ground_truth"] and row["data_source"] == "openai/gsm8k"
        m = recorder.metrics[step]
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["actor/local_updates"] == step + 1  # one mini-batch a step, counted over the run

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(ROOT / result.output_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [0, 1]
