"""Every YAML in pipelines/ validates (config + plan), with no Ray and no model built."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.planning.plan import build_plan
from rlpipe.errors import ConfigError

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
        config, _ = load_pipeline(path, [f"model.path={tmp_path}", f"tokenizer.path={tmp_path}"])
    plan = build_plan(config)
    assert [n.kind for n in plan.nodes][0] == "generate"
