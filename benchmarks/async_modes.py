"""Async modes vs sync on a long-tail rollout workload.

Run: .venv/bin/python benchmarks/async_modes.py [--steps 12]
Writes benchmarks/results/async_modes.json and prints a Markdown table (copied into README).

Workload: the quickstart model and task, but every request's response length is
drawn from a heavy-tailed (Pareto) distribution and generated to that length
(ignore_eos, per-request max_tokens) — the long tail that makes synchronous RL
wait for its slowest trajectory. Each mode runs the same number of steps on Ray
(tracking off); we report trained samples per second (warm-up steps excluded),
staleness, and the ideal overlap bound (gen + train) / max(gen, train) computed
from the sync run's measured generation and training times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

ROOT = Path(__file__).resolve().parents[1]

GEN = {"n": 4, "max_tokens": 96, "temperature": 1.0, "ignore_eos": True,
       "length_distribution": "pareto", "pareto_alpha": 1.2, "min_tokens": 8}


def workload(mode: str, steps: int, mode_params: dict) -> dict:
    import yaml

    raw = yaml.safe_load((ROOT / "pipelines/quickstart.yaml").read_text())
    raw.update(name=f"bench-{mode}", mode=mode, mode_params=mode_params)
    raw["model"]["architecture"]["max_position_embeddings"] = 128
    raw["data"]["prompts_per_step"] = 16
    raw["trainer"].update(total_steps=steps, output_dir=str(ROOT / "outputs/bench"), micro_batch_size=64,
                          ppo_mini_batch_size=8, parameter_sync_step=2)
    raw["tracking"] = {"enabled": False}
    stages = []
    for stage in raw["stages"]:
        if stage["kind"] == "generate":
            stage = {**stage, "params": GEN}
        if stage["kind"] == "balance" and mode != "sync":
            stages.append({"kind": "staleness_guard", "impl": "max_staleness"})
        stages.append(stage)
    raw["stages"] = stages
    return raw


def run_mode(mode: str, steps: int, warmup: int, mode_params: dict) -> dict:
    from rlpipe.engine.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    config = validate_config(workload(mode, steps, mode_params))
    stamps, metrics = [], []

    def on_step(step, m):
        stamps.append(time.perf_counter())
        metrics.append(m)

    run_pipeline(config, "", on_step=on_step)
    per_step = np.diff(stamps)[warmup:]
    samples = config.data.prompts_per_step * GEN["n"]
    out = {"samples_per_s": samples / float(per_step.mean()), "mean_step_s": float(per_step.mean())}
    keys = [k for k in metrics[-1] if k.startswith(("staleness_guard/staleness/max", "staleness_guard/version_lag",
                                                      "async/", "sampler/evicted"))]
    out.update({k: float(np.mean([m.get(k, np.nan) for m in metrics[warmup:]])) for k in keys})
    if mode == "sync":
        out["gen_s"] = float(np.mean([m["timing/generate_s"] for m in metrics[warmup:]]))
        out["train_s"] = float(np.mean([sum(v for k, v in m.items() if k.startswith("timing/") and k != "timing/generate_s")
                                        for m in metrics[warmup:]]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--poll", type=float, default=0.05, help="separate_async collection wait (s)")
    args = parser.parse_args()
    results = {
        "sync": run_mode("sync", args.steps, args.warmup, {}),
        "colocate_async": run_mode("colocate_async", args.steps, args.warmup, {}),
        "colocate_async (no release)": run_mode("colocate_async", args.steps, args.warmup,
                                                {"release_memory_during_update": False}),
        "separate_async": run_mode("separate_async", args.steps, args.warmup,
                                   {"max_off_policy_threshold": 4, "strategy": "drop", "capacity_steps": 2,
                                    "poll_s": args.poll}),
    }
    import ray

    ray.shutdown()
    sync = results["sync"]
    ideal = (sync["gen_s"] + sync["train_s"]) / max(sync["gen_s"], sync["train_s"])
    summary = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "steps": args.steps,
               "workload": GEN, "ideal_speedup": ideal, "results": results}
    (ROOT / "benchmarks/results/async_modes.json").write_text(json.dumps(summary, indent=2))
    print(f"sync step: generation {sync['gen_s'] * 1e3:.0f} ms + training {sync['train_s'] * 1e3:.0f} ms "
          f"→ ideal overlap speed-up {ideal:.2f}×")
    print("| mode | samples/s | vs sync | of ideal | max staleness | rollout idle | trainer idle |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        speed = r["samples_per_s"] / sync["samples_per_s"]
        print(f"| {mode} | {r['samples_per_s']:.1f} | {speed:.2f}× | {speed / ideal:.0%} | "
              f"{r.get('staleness_guard/staleness/max', 1):.0f} | {r.get('async/rollout_idle_fraction', float('nan')):.0%} | "
              f"{r.get('async/trainer_idle_fraction', float('nan')):.0%} |")


if __name__ == "__main__":
    main()
