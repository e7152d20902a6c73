"""pipelines/quickstart_vllm.yaml in separate_async on Ray, attached to the session's shared vLLM server.

Learning on the one-digit task (vllm_runs.ONE_DIGIT) with `server.urls`, staleness <= 2: mean reward rises by
>= 0.3 from the first to the last fifth; a run whose pushes did not reach the server would stay at the initial
policy's ~0.1. A run that starts and owns its server (sync, and a killed server): test_vllm_owned_server.py.
"""

from __future__ import annotations

import json

import pytest

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.runtime import run_pipeline
from conftest import VLLM_ARCH, VLLM_CHARS
from vllm_runs import ONE_DIGIT, ROOT, learns, skip_without_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


@pytest.fixture(autouse=True)
def needs_vllm():
    skip_without_vllm()


def test_quickstart_vllm_learns_in_separate_async_on_ray_attached(ray_session, vllm_server, tmp_path):
    config, text = load_pipeline(ROOT / "pipelines/quickstart_vllm.yaml", [
        *ONE_DIGIT, f"trainer.output_dir={tmp_path}", "name=e2e-vllm-async", "mode=separate_async",
        "mode_params.max_off_policy_threshold=2", f"tokenizer.chars={json.dumps(VLLM_CHARS)}",
        f"model.architecture={json.dumps({'family': 'qwen2', **VLLM_ARCH})}",
        f"stages.generate.params.server.urls={json.dumps([vllm_server.url])}",
    ])
    rewards: list[float] = []
    staleness: list[float] = []

    def on_step(step, metrics):
        rewards.append(metrics["reward/mean"])
        staleness.append(metrics["staleness_guard/staleness/max"])

    run_pipeline(config, text, on_step=on_step)
    first, last = learns(rewards)
    assert last - first >= 0.3, f"reward/mean first fifth {first:.3f}, last fifth {last:.3f}"
    assert max(staleness) <= 2
    vllm_server.check_alive()  # an attached server is not the run's to stop
