"""A 2-step sync run on a 3-node Ray cluster on this machine (ray.cluster_utils.Cluster).

Run by tests/e2e/test_multinode.py in a subprocess, so its cluster never meets the suite's shared
local Ray. The head has the driver and stateless tasks; node_a (custom resource `node_a`) gets the
actor's 2 DP ranks (trainer.backend fsdp2: sharded, so weight pushes and the final save are
collectives of both ranks), node_b the rollout replica. Then a 2-step separate_async run on the same
cluster (trainer on node_a, rollout pool on node_b, weight pushes by broadcast). Prints one JSON line:
the node ids and every lineage record's node, kind and worker, for both runs.
"""

import json
import sys
from pathlib import Path

import ray
import yaml
from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    def __init__(self):
        self.records, self.metrics = [], {}

    def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
        return "multinode"

    def on_node_end(self, record):
        self.records.append(record)

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None):
        self.metrics[step] = {k: v for k, v in metrics.items() if k.startswith("weight_sync/")}

    def on_artifact(self, local_path, artifact_path=None):
        pass

    def on_run_end(self, status, error=None):
        self.status = status


def separate_async(workdir: str) -> dict:
    """2 steps of the async quickstart on the same cluster: the rollout pool on node_b generates continuously while
    the trainer on node_a trains; deferred weight pushes by broadcast over a gloo weight group spanning both nodes."""
    from rlpipe.engine.planning.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    raw = yaml.safe_load((ROOT / "pipelines" / "quickstart_async.yaml").read_text())
    raw["data"]["prompts_per_step"] = 4
    raw["trainer"].update(total_steps=2, ppo_mini_batch_size=2, output_dir=f"{workdir}/outputs-async")
    raw["resources"] = {"placement": {"actor": "node_a", "rollout": "node_b"}}
    raw["tracking"] = {"enabled": False}
    raw["stages"][-1] = {"kind": "weight_sync", "impl": "broadcast", "params": {"timeout_s": 60}}
    recorder = Recorder()
    run_pipeline(validate_config(raw), yaml.safe_dump(raw), observer=recorder)
    return {"status": recorder.status, "metrics": recorder.metrics,
            "records": [{"step": r.step, "kind": r.kind, "worker": r.worker} for r in recorder.records]}


def main(workdir: str) -> None:
    from rlpipe.engine.planning.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    node_a = cluster.add_node(num_cpus=1, resources={"node_a": 1})
    node_b = cluster.add_node(num_cpus=1, resources={"node_b": 1})
    try:
        ray.init(address=cluster.address)
        raw = yaml.safe_load((ROOT / "pipelines" / "quickstart.yaml").read_text())
        raw["data"]["prompts_per_step"] = 4
        raw["trainer"].update(total_steps=2, dp_size=2, backend="fsdp2", output_dir=f"{workdir}/outputs")
        raw["resources"] = {"placement": {"actor": "node_a", "rollout": "node_b"}}
        raw["tracking"] = {"enabled": False}
        recorder = Recorder()
        result = run_pipeline(validate_config(raw), yaml.safe_dump(raw), observer=recorder)
        final = Path(result.output_dir) / "final" / "model.safetensors"
        report = {
            "final_model": final.is_file(),
            "node_a": node_a.node_id, "node_b": node_b.node_id, "status": recorder.status,
            "records": [{"step": r.step, "kind": r.kind, "worker": r.worker} for r in recorder.records],
        }
        report["async"] = separate_async(workdir)
        print(json.dumps(report))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
