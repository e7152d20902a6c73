"""resources.gpus_per_worker on Ray: every worker of a role that holds a model asks Ray for that many GPUs.

Runs in a subprocess with its own Ray that declares 2 GPUs (Ray schedules declared GPUs like real ones and
sets each worker's CUDA_VISIBLE_DEVICES), apart from the suite's GPU-less Ray. The reference worker (which
builds its model on the CPU here) is started through RayBackend.start as a run starts it: with the default
(0) it reserves nothing (colocated roles share the node's GPUs), with 1 it holds one of Ray's GPUs; a
sharded group's placement group then reserves one GPU per rank.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = textwrap.dedent("""
    import json, sys
    import ray
    sys.path.insert(0, sys.argv[1])
    from conftest import quickstart_raw
    from rlpipe.engine.execution.ray_runtime import RayBackend
    from rlpipe.engine.execution.worker_group import WorkerGroup
    from rlpipe.engine.planning.config_io import validate_config

    ray.init(address="local", num_cpus=2, num_gpus=3, include_dashboard=False)  # a Ray of its own, even if another test's runs
    raw = quickstart_raw(resources={"device": "cuda"}, tracking={"enabled": False})
    shared = RayBackend.start(validate_config(raw), {"ref"})  # gpus_per_worker 0: nothing reserved
    gpus = [ray.available_resources().get("GPU", 0.0)]
    shared.shutdown()
    raw["resources"]["gpus_per_worker"] = 1
    backend = RayBackend.start(validate_config(raw), {"ref"})
    answered = backend.workers.call("ref", "__getattribute__", "rank")  # the worker runs: it got its GPU
    gpus.append(ray.available_resources().get("GPU", 0.0))
    group = WorkerGroup.__new__(WorkerGroup)
    group._pack(2, None, gpus=1)  # a sharded role's 2 ranks on one node
    bundles = ray.util.placement_group_table(group.placement_group)["bundles"]
    gpus.append(ray.available_resources().get("GPU", 0.0))
    print(json.dumps({"gpus_free": gpus, "answered": answered, "bundles": list(bundles.values())}))
    backend.shutdown()
    ray.shutdown()
""")


def test_model_workers_ask_ray_for_a_gpu_when_the_device_is_cuda(tmp_path):
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tests_dir], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["answered"] == [0]
    assert report["gpus_free"] == [3.0, 2.0, 0.0], report  # the reference worker holds one, the 2 ranks two
    assert [b.get("GPU") for b in report["bundles"]] == [1.0, 1.0], report
