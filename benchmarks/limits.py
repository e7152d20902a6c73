"""This machine's limits for the compute-size job, and how close rlpipe's step gets to them (issue 28).

Run: .venv/bin/python benchmarks/vs_trl.py --size compute [--precision bf16]   (the runs), then
     .venv/bin/python benchmarks/limits.py [--runs benchmarks/results/vs_trl_compute_bf16.json]
Writes benchmarks/results/limits[_bf16].json and prints a Markdown table (copied into docs/benchmarks.md).

The job is ``benchmarks/vs_trl.py --size compute``: a ~24M-parameter Qwen2 (hidden 512, 8 layers, 8 query / 2
key-value heads, MLP 1536, a 19-token vocabulary), 32 prompts × 4 samples × 128 new tokens (every response runs
to full length), rlpipe inline with MLflow on, at its default threads. What is measured:

1. **Peak matmul rate at the model's shapes**: torch at the thread count rlpipe runs with, every linear layer of
   the model at the update's token count and at the decode batch; peak = the fastest of them.
2. **Memory bandwidth**: ``copy_`` between two 512 MiB tensors, bytes read + written per second; and ``memcpy``
   of the model's weight bytes (what a weight push moves at least twice: into its buckets and into the engine).
3. **rlpipe's step** (the inline runs of the ``vs_trl.py --size compute`` results, medians): the update node's
   FLOP/s, counted from
   the shapes (6 × linear parameters × tokens through them, the attention products, the LM head at the positions
   whose logits are read; the shared prompt forward counted once per distinct prompt), as a share of the peak
   (MFU); the generate node's tokens/s against the decode roofline (per decode step: the FLOPs of a batch of
   one new token per row, and the bytes of the weights plus the KV cache read, at the mean context length);
   the weight push's MB/s against memcpy.

The roofline is a bound, not a target the code can reach: a decode step also samples, retires finished rows and
runs the small per-token ops; the update also computes the loss, the optimizer step and the two conversions
between Arrow and tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402  (the workload and the child runs)

ROOT = Path(__file__).resolve().parents[1]
BYTES = {"fp32": 4, "bf16": 2}


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def linear_shapes(arch: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one decoder layer of the workload's Qwen2."""
    hidden, heads, kv_heads, mlp = arch["hidden_size"], arch["num_heads"], arch["num_kv_heads"], arch["intermediate_size"]
    head_dim = hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp), "down_proj": (mlp, hidden)}


def peak_matmul(arch: dict, rows: list[int], dtype: torch.dtype) -> dict:
    """FLOP/s of every linear of the model at each row count (x @ W.T, as nn.Linear computes it)."""
    rates = {}
    for name, (fan_in, fan_out) in linear_shapes(arch).items():
        weight = torch.randn(fan_out, fan_in, dtype=dtype)
        for count in rows:
            x = torch.randn(count, fan_in, dtype=dtype)
            seconds = _timed(lambda: torch.nn.functional.linear(x, weight), 20)
            rates[f"{name} [{count}x{fan_in}]x[{fan_in}x{fan_out}]"] = 2 * count * fan_in * fan_out / seconds
    return rates


