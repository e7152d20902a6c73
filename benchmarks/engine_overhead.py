"""Engine overhead: the step DAG on Ray vs the same stages called inline, and batch handoff cost.

Run: .venv/bin/python benchmarks/engine_overhead.py [--steps 12] [--repeats 3]
Writes benchmarks/results/engine_overhead.json and prints a Markdown table (copied into docs/benchmarks.md).

1. Step time of the quickstart pipeline (tracking off) with every stage in this
   process (InlineBackend) vs on Ray (tasks + actors, Arrow through the object
   store), same seed, same batches. Warm-up steps are excluded. The two run
   interleaved ``--repeats`` times (this shared machine's speed drifts by more
   than the difference measured); the table gives the median over repeats of each
   run's median step, the median over repeats of each repeat's difference to its own
   inline run (paired), and the load average while measuring.
2. Handoff of one realistic batch (4096 rows × 256–768 response tokens, the
   per-token columns of a training batch) to a Ray task: as an Arrow table
   (zero-copy) vs as padded torch tensors (pickled copies).
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


VARIANTS = {"inline": (True, []), "ray": (False, []),
            "ray_colocated": (False, ["resources.colocate=[[actor, rollout]]"])}
"""Variant → (in this process, overrides). ray_colocated: trainer and rollout engine in one Ray actor."""


def step_times(inline: bool, steps: int, warmup: int, overrides: list[str] = ()) -> dict:
    from rlpipe.engine.planning.config_io import load_pipeline
    from rlpipe.engine.runtime import run_pipeline

    config, text = load_pipeline(ROOT / "pipelines/quickstart.yaml", [
        f"trainer.total_steps={steps}", "tracking.enabled=false", f"trainer.output_dir={ROOT}/outputs/bench",
        *overrides,
    ])
    stamps: list[float] = []
    rewards: list[float] = []

    def on_step(step, metrics):
        stamps.append(time.perf_counter())
        rewards.append(metrics.get("reward/mean", float("nan")))

    start = time.perf_counter()
    run_pipeline(config, text, on_step=on_step, inline=inline)
    total = time.perf_counter() - start
    per_step = np.diff(stamps)[warmup:]
    return {"mean_step_s": float(per_step.mean()), "median_step_s": float(np.median(per_step)),
            "total_s": total, "rewards": rewards}


def handoff(rows: int = 4096, repeats: int = 5) -> dict:
    import pyarrow as pa
    import ray

    from rlpipe.jagged import from_flat, to_padded

    rng = np.random.default_rng(0)
    lens = rng.integers(256, 769, rows)
    n = int(lens.sum())
    table = pa.table({
        "response_ids": from_flat(rng.integers(0, 32000, n, dtype=np.int32), lens, pa.int32()),
        "response_mask": from_flat(np.ones(n, np.int8), lens, pa.int8()),
        "old_logprobs": from_flat(rng.standard_normal(n).astype(np.float32), lens, pa.float32()),
        "advantages": from_flat(rng.standard_normal(n).astype(np.float32), lens, pa.float32()),
    })
    tensors = {name: to_padded(table.column(name)) for name in table.column_names}

    @ray.remote
    def consume(batch):
        return sum(getattr(v, "numel", lambda: 0)() for v in batch.values()) if isinstance(batch, dict) else batch.num_rows

    def timed(obj):
        ray.get(consume.remote(ray.put(obj)))  # warm
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ray.get(consume.remote(ray.put(obj)))
            out.append(time.perf_counter() - t0)
        return float(np.median(out))

    arrow_bytes = table.nbytes
    torch_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"rows": rows, "tokens": n, "arrow_mb": arrow_bytes / 2**20, "arrow_s": timed(table),
            "padded_torch_mb": torch_bytes / 2**20, "padded_torch_s": timed(tensors)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.repeats):
        for variant, (inline, overrides) in VARIANTS.items():
            runs[variant].append(step_times(inline, args.steps, args.warmup, overrides))
    hand = handoff()
    import ray

    ray.shutdown()
    median = {mode: float(np.median([r["median_step_s"] for r in rs])) for mode, rs in runs.items()}
    # each repeat's variants ran back to back: their difference drifts less than the runs themselves
    paired = {mode: float(np.median([r["median_step_s"] - i["median_step_s"] for r, i in zip(rs, runs["inline"])]))
              for mode, rs in runs.items()}
    same = all(r["rewards"] == runs["inline"][0]["rewards"] for rs in runs.values() for r in rs)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "steps": args.steps,
              "warmup": args.warmup, "repeats": args.repeats, "load_before": load_before,
              "load_after": os.getloadavg(), "median_step_s": median, "paired_overhead_s": paired, "runs": runs, "handoff": hand,
              "same_rewards": same}
    out = ROOT / "benchmarks/results/engine_overhead.json"
    out.write_text(json.dumps(result, indent=2))
    span = {mode: "–".join(f"{x * 1e3:.0f}" for x in (min(r["median_step_s"] for r in rs),
                                                     max(r["median_step_s"] for r in rs))) for mode, rs in runs.items()}
    print(f"load average (1 min) before {load_before[0]:.2f}, after {result['load_after'][0]:.2f}")
    print(f"quickstart step: median over {args.repeats} interleaved runs of each run's median "
          f"({args.steps - args.warmup - 1} steps each; range over runs in brackets)")
    print()
    print("| variant | step | vs inline | vs inline, paired by repeat |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
        overhead = median[variant] - median["inline"]
        print(f"| {variant} | {median[variant] * 1e3:.0f} ms ({span[variant]}) | "
              f"{overhead * 1e3:+.0f} ms ({overhead / median['inline']:+.0%}) | "
              f"{paired[variant] * 1e3:+.0f} ms ({paired[variant] / median['inline']:+.0%}) |")
    print(f"| identical rewards per step, every run | | {same} | |")
    print()
    print("| batch handoff to a Ray task (4096 rows, %d tokens) | size | time |" % hand["tokens"])
    print("|---|---|---|")
    print(f"| Arrow table (zero-copy) | {hand['arrow_mb']:.0f} MB | {hand['arrow_s'] * 1e3:.1f} ms |")
    print(f"| padded torch tensors | {hand['padded_torch_mb']:.0f} MB | {hand['padded_torch_s'] * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
