"""Concurrent branches: a reference model on its own worker runs beside the trainer's old_log_prob.

Run: .venv/bin/python benchmarks/branches.py [--steps 8] [--repeats 3] [--critic]
Writes benchmarks/results/branches.json and prints a Markdown table (copied into docs/benchmarks.md).

The quickstart with a bigger model (so the two forward passes are worth overlapping) and a reference
model (listed after old_log_prob) for a KL loss, on Ray, two ways:
* ``beside``: resources.concurrent_branches true (the default): the reference worker's chain (ref,
  advantage) starts with old_log_prob (rlpipe.engine.execution.branches);
* ``in_order``: false: ref's call waits for old_log_prob's.
``--critic``: PPO with a critic as well (critic_values listed after ref, GAE reading its values, a
critic_update): three branches, old_log_prob, ref and the critic's chain (critic_values, advantage).
From the lineage (each node's start and duration): per step the wall time from the first of the
branch nodes' start to the last one's end (the section), against the slowest node and against their
sum, and the step (first node's start to the last one's end).
Warm-up steps excluded; the two orders run interleaved ``--repeats`` times; the load average of each
repeat is written down.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import numpy as np

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model.architecture.hidden_size=256", "model.architecture.num_layers=4",
         "model.architecture.intermediate_size=768", "model.architecture.num_heads=4",
         "data.prompts_per_step=32"]
"""A model where a forward pass over the step's 256 rows takes tens of milliseconds (the toy's takes ~1 ms)."""


def _config(order: str, steps: int, threads: int | None = None, critic: bool = False):
    from rlpipe.engine.planning.config_io import load_pipeline

    config, _ = load_pipeline(ROOT / "pipelines/quickstart.yaml", [
        f"trainer.total_steps={steps}", "tracking.enabled=false", f"trainer.output_dir={ROOT}/outputs/bench", *MODEL,
        f"resources.concurrent_branches={'true' if order == 'beside' else 'false'}",
        *([f"trainer.torch_threads={threads}"] if threads else [])])
    raw = config.model_dump(mode="json")
    stages = []
    for stage in raw["stages"]:
        if stage["kind"] == "update":
            stage = {**stage, "params": {**stage["params"], "use_kl_loss": True, "kl_loss_coef": 0.01}}
        if stage["kind"] == "advantage" and critic:
            stage = {"kind": "advantage", "impl": "gae"}
        stages.append(stage)
        if stage["kind"] == "old_log_prob":
            stages.append({"kind": "ref", "impl": "reference"})
            if critic:
                stages.append({"kind": "critic_values", "impl": "critic"})
    raw["stages"] = stages + ([{"kind": "critic_update", "impl": "ppo"}] if critic else [])
    from rlpipe.engine.planning.config_io import validate_config

    return validate_config(raw)


class _Records:
    def __init__(self):
        self.records = []

    def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
        return "branches-bench"

    def on_node_end(self, record):
        self.records.append(record)

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None):
        pass

    def on_artifact(self, local_path, artifact_path=None):
        pass

    def on_run_end(self, status, error=None):
        pass


def measure(order: str, steps: int, warmup: int, threads: int | None = None, critic: bool = False) -> dict:
    from rlpipe.engine.runtime import run_pipeline

    observer = _Records()
    run_pipeline(_config(order, steps, threads, critic), "", observer=observer)
    branches = ("old_log_prob", "ref", "critic_values") if critic else ("old_log_prob", "ref")
    load = os.getloadavg()[0]
    sections, slower, summed, step_s = [], [], [], []
    for step in range(warmup, steps):
        span = {r.node: (r.start_time, r.start_time + r.duration_s) for r in observer.records if r.step == step}
        step_s.append(max(end for _, end in span.values()) - min(start for start, _ in span.values()))
        spans = [span[node] for node in branches]
        sections.append(max(end for _, end in spans) - min(start for start, _ in spans))
        slower.append(max(end - start for start, end in spans))
        summed.append(sum(end - start for start, end in spans))
    med = {k: float(np.median(v)) for k, v in (("section_s", sections), ("slower_s", slower), ("sum_s", summed),
                                                ("step_s", step_s))}
    return {**med, "section_over_slower": med["section_s"] / med["slower_s"],
            "section_over_sum": med["section_s"] / med["sum_s"], "load_1min": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--critic", action="store_true", help="PPO with a critic too: three branches")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="trainer.torch_threads of every worker (default: rlpipe's auto budget)")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"beside": [], "in_order": []}
    for _ in range(args.repeats):
        for order in runs:
            runs[order].append(measure(order, args.steps, args.warmup, args.torch_threads, args.critic))
            print(order, {k: round(v, 4) for k, v in runs[order][-1].items()}, flush=True)
    out = {"machine": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "runs": runs}
    path = ROOT / f"benchmarks/results/branches{'_critic' if args.critic else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print("\n| calls | step (ms) | section (ms) | slower node (ms) | sum (ms) | section / slower | section / sum | load |")
    print("|---|---|---|---|---|---|---|---|")
    for order, reps in runs.items():
        med = {k: float(np.median([r[k] for r in reps])) for k in reps[0]}
        loads = "/".join(f"{r['load_1min']:.2f}" for r in reps)
        print(f"| {order} | {med['step_s'] * 1e3:.1f} | {med['section_s'] * 1e3:.1f} | {med['slower_s'] * 1e3:.1f} | {med['sum_s'] * 1e3:.1f} | "
              f"{med['section_over_slower']:.2f} | {med['section_over_sum']:.2f} | {loads} |")


if __name__ == "__main__":
    main()
