"""pipelines/quickstart_vllm.yaml on Ray in sync, on a vLLM server the rollout replica starts and owns.

One run shows two things (one cold server start instead of two):
- it learns the one-digit task (vllm_runs.ONE_DIGIT) in 20 steps: mean reward rises by >= 0.3 from the first to
  the last fifth (a run whose pushes did not reach the server would stay at the initial policy's ~0.1);
- then its server is killed (the API server rlpipe started; its engine core is left orphaned): the run fails
  within 60 s with a message naming vLLM and the server's log, and no vLLM process outlives the failed run
  (rlpipe stops the orphaned engine core).
Learning on the session's shared server in separate_async: test_vllm_pipeline.py. A server's own stop on
close: tests/inference/test_vllm.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlpipe import error_log

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.runtime import run_pipeline
from vllm_runs import ONE_DIGIT, ROOT, group_pids, learns, parent_pid, server_pids, skip_without_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

LEARNING_STEPS = 20


@pytest.fixture(autouse=True)
def needs_vllm():
    skip_without_vllm()


def test_a_run_on_its_own_server_learns_and_fails_naming_the_log_when_the_server_is_killed(ray_session, tmp_path):
    # two steps past the kill: the next step's first chain may already have generated when the kill lands, and
    # then that step's weight push is the first call to find the server gone
    config, text = load_pipeline(ROOT / "pipelines/quickstart_vllm.yaml", [
        *ONE_DIGIT, f"trainer.total_steps={LEARNING_STEPS + 2}", f"trainer.output_dir={tmp_path}",
        "name=e2e-vllm-owned"])
    marker = "rlpipe-e2e-vllm-owned-rollout"
    rewards: list[float] = []
    killed_at: list[float] = []
    server_group: list[int] = []

    def on_step(step, metrics):
        if step < LEARNING_STEPS:
            rewards.append(metrics["reward/mean"])
        if step == LEARNING_STEPS - 1:
            pids = set(server_pids(marker))
            api_servers = [pid for pid in pids if parent_pid(pid) not in pids]
            assert len(api_servers) == 1, f"vLLM processes of the run: {sorted(pids)}"
            server_group.append(api_servers[0])  # rlpipe starts the server in a session of its own: its group id
            family = group_pids(api_servers[0])
            assert len(family) >= 2, f"the server's processes: {family}"  # API server + engine core
            os.kill(api_servers[0], signal.SIGKILL)
            killed_at.append(time.monotonic())

    with pytest.raises(Exception) as failure:
        run_pipeline(config, text, on_step=on_step)
    first, last = learns(rewards)
    assert len(rewards) == LEARNING_STEPS and last - first >= 0.3, \
        f"{len(rewards)} steps, reward/mean first fifth {first:.3f}, last fifth {last:.3f}"
    assert killed_at and time.monotonic() - killed_at[0] < 60
    message = str(failure.value)
    assert "vllm" in message and ".log" in message, message
    # the run's one line (what `rlpipe run` prints) names the cause, not Ray's wrapper
    line = error_log.one_line(failure.value)
    assert "the vLLM server" in line and "exited with code -9" in line and ".log" in line, line
    deadline = time.monotonic() + 20
    while group_pids(server_group[0]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_pids(server_group[0]), f"vLLM processes outlived the failed run: {group_pids(server_group[0])}"
