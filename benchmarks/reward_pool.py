"""Reward pool vs inline scoring in separate_async, with a slow grader.

Run: .venv/bin/python benchmarks/reward_pool.py [--steps 8] [--warmup 2] [--latency 0.2]
Writes benchmarks/results/reward_pool.json and prints a Markdown table (copied into docs/benchmarks.md).

The grader is the same Python function in both variants (a custom reward function,
:mod:`rlpipe.stages.reward_function`, that sleeps ``--latency`` seconds once per
group — a group-wise judge taking 200 ms per call — and scores with the ``digits``
rule). Only its placement differs:

* ``inline`` — ``reward/rule`` (a task stage): separate_async runs it inside each
  rollout replica's feeder, between collecting finished groups and storing them;
* ``pool ×k`` — ``reward/weighted`` with the same function as its rule family: it runs on
  ``pool_size = k`` Ray actors of the ``reward_model`` role (rows split evenly).

Both run in the rollout replica's feeder loop; what differs is whether the loop waits:
inline, the feeder grades each collected table itself before it pulls or collects again;
with the pool, it hands the table to the pool's actors (rlpipe.engine.state.pool_client)
and keeps pulling prompts and collecting generations while they grade.

Reported over the measured steps (warm-up excluded): **rollout samples/s** (trajectories the
rollout replica generated per second: the ``generate`` lineage records the feeder keeps),
trained samples/s, and the rollout's idle fraction (``async/rollout_idle_fraction``). The
quickstart's model and task, tracking off, one rollout replica, on this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

ROOT = Path(__file__).resolve().parents[1]

GRADER = """\
import time
from rlpipe.stages.scorers import digits

def grade(data_source, solution_str, ground_truth, extra_info):
    if extra_info["sample_index"] == 0:  # one judge call per group
        time.sleep({latency})
    return float(digits([solution_str], [ground_truth])[0])
"""


def config(variant: str, grader: str, steps: int, workdir: str, pool_size: int = 1) -> dict:
    raw = yaml.safe_load((ROOT / "pipelines/quickstart_async.yaml").read_text())
    raw.update(name=f"bench-reward-{variant}", tracking={"enabled": False})
    raw["data"]["prompts_per_step"] = 8
    raw["trainer"].update(total_steps=steps, ppo_mini_batch_size=4, parameter_sync_step=2, output_dir=workdir)
    function = {"path": grader, "name": "grade"}
    reward = {"kind": "reward", "impl": "rule", "params": {"function": function}} if variant == "inline" else \
        {"kind": "reward", "impl": "weighted",
         "params": {"rule": {"function": function}, "weights": {"rule": 1.0}, "pool_size": pool_size}}
    raw["stages"] = [reward if s["kind"] == "reward" else s for s in raw["stages"]]
    raw["stages"][0]["params"]["n"] = 4
    return raw


class Generated:
    """An observer that keeps when the rollout generated how many trajectories (its ``generate`` records)."""

    def __init__(self):
        self.generated: list[tuple[float, int]] = []

    def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
        return "bench"

    def on_node_end(self, record) -> None:
        if record.node == "generate":
            self.generated.append((record.start_time + record.duration_s, record.rows_out))

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None) -> None:
        pass

    def on_artifact(self, local_path, artifact_path=None) -> None:
        pass

    def on_run_end(self, status, error=None) -> None:
        pass


def run(variant: str, grader: str, steps: int, warmup: int, pool_size: int = 1) -> dict:
    from rlpipe.engine.planning.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    times, metrics, observer = [], [], Generated()
    with tempfile.TemporaryDirectory() as workdir:
        raw = config(variant, grader, steps, workdir, pool_size)
        run_pipeline(validate_config(raw), yaml.safe_dump(raw), observer=observer,
                     on_step=lambda step, m: (times.append(time.time()), metrics.append(m)))
    rows = raw["data"]["prompts_per_step"] * raw["stages"][0]["params"]["n"]
    measured = times[warmup:]
    window = measured[-1] - measured[0]
    generated = sum(n for end, n in observer.generated if measured[0] < end <= measured[-1])
    idle = [m.get("async/rollout_idle_fraction") for m in metrics[warmup:] if "async/rollout_idle_fraction" in m]
    return {"variant": variant if variant == "inline" else f"pool ×{pool_size}", "steps": len(measured) - 1,
            "rollout_samples_per_s": generated / window,
            "samples_per_s": rows * (len(measured) - 1) / window,
            "rollout_idle_fraction": sum(idle) / len(idle) if idle else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--latency", type=float, default=0.2)
    args = parser.parse_args()
    from rlpipe.engine.execution.ray_runtime import init_ray

    init_ray(None, None)
    with tempfile.TemporaryDirectory() as tmp:
        grader = Path(tmp) / "grader.py"
        grader.write_text(GRADER.replace("{latency}", str(args.latency)))
        results = [run("inline", str(grader), args.steps, args.warmup)]
        results += [run("pool", str(grader), args.steps, args.warmup, size) for size in (1, 4)]
    out = {"latency_s_per_group": args.latency, "cpus": os.cpu_count(), "results": results}
    (ROOT / "benchmarks/results").mkdir(parents=True, exist_ok=True)
    (ROOT / "benchmarks/results/reward_pool.json").write_text(json.dumps(out, indent=2))
    print(f"| grading ({args.latency * 1000:.0f} ms per group) | rollout samples/s | trained samples/s "
          "| rollout idle fraction |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['rollout_samples_per_s']:.1f} | {r['samples_per_s']:.1f} "
              f"| {r['rollout_idle_fraction']:.2f} |")


if __name__ == "__main__":
    main()
