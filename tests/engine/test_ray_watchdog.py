"""A driver killed without shutting Ray down (kill -9) leaves no process of its local Ray running: the watchdog
init_ray starts ends them (rlpipe.engine.execution.ray_watchdog). Without it, Ray's dashboard and runtime-env
agents ran on for minutes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

DRIVER = """
import os, sys, time
from rlpipe.engine.execution.ray_runtime import init_ray
init_ray(None, 1)
import ray
print("worker", ray.get(ray.remote(lambda: os.getpid()).remote()), flush=True)
print("ready", flush=True)
time.sleep(300)
"""


def test_a_killed_driver_leaves_no_ray_process_behind():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and driver.stdout.readline().strip() != "ready":
            assert driver.poll() is None, "the driver ended before Ray was up"
        left = psutil.Process(driver.pid).children(recursive=True)  # gcs, raylet, agents, the worker, the watchdog
        names = {p.name() for p in left}
        assert len(left) >= 3 and any("raylet" in n for n in names), names
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
    _, alive = psutil.wait_procs(left, timeout=30)
    assert not alive, f"outlived the killed driver by 30 s: {[(p.pid, p.name()) for p in alive]}"
