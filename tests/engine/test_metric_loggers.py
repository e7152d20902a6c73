"""tracking.loggers: the step metrics reach TensorBoard event files and an offline W&B run, read back here with
each tool's own reader; a bad logger name or a missing package stops validate; a logger that breaks mid-run
is switched off and the run finishes."""

from __future__ import annotations

import json
import logging
import math
import struct
import time
import zlib

import pytest

from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import run_pipeline
from rlpipe.engine.tracking.metric_loggers import METRIC_LOGGERS, MetricLoggerSpec
from rlpipe.errors import ConfigError, RegistryError

from conftest import Recorder, quickstart_raw

STEPS = 3


def raw_config(tmp_path, loggers):
    return quickstart_raw(name="loggers", trainer={"total_steps": STEPS, "output_dir": str(tmp_path / "out")},
                          tracking={"enabled": False, "loggers": loggers})


def tensorboard_scalars(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_records(path) -> list[bytes]:
    """The records of a W&B transaction log (.wandb): a 7-byte header (":W&B", magic, version), then LevelDB's
    log format, 32 KiB blocks of chunks (crc32 of type + data, length, type: full / first / middle / last).
    W&B 0.31 has no Python reader of its own (its Go core writes the file), so the test decodes it."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: a corrupt chunk at byte {pos}"
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def wandb_history(run_root) -> list[dict]:
    """The history rows of the offline W&B run under ``run_root``."""
    from wandb.proto import wandb_internal_pb2

    [path] = list(run_root.glob("wandb/offline-run-*/run-*.wandb"))
    rows = []
    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_step_metrics_reach_tensorboard_and_an_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: nothing may reach the network
    recorder = Recorder()
    result = run_pipeline(validate_config(raw_config(tmp_path, ["tensorboard", "wandb"])), "", observer=recorder,
                          inline=True)
    assert recorder.status == "FINISHED"
    run_root = tmp_path / "out" / "loggers-recorded"  # <output_dir>/<name>-<run id[:8]>
    assert str(run_root) == result.output_dir

    scalars = tensorboard_scalars(run_root / "tensorboard")
    # W&B's own service process writes the offline file; on a loaded machine its last records may land after
    # finish() returned (seen once: an empty history at load ~9): wait for them, with a bound
    deadline = time.monotonic() + 30
    while len(history := wandb_history(run_root)) < STEPS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [row["_step"] for row in history] == list(range(STEPS))
    for key in ("reward/mean", "actor/pg_loss", "timing/update_s"):
        expected = {step: recorder.metrics[step][key] for step in range(STEPS)}
        assert scalars[key] == pytest.approx(expected, rel=1e-6), key  # TensorBoard stores float32
        assert {row["_step"]: row[key] for row in history} == pytest.approx(expected, rel=1e-12), key
    finite = {k for k, v in recorder.metrics[0].items() if math.isfinite(v)}
    assert finite <= set(scalars) and finite <= set(history[0])


MISSING_PACKAGE = MetricLoggerSpec(lambda *args: None, "rlpipe_no_such_package", "pip install x")


def test_validate_refuses_an_unknown_logger_or_one_whose_package_is_missing(tmp_path):
    with pytest.raises(RegistryError, match="did you mean 'tensorboard'"):
        build_plan(validate_config(raw_config(tmp_path, ["tensorbord"])))
    METRIC_LOGGERS.add("test_missing_pkg", MISSING_PACKAGE)
    with pytest.raises(ConfigError, match=r"tracking.loggers: 'test_missing_pkg' needs the rlpipe_no_such_package "
                                          r"package.*pip install x"):
        build_plan(validate_config(raw_config(tmp_path, ["test_missing_pkg"])))


class _BreaksAtStep1:
    def __init__(self, config, run_id, run_dir):
        self.steps = []

    def log(self, step, metrics):
        if step == 1:
            raise OSError("disk full (test)")
        self.steps.append(step)

    def close(self, status):
        pass


BREAKS = MetricLoggerSpec(_BreaksAtStep1, "logging", "-")


def test_a_logger_that_breaks_mid_run_is_switched_off_and_the_run_finishes(tmp_path, caplog):
    METRIC_LOGGERS.add("test_breaks", BREAKS)
    recorder = Recorder()
    with caplog.at_level(logging.WARNING, logger="rlpipe.engine.tracking.metric_loggers"):
        run_pipeline(validate_config(raw_config(tmp_path, ["test_breaks", "tensorboard"])), "", observer=recorder,
                     inline=True)
    assert recorder.status == "FINISHED" and sorted(recorder.metrics) == list(range(STEPS))
    warnings = [r.getMessage() for r in caplog.records if "test_breaks" in r.getMessage()]
    assert warnings == ["tracking.loggers: test_breaks failed at step 1 (OSError: disk full (test)); "
                        "it is off for the rest of the run"]
    scalars = tensorboard_scalars(tmp_path / "out" / "loggers-recorded" / "tensorboard")
    assert sorted(scalars["reward/mean"]) == list(range(STEPS))  # the other logger kept every step