def memory_rates(weight_bytes: int) -> dict:
    """Copy bandwidth (read + write bytes per second) of a 512 MiB tensor, and memcpy of the weights' size."""
    big = torch.empty(128 << 20, dtype=torch.float32)
    big_dst = torch.empty_like(big)
    big.fill_(1.0)
    copy_s = _timed(lambda: big_dst.copy_(big), 5)
    src = torch.ones(weight_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    weights_s = _timed(lambda: dst.copy_(src), 10)
    return {"copy_bytes_per_s": 2 * big.nbytes / copy_s, "weights_memcpy_bytes_per_s": src.nbytes / weights_s}


def work_counts(arch: dict, vocab: int, work: vs_trl.Workload, prompt_tokens: int) -> dict:
    """FLOPs of one update and of one decode step, and the bytes a decode step reads (per parameter byte)."""
    layers, hidden, kv_heads, heads = arch["num_layers"], arch["hidden_size"], arch["num_kv_heads"], arch["num_heads"]
    linear_params = layers * sum(i * o for i, o in linear_shapes(arch).values())
    rows, prompts, new = work.prompts * work.samples, work.prompts, work.new_tokens
    # the update's forward: each distinct prompt once (its last position's logits), then every row's response
    tokens = prompts * prompt_tokens + rows * new
    attention_pairs = prompts * prompt_tokens * (prompt_tokens + 1) / 2 + rows * (new * prompt_tokens + new * (new + 1) / 2)
    forward = 2 * linear_params * tokens + 4 * hidden * attention_pairs * layers + 2 * hidden * vocab * (prompts + rows * new)
    context = prompt_tokens + new / 2  # mean keys per decode step
    decode_flops = rows * (2 * linear_params + 4 * hidden * context * layers + 2 * hidden * vocab)
    kv_values = rows * context * layers * 2 * kv_heads * (hidden // heads)
    return {"linear_params": linear_params, "update_tokens": tokens, "update_flops": 3 * forward,
            "decode_flops_per_step": decode_flops, "decode_kv_values_per_step": kv_values}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=Path, default=ROOT / "benchmarks/results/vs_trl_compute.json",
                        help="the results of `vs_trl.py --size compute` whose rlpipe inline runs are compared with "
                             "the limits (bf16: vs_trl_compute_bf16.json)")
    args = parser.parse_args()
    measured = json.loads(args.runs.read_text())
    if measured.get("size") != "compute" or "inline" not in measured["runs"]:
        raise SystemExit(f"{args.runs}: not a `vs_trl.py --size compute` result with inline runs")
    precision = measured.get("precision", "fp32")
    work = vs_trl.WORKLOADS["compute"]
    meta = measured["meta"]
    runs = measured["runs"]["inline"]
    threads = runs[0]["threads"]
    torch.set_num_threads(threads)  # the limits at the thread count rlpipe ran with
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    counts = work_counts(work.arch, meta["vocab"], work, vs_trl.PROMPT_TOKENS)
    rates = peak_matmul(work.arch, [counts["update_tokens"], work.prompts * work.samples], dtype)
    peak = max(rates.values())
    memory = memory_rates(meta["params"] * 4)

    def median(values) -> float:
        return float(np.median(values))

    update_s = median([r["phases_s"]["update"] for r in runs])
    generate_s = median([r["phases_s"]["generate"] for r in runs])
    push_s = median([r["phases_s"]["weight_sync"] for r in runs])
    push_bytes = median([r["pushes"]["weight_sync/bytes"] for r in runs])
    step_s = median([r["step_s"] for r in runs])
    rows = work.prompts * work.samples
    param_bytes = meta["params"] * BYTES[precision]  # the rollout copy's weights (bf16: model.rollout_dtype)
    decode_bytes = param_bytes + counts["decode_kv_values_per_step"] * BYTES[precision]
    compute_bound_s = counts["decode_flops_per_step"] / peak
    bandwidth_bound_s = decode_bytes / memory["copy_bytes_per_s"]
    decode_tokens_per_s = rows * work.new_tokens / generate_s
    table = {
        "threads": threads, "precision": precision, "step_s": step_s, "peak_flops": peak,
        "update_s": update_s, "update_flops": counts["update_flops"], "update_mfu": counts["update_flops"] / update_s / peak,
        "generate_s": generate_s, "decode_tokens_per_s": decode_tokens_per_s,
        "decode_bandwidth_bound_tokens_per_s": rows / bandwidth_bound_s,
        "decode_roofline_tokens_per_s": rows / max(compute_bound_s, bandwidth_bound_s),
        "push_s": push_s, "push_bytes": push_bytes, "push_bytes_per_s": push_bytes / push_s,
        "loads": [round(r["load_at_start"], 2) for r in runs],
    }
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "runs_file": str(args.runs.name),
              "load_now": os.getloadavg()[0], "meta": meta, "counts": counts, "matmul_flops": rates, "memory": memory,
              "median": table}
    name = "limits.json" if precision == "fp32" else f"limits_{precision}.json"
    (ROOT / "benchmarks/results" / name).write_text(json.dumps(result, indent=2))

    print(f"{meta['params'] / 1e6:.1f}M parameters, {precision}, {threads} torch threads; rlpipe inline: medians of "
          f"the {len(runs)} runs of {args.runs.name} (load at each start {', '.join(map(str, table['loads']))}); "
          f"limits measured now (load {os.getloadavg()[0]:.2f})")
    print("| what | measured | limit on this machine | share |")
    print("|---|---|---|---|")
    print(f"| update ({counts['update_flops'] / 1e12:.2f} TFLOP a step) | {update_s:.2f} s = "
          f"{counts['update_flops'] / update_s / 1e9:.0f} GFLOP/s | peak matmul {peak / 1e9:.0f} GFLOP/s | "
          f"{table['update_mfu']:.0%} (MFU) |")
    print(f"| decode ({rows} rows × {work.new_tokens} tokens) | {generate_s:.2f} s = {decode_tokens_per_s:.0f} tokens/s | "
          f"bandwidth bound {table['decode_bandwidth_bound_tokens_per_s']:.0f} tokens/s "
          f"({decode_bytes / 1e6:.0f} MB a step at {memory['copy_bytes_per_s'] / 1e9:.1f} GB/s); roofline "
          f"{table['decode_roofline_tokens_per_s']:.0f} tokens/s (compute {compute_bound_s * 1e3:.1f} ms a step) | "
          f"{decode_tokens_per_s / table['decode_bandwidth_bound_tokens_per_s']:.0%} of the bandwidth bound, "
          f"{decode_tokens_per_s / table['decode_roofline_tokens_per_s']:.0%} of the roofline |")
    print(f"| weight push ({push_bytes / 1e6:.0f} MB) | {push_s * 1e3:.0f} ms = {push_bytes / push_s / 1e6:.0f} MB/s | "
          f"memcpy {memory['weights_memcpy_bytes_per_s'] / 1e6:.0f} MB/s | "
          f"{push_bytes / push_s / memory['weights_memcpy_bytes_per_s']:.0%} |")
    print(f"| whole step | {step_s:.2f} s | | |")


if __name__ == "__main__":
    main()
