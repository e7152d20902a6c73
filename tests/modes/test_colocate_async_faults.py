"""colocate_async's wait for a batch has a bound: an engine (or environment) that sends no finished group for
mode_params.stall_timeout_s fails the run with one error saying so, instead of waiting forever."""

from __future__ import annotations

import time

import pytest

from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.modes.async_common import RolloutStalled

from conftest import Recorder, quickstart_raw, with_staleness_guard


def test_no_finished_group_for_the_stall_timeout_fails_the_run_naming_the_field(tmp_path):
    raw = quickstart_raw(mode="colocate_async", data={"prompts_per_step": 2}, tracking={"enabled": False},
                         mode_params={"stall_timeout_s": 0.5}, trainer={"total_steps": 2, "output_dir": str(tmp_path)})
    stages = []
    for stage in raw["stages"]:
        if stage["kind"] == "generate":  # every trajectory waits >= 3 s on its environment before its first token
            stage["params"] = {**stage["params"], "n": 2, "env_latency_s": 3.0, "env_latency_max_s": 3.5}
        stages.append(stage)
    raw["stages"] = stages
    with_staleness_guard(raw)
    observer = Recorder()
    start = time.monotonic()
    with pytest.raises(RolloutStalled) as caught:
        run_pipeline(validate_config(raw), "", observer=observer, inline=True)
    assert time.monotonic() - start < 60
    message = str(caught.value)
    assert "colocate_async: no finished group came from the rollout engine for" in message
    assert "while step 0 waits for 2 groups" in message and "mode_params.stall_timeout_s" in message
    assert observer.status == "FAILED"
