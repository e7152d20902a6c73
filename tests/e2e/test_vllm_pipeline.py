"""pipelines/quickstart_vllm.yaml end to end: every token from a real vLLM server.

- Learning, on the one-digit task (`last_digit_successor`, one answer token; GRPO lifts it from
  ~0.1 to ~0.9 in 30 steps, where the two-digit quickstart needs hundreds): in sync with a server
  the run starts and owns (and stops at the end: no vLLM process outlives the run), and in
  separate_async on Ray attached to the session's shared server (`server.urls`; staleness ≤ 2).
  Mean reward rises by ≥ 0.3 from the first to the last fifth; a run whose pushes did not reach
  the server would stay at the initial policy's ~0.1.
- killing the server mid-run fails the run within 60 s with a message naming the replica and
  the server's log, and leaves no vLLM process behind.
Skipped only where vLLM's venv is missing (`make setup` makes it; CI runs `make test`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.runtime import run_pipeline
from rlpipe.inference.contract import EngineError
from rlpipe.inference.vllm_server import VLLMParams, vllm_python
from conftest import VLLM_ARCH, VLLM_CHARS

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def needs_vllm():
    try:
        vllm_python(VLLMParams())
    except EngineError as exc:
        pytest.skip(str(exc))


def server_pids(marker: str) -> list[int]:
    """Processes whose command line mentions ``marker`` (the run's workdir names its servers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and "vllm" in cmdline:
                pids.append(int(entry))
    return pids


def learns(rewards: list[float]) -> tuple[float, float]:
    fifth = len(rewards) // 5
    return float(np.mean(rewards[:fifth])), float(np.mean(rewards[-fifth:]))


# Fast learning: one prompt digit, one answer token, a higher learning rate (see the module docstring).
ONE_DIGIT = ["data.params={task: last_digit_successor, num_digits: 1}", "stages.generate.params.max_tokens=1",
             "trainer.optimizer.lr=3e-3", "trainer.total_steps=30", "tracking.enabled=false"]


def test_quickstart_vllm_learns_in_sync_on_a_server_it_owns(tmp_path):
    config, text = load_pipeline(ROOT / "pipelines/quickstart_vllm.yaml",
                                 [*ONE_DIGIT, f"trainer.output_dir={tmp_path}", "name=e2e-vllm-sync"])
    rewards: list[float] = []
    run_pipeline(config, text, on_step=lambda step, m: rewards.append(m["reward/mean"]), inline=True)
    first, last = learns(rewards)
    assert last - first >= 0.3, f"reward/mean first fifth {first:.3f}, last fifth {last:.3f}"
    assert not server_pids("rlpipe-e2e-vllm-sync-rollout"), "a vLLM server outlived its run"


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


def test_a_killed_server_fails_the_run_naming_replica_and_log_and_nothing_is_left(ray_session, tmp_path):
    config, text = load_pipeline(ROOT / "pipelines/quickstart_vllm.yaml", [
        "tracking.enabled=false", f"trainer.output_dir={tmp_path}", "name=e2e-vllm-kill", "trainer.total_steps=200",
    ])
    marker = "rlpipe-e2e-vllm-kill-rollout"
    killed_at: list[float] = []

    def on_step(step, metrics):
        if step == 2:
            pids = server_pids(marker)
            assert pids, "no vLLM server found for the run"
            for pid in pids:  # the API server and the engine core it spawned
                os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    with pytest.raises(Exception) as failure:
        run_pipeline(config, text, on_step=on_step)
    assert killed_at and time.monotonic() - killed_at[0] < 60
    message = str(failure.value)
    assert "generate" in message and "vllm" in message and ".log" in message, message
    deadline = time.monotonic() + 20
    while server_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not server_pids(marker), "a vLLM process outlived its failed run"
