"""Every YAML in pipelines/ validates (config + plan), with no Ray and no model built."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.planning.plan import build_plan
from rlpipe.errors import ConfigError, RlpipeError

SAMPLE_VERL = Path(__file__).parents[1] / "pipelines/data/gsm8k_sample_verl.parquet"
PIPELINES = sorted((Path(__file__).parents[1] / "pipelines").glob("*.yaml"))


def test_there_are_pipelines():
    assert any(p.name == "quickstart.yaml" for p in PIPELINES)


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_pipeline_validates(path, tmp_path):
    config, text = load_pipeline(path)
    assert text.startswith("# Launch: rlpipe run pipelines/"), "each pipeline opens with its launch command"
    if config.model.path is not None and not Path(config.model.path).is_dir():
        # A GPU pipeline names a model folder this machine lacks: validate says so first, in one
        # line; with a folder of the same shape (config, weight file, tokenizer config) it passes.
        with pytest.raises(ConfigError, match=r"^model\.path .* is not a folder on this machine"):
            build_plan(config)
        (tmp_path / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 32768}')
        (tmp_path / "model.safetensors").write_bytes(b"")
        (tmp_path / "tokenizer_config.json").write_text("{}")
        overrides = [f"model.path={tmp_path}", f"tokenizer.path={tmp_path}"]
        config, _ = load_pipeline(path, overrides)
        data_path = config.data.params.get("path")
        if isinstance(data_path, str) and not Path(data_path).exists():
            # and data the user downloads (GSM8K in verl's layout): named next, then the shipped sample of that
            # layout stands in
            with pytest.raises(RlpipeError, match=r"dataset file .* does not exist.*fix data\.params\.path"):
                build_plan(config)
            config, _ = load_pipeline(path, overrides + [f"data.params.path={SAMPLE_VERL}"])
    plan = build_plan(config)
    assert [n.kind for n in plan.nodes][0] == "generate"


def _flat(value, prefix=""):
    """Dotted keys of a YAML tree (list items by index) with their leaf values."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


# What the CPU twin may change: the model and tokenizer (random-init, built here), the data file (the shipped
# sample in the same layout), batch sizes and lengths, the device and its dtypes, the run's name
TWIN_MAY_DIFFER = ("name", "model.", "tokenizer.", "data.params.path", "data.prompts_per_step",
                   "trainer.total_steps", "trainer.ppo_mini_batch_size", "trainer.micro_batch_size",
                   "trainer.torch_threads", "resources.", "stages.0.params.max_tokens", "stages.0.params.server.")


def test_the_cpu_twin_differs_from_the_gpu_pipeline_only_in_size_and_device():
    import yaml

    root = Path(__file__).parents[1] / "pipelines"
    gpu = _flat(yaml.safe_load((root / "qwen05b_gsm8k_gpu.yaml").read_text()))
    cpu = _flat(yaml.safe_load((root / "qwen05b_gsm8k_cpu.yaml").read_text()))
    differ = sorted(k for k in gpu.keys() | cpu.keys() if gpu.get(k, "<absent>") != cpu.get(k, "<absent>"))
    assert [k for k in differ if not k.startswith(TWIN_MAY_DIFFER) and k not in TWIN_MAY_DIFFER] == []
    assert {"model.path", "resources.device", "stages.0.params.server.dtype"} <= set(differ)  # a real twin, not a copy
    assert gpu["model.dtype"] == "bfloat16" and gpu["resources.device"] == "cuda"
