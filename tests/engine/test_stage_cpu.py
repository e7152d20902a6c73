"""A chained stage's record carries its thread's clocks (rlpipe.engine.stage_call.run_chain,
rlpipe.engine.thread_clock): CPU seconds and the seconds it waited for a core, with which ``rlpipe simulate``
takes a node's own cost out of a run whose cores were shared. Checked on stages this module registers: one that
computes a known amount of CPU time, one that sleeps, with and without a deadline (a deadline runs the stage on
another thread); and a thread pinned to one core beside a process spinning on it waits for it about half the time
(Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

from rlpipe.engine.stage_call import ChainedStage, run_chain
from rlpipe.engine.thread_clock import ThreadClock, run_queue_wait_s
from rlpipe.stage import StageContext, StageResult, stage
from rlpipe.stage_kinds import stage_kind

SPIN_CPU_S = 0.05
WAIT_S = 0.1

stage_kind("cpu_test_spin", doc="Test kind: computes SPIN_CPU_S seconds of its thread's CPU time.")
stage_kind("cpu_test_wait", doc="Test kind: sleeps WAIT_S seconds.")


@stage("cpu_test_spin", "x", reads={}, writes={})
def _spin(batch, params, ctx):
    began = time.thread_time()
    while time.thread_time() - began < SPIN_CPU_S:
        sum(range(1000))
    return StageResult()


@stage("cpu_test_wait", "x", reads={}, writes={})
def _wait(batch, params, ctx):
    time.sleep(WAIT_S)
    return StageResult()


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_a_chain_step_says_how_much_cpu_its_stage_thread_used(timeout_s):
    stages = [ChainedStage(kind, "x", {}, {}, timeout_s) for kind in ("cpu_test_spin", "cpu_test_wait")]
    ctxs = [StageContext(step=0, seed=0, policy_version=0) for _ in stages]
    steps, _ = run_chain(stages, pa.table({"x": [1]}), ctxs, "this test")
    spin, wait = steps
    assert SPIN_CPU_S <= spin.cpu_s <= spin.duration_s + 1e-3
    assert wait.duration_s >= WAIT_S and wait.cpu_s < 0.5 * WAIT_S  # a wait is wall time, not CPU


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the run-queue wait is Linux's schedstat")


@linux
def test_a_thread_sharing_its_core_with_another_process_is_told_how_long_it_waited_for_it():
    assert run_queue_wait_s() is not None
    core = sorted(os.sched_getaffinity(0))[0]
    rival = subprocess.Popen([sys.executable, "-c", f"import os, time; os.sched_setaffinity(0, {{{core}}}); "
                              "t = time.time()\nwhile time.time() - t < 5: pass"])
    clocks: list = []

    def spin() -> None:  # pinned beside the rival (a thread's own affinity: the test process keeps its cores)
        os.sched_setaffinity(0, {core})
        time.sleep(0.2)  # the rival is running by now
        began, start = ThreadClock.now(), time.perf_counter()
        while time.thread_time() - began.cpu_s < 0.1:
            sum(range(1000))
        clocks.extend((*began.since(), time.perf_counter() - start))

    try:
        thread = threading.Thread(target=spin)
        thread.start()
        thread.join()
    finally:
        rival.kill()
        rival.wait()
    cpu, waited, wall = clocks
    assert cpu >= 0.1 and waited >= 0.05  # the rival held the core about half of this thread's time
    assert cpu + waited <= wall + 0.01  # computing and waiting for the core are both wall time
