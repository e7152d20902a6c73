"""Reward pool vs inline scoring in separate_async, with a slow grader.

Run: .venv/bin/python benchmarks/reward_pool.py [--steps 8] [--warmup 2] [--latency 0.2]
Writes benchmarks/results/reward_pool.json and prints a Markdown table (copied into README).

The grader is the same Python function in both variants (a custom reward function,
:mod:`rlpipe.stages.reward_function`, that sleeps ``--latency`` seconds once per
group — a group-wise judge taking 200 ms per call — and scores with the ``digits``
rule). Only its placement differs:

* ``inline`` — ``reward/rule`` (a task stage): separate_async runs it inside each
  rollout replica's feeder, between collecting finished groups and storing them;
* ``pool ×k`` — ``reward/weighted`` with the same function as its rule family: it runs on
  ``pool_size = k`` Ray actors of the ``reward_model`` role (rows split evenly), the driver
  has them score collected groups, and the replicas' services keep generating meanwhile.

Reported: trained samples per second over the measured steps (warm-up excluded) and the
rollout pool's idle fraction (``async/rollout_idle_fraction``). The quickstart's model
and task, tracking off, one rollout replica, on this machine's cores.
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


def run(variant: str, grader: str, steps: int, warmup: int, pool_size: int = 1) -> dict:
    from rlpipe.engine.planning.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    times, metrics = [], []
    with tempfile.TemporaryDirectory() as workdir:
        raw = config(variant, grader, steps, workdir, pool_size)
        run_pipeline(validate_config(raw), yaml.safe_dump(raw),
                     on_step=lambda step, m: (times.append(time.perf_counter()), metrics.append(m)))
    rows = raw["data"]["prompts_per_step"] * raw["stages"][0]["params"]["n"]
    measured = times[warmup:]
    idle = [m.get("async/rollout_idle_fraction") for m in metrics[warmup:] if "async/rollout_idle_fraction" in m]
    return {"variant": variant if variant == "inline" else f"pool ×{pool_size}", "steps": len(measured) - 1,
            "samples_per_s": rows * (len(measured) - 1) / (measured[-1] - measured[0]),
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
    print(f"| scoring ({args.latency * 1000:.0f} ms per group) | trained samples/s | rollout idle fraction |")
    print("|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['samples_per_s']:.1f} | {r['rollout_idle_fraction']:.2f} |")


if __name__ == "__main__":
    main()
