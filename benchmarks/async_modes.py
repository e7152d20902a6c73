"""Async modes vs sync on a long-tail rollout workload.

Run: .venv/bin/python benchmarks/async_modes.py [--steps 12] [--repeats 3] [--workload lengths|env_latency|long_tail]
     [--variants borrow borrow_eager]
Writes benchmarks/results/async_modes.json and prints a Markdown table (copied into docs/benchmarks.md).

Workloads: the quickstart model and task, but every request's response length is
drawn from a heavy-tailed (Pareto) distribution and generated to that length
(ignore_eos, per-request max_tokens) — the long tail that makes synchronous RL
wait for its slowest trajectory (``lengths``, compute-bound); ``env_latency``
adds a heavy-tailed simulated environment latency before each trajectory's first
token (a sandbox starting, a tool answering), which takes wall time but no CPU; ``long_tail`` is issue 28's
(8 prompts × 16 samples, Pareto(0.8) lengths 4–192, environment latency Pareto from 5 ms capped at 1 s,
separate_async at threshold 3, drop), on which separate_async's trainer idled 16% of the time. ``--variants
borrow`` adds separate_async with the hybrid borrow (``mode_params.borrow``: the idle trainer generates while
the buffer runs dry). Each mode runs the same number of steps on Ray
(tracking off); we report trained samples per second (warm-up steps excluded),
staleness, and the ideal overlap bound (gen + train) / max(gen, train) computed
from the sync run's measured generation and training times.

The machine's CPU time is measured too (/proc/stat, busy jiffies of all cores,
over the measured steps): the sync run's CPU-seconds per step divided by the
core count is the shortest step any schedule of that work could reach on this
machine; per mode, "CPU bound" = sync step / (the mode's CPU-seconds per step /
cores). Async modes do more CPU work per step than sync (the replay buffer
actor, scoring in the replicas, re-prefill of the requests a push aborts), so
on few cores their CPU bound can fall below the ideal overlap bound: then the
cores, not the schedule, cap the speed-up. Modes run interleaved, ``--repeats``
times, and medians are reported (this shared machine drifts between runs).
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

WORKLOADS = {
    # compute-bound long tail: every response's length is a Pareto draw, generated to that length
    "lengths": {"n": 4, "max_tokens": 96, "temperature": 1.0, "ignore_eos": True,
                "length_distribution": "pareto", "pareto_alpha": 1.2, "min_tokens": 8},
    # latency-bound long tail (agentic RL): each trajectory also waits for its simulated environment
    # (Pareto from 2 ms, capped at 200 ms) before its first token; the wait takes no CPU
    "env_latency": {"n": 4, "max_tokens": 64, "temperature": 1.0, "ignore_eos": True,
                    "length_distribution": "pareto", "pareto_alpha": 1.2, "min_tokens": 8,
                    "env_latency_s": 0.002, "env_latency_max_s": 0.2},
    # issue 28's long tail: heavier length tail (Pareto 0.8, 4–192 tokens) and environment latency (Pareto from
    # 5 ms, capped at 1 s), 16 samples per prompt
    "long_tail": {"n": 16, "max_tokens": 192, "temperature": 1.0, "ignore_eos": True,
                  "length_distribution": "pareto", "pareto_alpha": 0.8, "min_tokens": 4,
                  "env_latency_s": 0.005, "env_latency_max_s": 1.0},
}
SHAPES = {
    # prompts per step, mini-batch (2 local updates per step), model positions (prompt + longest response),
    # separate_async's staleness threshold
    "default": {"prompts_per_step": 16, "ppo_mini_batch_size": 8, "max_position_embeddings": 128, "threshold": 4},
    "long_tail": {"prompts_per_step": 8, "ppo_mini_batch_size": 4, "max_position_embeddings": 256, "threshold": 3},
}
GEN = WORKLOADS["lengths"]
SHAPE = SHAPES["default"]


def workload(mode: str, steps: int, mode_params: dict) -> dict:
    import yaml

    raw = yaml.safe_load((ROOT / "pipelines/quickstart.yaml").read_text())
    raw.update(name=f"bench-{mode}", mode=mode, mode_params=mode_params)
    raw["model"]["architecture"]["max_position_embeddings"] = SHAPE["max_position_embeddings"]
    raw["data"]["prompts_per_step"] = SHAPE["prompts_per_step"]
    raw["trainer"].update(total_steps=steps, output_dir=str(ROOT / "outputs/bench"), micro_batch_size=64,
                          ppo_mini_batch_size=SHAPE["ppo_mini_batch_size"], parameter_sync_step=2)
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


def cpu_busy_s() -> float:
    """Seconds all cores spent busy since boot (/proc/stat; user+nice+system+irq+softirq+steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_mode(mode: str, steps: int, warmup: int, mode_params: dict) -> dict:
    from rlpipe.engine.planning.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    config = validate_config(workload(mode, steps, mode_params))
    stamps, metrics = [], []

    busy: dict[int, float] = {}

    def on_step(step, m):
        stamps.append(time.perf_counter())
        metrics.append(m)
        busy[step] = cpu_busy_s()

    run_pipeline(config, "", on_step=on_step)
    per_step = np.diff(stamps)[warmup:]
    samples = config.data.prompts_per_step * GEN["n"]
    cpu_per_step = (busy[steps - 1] - busy[warmup]) / len(per_step)
    out = {"samples_per_s": samples / float(per_step.mean()), "mean_step_s": float(per_step.mean()),
           "cpu_s_per_step": cpu_per_step, "cpu_busy_fraction": cpu_per_step / (os.cpu_count() * per_step.mean())}
    keys = [k for k in metrics[-1] if k.startswith(("staleness_guard/staleness/max", "staleness_guard/version_lag",
                                                      "async/", "sampler/evicted", "rollout/borrow"))]
    out.update({k: float(np.mean([m.get(k, np.nan) for m in metrics[warmup:]])) for k in keys})
    if mode == "sync":
        out["gen_s"] = float(np.mean([m["timing/generate_s"] for m in metrics[warmup:]]))
        out["train_s"] = float(np.mean([sum(v for k, v in m.items() if k.startswith("timing/") and k != "timing/generate_s")
                                        for m in metrics[warmup:]]))
    return out


def modes(threshold: int, variants: list[str]) -> dict[str, tuple[str, dict]]:
    """Name → (mode, mode_params) of every run; ``variants`` adds more (``borrow``: separate_async with the hybrid
    borrow on)."""
    separate = {"max_off_policy_threshold": threshold, "strategy": "drop", "capacity_steps": 2}
    out = {
        "sync": ("sync", {}),
        "colocate_async": ("colocate_async", {}),
        "colocate_async (no release)": ("colocate_async", {"release_memory_during_update": False}),
        "separate_async": ("separate_async", separate),
    }
    if "borrow" in variants:
        out["separate_async (borrow)"] = ("separate_async", {**separate, "borrow": {"enabled": True}})
    if "borrow_eager" in variants:  # lends the trainer after 50 ms of waiting instead of the default 0.5 s
        out["separate_async (borrow after 50 ms)"] = ("separate_async",
                                                     {**separate, "borrow": {"enabled": True, "after_s": 0.05}})
    return out


def median_run(runs: list[dict]) -> dict:
    """Per key, the median over repeats (samples/s and every other figure)."""
    return {k: float(np.median([r[k] for r in runs if k in r])) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per mode, interleaved (sync, colocate, ..., sync, ...); medians are reported")
    parser.add_argument("--poll", type=float, default=0.05, help="separate_async collection wait (s)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="lengths")
    parser.add_argument("--variants", nargs="*", choices=["borrow", "borrow_eager"], default=[],
                        help="more runs: borrow = separate_async with mode_params.borrow on")
    args = parser.parse_args()
    global GEN, SHAPE
    GEN = WORKLOADS[args.workload]
    SHAPE = SHAPES.get(args.workload, SHAPES["default"])
    runs_of = modes(SHAPE["threshold"], args.variants)
    runs: dict[str, list[dict]] = {name: [] for name in runs_of}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every mode alike
        for name, (mode, params) in runs_of.items():
            params = {**params, "poll_s": args.poll} if mode == "separate_async" else params
            runs[name].append(run_mode(mode, args.steps, args.warmup, params))
    import ray

    ray.shutdown()
    results = {name: median_run(r) for name, r in runs.items()}
    sync = results["sync"]
    ideal = (sync["gen_s"] + sync["train_s"]) / max(sync["gen_s"], sync["train_s"])
    cores = os.cpu_count()
    for r in results.values():
        # the most any schedule of this mode's CPU work could gain over sync on these cores
        r["cpu_bound_speedup"] = sync["mean_step_s"] / (r["cpu_s_per_step"] / cores)
    summary = {"machine": f"{platform.machine()}, {cores} cores", "steps": args.steps, "repeats": args.repeats,
               "workload": {"name": args.workload, **GEN, **SHAPE}, "ideal_speedup": ideal, "results": results,
               "runs": {name: [r["samples_per_s"] for r in rs] for name, rs in runs.items()}}
    suffix = ("" if args.workload == "lengths" else f"_{args.workload}") + "".join(f"_{v}" for v in args.variants)
    (ROOT / f"benchmarks/results/async_modes{suffix}.json").write_text(json.dumps(summary, indent=2))
    print(f"sync step (median of {args.repeats}): generation {sync['gen_s'] * 1e3:.0f} ms + training "
          f"{sync['train_s'] * 1e3:.0f} ms → ideal overlap speed-up {ideal:.2f}×")
    print("| mode | samples/s (median) | runs | vs sync | of ideal | max staleness | rollout idle | trainer idle "
          "| borrowed groups/step | CPU ms/step | CPU busy | CPU bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    dash = "–"
    for name, r in results.items():
        speed = r["samples_per_s"] / sync["samples_per_s"]
        idle = {k: f"{r[k]:.0%}" if k in r else dash for k in ("async/rollout_idle_fraction", "async/trainer_idle_fraction")}
        borrowed = f"{r['rollout/borrowed_groups']:.1f}" if "rollout/borrowed_groups" in r else dash
        spread = "–".join(f"{x:.0f}" for x in (min(summary["runs"][name]), max(summary["runs"][name])))
        print(f"| {name} | {r['samples_per_s']:.1f} | {spread} | {speed:.2f}× | {speed / ideal:.0%} | "
              f"{r.get('staleness_guard/staleness/max', 1):.0f} | {idle['async/rollout_idle_fraction']} | "
              f"{idle['async/trainer_idle_fraction']} | {borrowed} | "
              f"{r['cpu_s_per_step'] * 1e3:.0f} | {r['cpu_busy_fraction']:.0%} "
              f"| {r['cpu_bound_speedup']:.2f}× |")


if __name__ == "__main__":
    main()
