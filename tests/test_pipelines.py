"""Every YAML in pipelines/ validates (config + plan), with no Ray and no model built."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.planning.plan import build_plan

PIPELINES = sorted((Path(__file__).parents[1] / "pipelines").glob("*.yaml"))


def test_there_are_pipelines():
    assert any(p.name == "quickstart.yaml" for p in PIPELINES)


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_pipeline_validates(path):
    config, text = load_pipeline(path)
    assert text.startswith("# Launch: rlpipe run pipelines/"), "each pipeline opens with its launch command"
    plan = build_plan(config)
    assert [n.kind for n in plan.nodes][0] == "generate"
