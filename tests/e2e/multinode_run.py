"""A 2-step sync run on a 3-node Ray cluster on this machine (ray.cluster_utils.Cluster).

Run by tests/e2e/test_multinode.py in a subprocess, so its cluster never meets the suite's shared
local Ray. The head has the driver and stateless tasks; node_a (custom resource `node_a`) gets the
actor's 2 DP ranks (trainer.backend fsdp2: sharded, so weight pushes and the final save are
collectives of both ranks), node_b the rollout replica. Then a 2-step separate_async run on the same
cluster (trainer on node_a, rollout pool on node_b, weight pushes by broadcast). Prints one JSON line:
the node ids and every lineage record's node, kind and worker, for both runs.

No shared filesystem (resources.shared_filesystem left at its default: false on 3 nodes): the sync
run loads its model from a folder (`model.path`, `tokenizer.path`) that exists only while the driver
packs it — it is renamed away while the workers are built — and writes a checkpoint every step. Every
Ray worker process runs an audit hook (`sys.addaudithook`, installed by Ray's
worker_process_setup_hook) that logs each file it opens, creates, renames or removes under the model
folder, the node cache or the output folder. (A run resumed from a checkpoint that came through the object store:
tests/engine/test_checkpoint.py, on the suite's one-node Ray with resources.shared_filesystem: false.)
"""

import json
import sys
from pathlib import Path

import ray
import yaml
from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    def __init__(self, run_id: str = "multinode"):
        self.records, self.metrics, self.run_id = [], {}, run_id

    def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
        return self.run_id

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


def audit_hook(prefixes: list[str], log_dir: str):
    """Ray's worker_process_setup_hook: every worker process logs (pid, event, path, write?) for file events under
    ``prefixes`` to ``<log_dir>/<pid>.jsonl`` (its log file is opened before the hook, so it is not logged)."""

    def install() -> None:
        import os
        import sys

        fd = os.open(f"{log_dir}/{os.getpid()}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

        def hook(event, args):
            if event not in ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.unlink", "shutil.rmtree"):
                return
            paths = [os.fsdecode(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
            hit = next((p for p in paths if any(os.path.abspath(p) == x or os.path.abspath(p).startswith(x + os.sep)
                                                for x in prefixes)), None)
            if hit is None:
                return
            write = event != "open" or (isinstance(args[1], str) and any(c in args[1] for c in "wax+")) or (
                args[1] is None and bool(args[2] & writes))
            os.write(fd, (json.dumps({"pid": os.getpid(), "event": event, "path": os.path.abspath(hit),
                                      "write": write}) + "\n").encode())

        sys.addaudithook(hook)

    return install


def make_model_dir(folder: Path, raw: dict) -> Path:
    """The quickstart's randomly initialized model and its tokenizer as a Hugging Face folder."""
    from rlpipe.backends.model import build_model, save_hf_model
    from rlpipe.backends.tokenizer import build_tokenizer
    from rlpipe.schemas.config import ModelConfig, TokenizerConfig

    tokenizer = build_tokenizer(TokenizerConfig(**raw["tokenizer"]))
    return save_hf_model(build_model(ModelConfig(**raw["model"]), tokenizer, raw["seed"]), tokenizer, folder)


def tree(folder: Path) -> dict[str, str]:
    import hashlib

    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def sync_run(workdir: str) -> dict:
    """The sync run on a model folder only the driver has while workers start. Returns what the test checks."""
    from rlpipe.engine.planning.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    raw = yaml.safe_load((ROOT / "pipelines" / "quickstart.yaml").read_text())
    model_dir = make_model_dir(Path(workdir) / "driver-only" / "model", raw)
    packed_tree = tree(model_dir)
    raw["model"], raw["tokenizer"] = {"path": str(model_dir)}, {"path": str(model_dir)}
    raw["data"]["prompts_per_step"] = 4
    raw["trainer"].update(total_steps=2, dp_size=2, backend="fsdp2", output_dir=f"{workdir}/outputs",
                          checkpoint_every=1, keep_checkpoints=0)
    raw["resources"] = {"placement": {"actor": "node_a", "rollout": "node_b"}, "node_cache_dir": f"{workdir}/cache"}
    raw["tracking"] = {"enabled": False}
    hidden, phases = model_dir.with_name("model.hidden"), []

    def on_phase(name: str) -> None:  # the folder is gone while every worker builds its role
        phases.append(name)
        if name.startswith("building workers"):
            model_dir.rename(hidden)
        elif name.startswith("loading data") and hidden.exists():
            hidden.rename(model_dir)  # the driver builds its own tokenizer from tokenizer.path next

    recorder = Recorder("multinode-sync")
    result = run_pipeline(validate_config(raw), yaml.safe_dump(raw), observer=recorder, on_phase=on_phase)
    out = Path(result.output_dir)
    caches = [p for p in Path(f"{workdir}/cache").iterdir() if p.is_dir()]
    return {
        "status": recorder.status, "phases": phases,
        "final_model": (out / "final" / "model.safetensors").is_file(),
        "records": [{"step": r.step, "kind": r.kind, "worker": r.worker} for r in recorder.records],
        "checkpoints": sorted(p.name for p in (out / "checkpoints").iterdir()),
        "checkpoint_files": sorted(p.name for p in (out / "checkpoints" / "step_1").iterdir()),
        "model_dir": str(model_dir), "output_dir": str(Path(workdir) / "outputs"), "cache_dir": f"{workdir}/cache",
        "packed_tree": packed_tree, "cache_trees": [tree(p) for p in caches],
    }


def start_cluster() -> tuple[Cluster, object, object]:
    """A head and two nodes with the custom resources node_a / node_b. Ray waits a fixed 30 s for each node's
    raylet to register (ray/_private/node.py); a loaded 2-core machine once missed it, so a failed start is
    shut down (no processes left for the next test's ray.init to find) and tried once more."""
    for attempt in range(2):
        cluster = Cluster(initialize_head=False)
        try:
            cluster.add_node(num_cpus=1, include_dashboard=False)  # the first node added is the head
            node_a = cluster.add_node(num_cpus=1, resources={"node_a": 1})
            node_b = cluster.add_node(num_cpus=1, resources={"node_b": 1})
            return cluster, node_a, node_b
        except Exception:
            cluster.shutdown()
            if attempt:
                raise
    raise AssertionError("unreachable")


def main(workdir: str) -> None:
    cluster, node_a, node_b = start_cluster()
    audit = Path(workdir) / "audit"
    audit.mkdir()
    watched = [str(Path(workdir) / d) for d in ("driver-only", "outputs", "outputs-async", "cache")]
    try:
        ray.init(address=cluster.address, runtime_env={"worker_process_setup_hook": audit_hook(watched, str(audit))})
        report = {**sync_run(workdir), "node_a": node_a.node_id, "node_b": node_b.node_id}
        report["async"] = separate_async(workdir)
        report["audit"] = [json.loads(line) for f in sorted(audit.glob("*.jsonl")) for line in f.read_text().splitlines()]
        print(json.dumps(report))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
