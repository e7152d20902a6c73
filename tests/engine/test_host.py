"""rlpipe.engine.host: the thread budget each worker process gets, and the allocator setting that keeps
freed memory for reuse (checked by counting the kernel's page faults in a fresh process)."""

import json
import subprocess
import sys
import textwrap

import pytest

from rlpipe.engine import host
from rlpipe.engine.host import MIN_HIDDEN_FOR_THREADS, plan_torch_threads, run_thread_budget
from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.planning.plan import build_plan

WIDE = ["model.architecture.hidden_size=512", "model.architecture.num_heads=8"]


def _config(overrides=()):
    config, _ = load_pipeline("pipelines/quickstart.yaml", list(overrides))
    return config


@pytest.fixture
def eight_cpus(monkeypatch):
    monkeypatch.setattr(host, "cpus_available", lambda: 8)


def test_explicit_number_wins(eight_cpus):
    budget = plan_torch_threads(_config(["trainer.torch_threads=3"]), {"actor", "rollout"}, False, inline=False)
    assert (budget.threads, budget.reason) == (3, "trainer.torch_threads")


def test_small_model_gets_one_thread(eight_cpus):
    budget = plan_torch_threads(_config(), {"actor", "rollout"}, False, inline=True)
    assert budget.threads == 1 and f"hidden size 64 < {MIN_HIDDEN_FOR_THREADS}" in budget.reason


def test_share_of_the_cpus_by_what_computes_at_once(eight_cpus):
    roles = {"actor", "rollout"}
    assert plan_torch_threads(_config(WIDE), roles, False, inline=True).threads == 8  # one process
    # sync on Ray: the trainer and the engine take turns, each may use every CPU
    assert plan_torch_threads(_config(WIDE), roles, False, inline=False).threads == 8
    # two DP ranks compute together
    assert plan_torch_threads(_config(WIDE + ["trainer.dp_size=2"]), roles, False, inline=False).threads == 4
    # generating while training: trainer and rollout replicas share the CPUs
    both = plan_torch_threads(_config(WIDE + ["resources.rollout_replicas=3"]), roles, True, inline=False)
    assert both.threads == 2 and "8 CPUs / 4 worker process(es)" in both.reason
    # colocated trainer and engine are one process
    colocated = _config(WIDE + ['resources.colocate=[["actor", "rollout"]]'])
    assert plan_torch_threads(colocated, roles, True, inline=False).threads == 8


def test_hidden_size_read_from_the_model_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 896}))
    config = _config(["model.architecture=null", f"model.path={tmp_path}"])
    assert host.hidden_size(config) == 896
    (tmp_path / "config.json").write_text("{not json")
    assert host.hidden_size(config) is None


def test_run_thread_budget_names_the_roles():
    config = _config()
    roles, budget = run_thread_budget(config, build_plan(config), inline=False)
    assert {"actor", "rollout"} <= roles and budget.threads == 1


def test_configure_process_sets_torch_threads():
    import torch

    before = torch.get_num_threads()
    try:
        host.configure_process(_config(["trainer.torch_threads=2"]))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        host._configured = None


FAULTS = textwrap.dedent("""
    import resource
    import numpy as np
    from rlpipe.engine.host import keep_freed_memory
    def churn():  # a training step's pattern: activations of several sizes kept until the backward, then freed
        for _ in range(10):
            kept = [np.ones(n << 15) for n in (17, 68, 68, 17, 33, 68, 17)]
            del kept
    def faults():
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        churn()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
    churn(); churn()  # the heap reaches its peak
    default = faults()
    applied = keep_freed_memory()
    churn(); churn()
    print(default, applied, faults())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_stops_the_page_faults():
    # a fresh process: the test process may have applied the setting already (an inline run does)
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True, timeout=120)
    default, applied, kept = out.stdout.split()
    assert applied == "True"
    # the default hands the freed blocks back to the kernel and faults them in again (~20,000 pages here)
    assert int(default) > 1000 and int(kept) < int(default) / 10, (default, kept)
