"""The driver's calls to workers outside a node (engine sleep and wake, checkpoints, a settling push) are bounded
by resources.worker_call_timeout_s: a worker that stops answering fails the run with one line naming it."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from rlpipe.engine.execution.ray_runtime import RayBackend
from rlpipe.engine.execution.worker_calls import WorkerCallTimeout
from rlpipe.engine.planning.config_io import validate_config

from conftest import quickstart_raw

pytestmark = pytest.mark.e2e


def test_a_worker_that_stops_answering_fails_the_call_naming_it_and_the_field(ray_session, tmp_path):
    raw = quickstart_raw(resources={"worker_call_timeout_s": 2}, tracking={"enabled": False},
                         trainer={"output_dir": str(tmp_path)})
    backend = RayBackend.start(validate_config(raw), {"actor"})
    try:
        assert backend.workers.call("actor", "get_version") == [0]  # answers while it runs
        pid = int(re.search(r"pid (\d+)", backend.groups["actor"].where[0]).group(1))
        os.kill(pid, signal.SIGSTOP)  # a hung process: alive, never answering
        try:
            start = time.monotonic()
            with pytest.raises(WorkerCallTimeout) as caught:
                backend.workers.call("actor", "get_version")
            assert 2 <= time.monotonic() - start < 30
        finally:
            os.kill(pid, signal.SIGCONT)
        message = str(caught.value)
        assert f"actor[0] (pid {pid} on" in message and ".get_version" in message
        assert "resources.worker_call_timeout_s=2 s" in message and "-o resources.worker_call_timeout_s=" in message
    finally:
        backend.shutdown()
