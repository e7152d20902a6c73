"""resources.placement on a multi-node Ray cluster: roles land on the nodes the YAML names.

tests/e2e/multinode_run.py starts a 3-node ray.cluster_utils.Cluster in a subprocess (the
suite's shared local Ray is never touched), runs 2 sync steps of the quickstart with
`placement: {actor: node_a, rollout: node_b}` and 2 FSDP2-sharded DP trainer ranks (a STRICT_PACK
placement group, gloo rendezvous on node_a's address), then 2 separate_async steps (rollout pool on
node_b, trainer on node_a, weight pushes by broadcast across the nodes), and reports the lineage records.

No shared filesystem is assumed (resources.shared_filesystem defaults to false on several nodes): the sync run's
model folder is renamed away while the workers are built, every Ray worker process logs its file events under the
model folder, the node cache and the output folders (an audit hook). Resuming from a checkpoint that came to the
driver through the object store: tests/engine/test_checkpoint.py (one-node Ray, resources.shared_filesystem: false).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def multinode(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("multinode")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    script = Path(__file__).with_name("multinode_run.py")
    proc = subprocess.run([sys.executable, str(script), str(workdir)], capture_output=True, text=True, timeout=600,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


def test_the_run_finishes(multinode):
    assert multinode["status"] == "FINISHED", multinode
    assert multinode["final_model"]
    assert {r["step"] for r in multinode["records"]} == {0, 1}


def test_roles_run_on_the_nodes_the_yaml_names(multinode):
    by_kind = {r["kind"]: r["worker"] for r in multinode["records"]}
    assert by_kind["update"] == f"actor×2@{multinode['node_a']}"
    assert by_kind["old_log_prob"] == f"actor×2@{multinode['node_a']}"
    assert by_kind["generate"] == f"rollout×1@{multinode['node_b']}"


def test_lineage_records_where_every_execution_ran(multinode):
    for record in multinode["records"]:
        assert record["worker"] in ("task", "driver") or "@" in record["worker"], record


def test_a_separate_async_run_with_broadcast_pushes_finishes_across_nodes(multinode):
    run = multinode["async"]
    assert run["status"] == "FINISHED", run
    by_kind = {r["kind"]: r["worker"] for r in run["records"]}
    assert by_kind["update"] == f"actor×1@{multinode['node_a']}"
    assert by_kind["generate"].endswith(f"@{multinode['node_b']}"), by_kind
    versions = [m["weight_sync/version"] for _, m in sorted(run["metrics"].items(), key=lambda kv: int(kv[0]))]
    assert versions == sorted(versions) and versions[-1] >= 1.0, run["metrics"]


def test_workers_load_the_model_from_their_node_cache_not_the_drivers_folder(multinode):
    assert any(p.startswith("building workers") for p in multinode["phases"]), multinode["phases"]
    assert any(p.startswith("packing the model folders") for p in multinode["phases"]), multinode["phases"]
    # one verified copy (the cluster's nodes share this machine's disk, so one cache): the same files, same sha256
    assert multinode["cache_trees"] == [multinode["packed_tree"]]
    audit = multinode["audit"]
    model_reads = [e for e in audit if e["event"] == "open" and e["path"].endswith("/config.json")]
    assert any(e["path"].startswith(multinode["cache_dir"] + "/") for e in model_reads), audit  # the hook is live
    assert not [e for e in audit if e["path"].startswith(multinode["model_dir"])], "a worker read the driver's folder"
    assert len({e["pid"] for e in model_reads}) >= 3  # 2 trainer ranks and the rollout replica (at least)


def test_only_the_driver_writes_the_output_folders(multinode):
    touched = [e for e in multinode["audit"] if e["path"].startswith(multinode["output_dir"])]
    assert not touched, touched  # checkpoints and final models came to the driver through the object store
    assert multinode["final_model"] and multinode["async"]["status"] == "FINISHED"
    assert multinode["checkpoints"] == ["step_1", "step_2"]
    files = multinode["checkpoint_files"]
    assert {"actor_rank0.safetensors", "actor_rank0.json", "actor_rank1.safetensors", "actor_rank1.json",
            "engine.json", "manifest.json"} <= set(files), files

