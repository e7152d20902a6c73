"""Helpers of the vLLM pipeline tests (test_vllm_pipeline.py, test_vllm_owned_server.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from rlpipe.inference.contract import EngineError
from rlpipe.inference.vllm_server import VLLMParams, vllm_python

ROOT = Path(__file__).resolve().parents[2]

# Fast learning: one prompt digit, one answer token, a higher learning rate. GRPO lifts the one-digit task
# (`last_digit_successor`) from ~0.1 to ~0.6 in 20 steps (sync and separate_async alike), where the two-digit
# quickstart needs hundreds.
ONE_DIGIT = ["data.params={task: last_digit_successor, num_digits: 1}", "stages.generate.params.max_tokens=1",
             "trainer.optimizer.lr=3e-3", "trainer.total_steps=20", "tracking.enabled=false"]


def skip_without_vllm() -> None:
    """Skip the calling test where vLLM's venv is missing (`make setup` makes it; CI runs `make test`)."""
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


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces): state, ppid, pgrp, ..."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()


def parent_pid(pid: int) -> int:
    """The parent of process ``pid``."""
    return int(_stat_fields(pid)[1])


def group_pids(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = _stat_fields(int(entry))
            except (OSError, ValueError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
    return pids


def learns(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last fifth of the steps."""
    fifth = len(rewards) // 5
    return float(np.mean(rewards[:fifth])), float(np.mean(rewards[-fifth:]))
