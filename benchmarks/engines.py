"""Rollout engines compared through the engine contract: generation tokens/s and weight-push MB/s.

Run: .venv/bin/python benchmarks/engines.py [--engines embedded,vllm,sglang] [--sizes quickstart,50m]
Writes benchmarks/results/engines.json and prints a Markdown table (copied into docs/benchmarks.md).

Every engine is built exactly as a rollout replica builds it (``build_engine`` with the
generate stage's params), so the numbers include what a run pays: HTTP and the server
process for ``vllm`` / ``sglang`` (the latter is rlpipe's embedded engine behind SGLang's
protocol on this CPU-only machine), nothing for ``embedded``.

1. Generation: ``--sequences`` prompts × ``--tokens`` new tokens (ignore_eos, so every
   engine produces the same token count), submitted at once; tokens/s = generated tokens
   / wall time of ``generate()``, median of ``--repeats`` after one warm-up call.
2. Weight push: ``load_weights`` of the model's own buckets (export → the engine's
   parameters, transport and cache reset included), vs a plain ``memcpy`` (numpy copy)
   of the same bytes; MB/s = bytes / seconds, median of ``--repeats``.

Models are made from config (no downloads): ``quickstart`` is the quickstart_vllm model
(hidden 128, 2 heads of 64, 1 KV head, 2 layers: vLLM's CPU attention needs head_dim ≥ 32);
``50m`` is a Qwen2 of ~50M parameters (hidden 768, 8 layers, 12 heads, 4 KV heads, MLP 2048).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]

SIZES = {
    "quickstart": dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256,
                       max_position_embeddings=256),
    "50m": dict(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                max_position_embeddings=256),
}


def build(engine: str, size: str, workdir: str):
    """The engine and its model, as a rollout replica would build them."""
    import torch

    from rlpipe.backends.model import build_model
    from rlpipe.backends.tokenizer import build_tokenizer
    from rlpipe.inference.engines import EngineInputs, build_engine
    from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig
    from rlpipe.stage import stage_registry

    torch.manual_seed(0)
    tokenizer = build_tokenizer(TokenizerConfig(byte_level=True))
    model = build_model(ModelConfig(architecture=ArchitectureConfig(**SIZES[size])), tokenizer, seed=0)
    params = stage_registry("generate").get(engine).params_model()
    inputs = EngineInputs(model, tokenizer, params, 0, os.path.join(workdir, f"{engine}-{size}"), f"bench {engine}")
    return build_engine(engine, inputs), model


def generation(engine, sequences: int, tokens: int, repeats: int) -> dict:
    from rlpipe.inference.contract import GenerationRequest, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 250, 16).tolist() for _ in range(sequences)]
    sampling = SamplingParams(temperature=1.0, seed=1, ignore_eos=True)

    def once(tag: str) -> float:
        requests = [GenerationRequest(f"{tag}/{i}", p, tokens, sampling) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        results = engine.generate(requests)
        elapsed = time.perf_counter() - start
        produced = sum(len(r.response_ids) for r in results)
        assert produced == sequences * tokens, f"expected {sequences * tokens} tokens, got {produced}"
        return elapsed

    once("warmup")
    times = [once(f"r{k}") for k in range(repeats)]
    median = statistics.median(times)
    return {"median_s": median, "tokens_per_s": sequences * tokens / median, "times_s": times}


def weight_push(engine, model, repeats: int) -> dict:
    from rlpipe.backends.weights import export_buckets

    buckets = export_buckets(model)
    nbytes = sum(b.nbytes for b in buckets)
    version = getattr(engine, "version", 0)
    pushes, boundaries = [], []
    for k in range(repeats):
        start = time.perf_counter()
        boundaries.append(engine.load_weights(buckets, version + k + 1))
        pushes.append(time.perf_counter() - start)
    src = np.concatenate([b.data for b in buckets])
    dst = np.empty_like(src)
    copies = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - start)
    push_s, copy_s = statistics.median(pushes), statistics.median(copies)
    return {"bytes": nbytes, "push_s": push_s, "push_mb_per_s": nbytes / 1e6 / push_s,
            "memcpy_mb_per_s": nbytes / 1e6 / copy_s, "boundaries_last_push": boundaries[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="embedded,vllm,sglang")
    parser.add_argument("--sizes", default="quickstart,50m")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of this process")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-engines-") as workdir:
        for size in args.sizes.split(","):
            for name in args.engines.split(","):
                engine, model = build(name, size, workdir)
                try:
                    params = sum(p.numel() for p in model.parameters())
                    row = {"engine": name, "size": size, "parameters": params,
                           **{f"gen_{k}": v for k, v in generation(engine, args.sequences, args.tokens,
                                                                   args.repeats).items()},
                           **{f"push_{k}": v for k, v in weight_push(engine, model, args.repeats).items()}}
                finally:
                    engine.close()
                rows.append(row)
                print(f"{size:>10} {name:>9}: {row['gen_tokens_per_s']:9.0f} tok/s  push "
                      f"{row['push_push_mb_per_s']:8.1f} MB/s (memcpy {row['push_memcpy_mb_per_s']:.0f})", flush=True)
    out = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "load_avg": os.getloadavg(),
           "sequences": args.sequences, "tokens": args.tokens, "repeats": args.repeats, "rows": rows}
    path = ROOT / "benchmarks/results/engines.json"
    path.write_text(json.dumps(out, indent=2, default=float))
    print(f"\n| model | params | engine | gen tokens/s ({args.sequences}×{args.tokens}) | push MB/s | memcpy MB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['parameters'] / 1e6:.1f}M | {r['engine']} | {r['gen_tokens_per_s']:.0f} | "
              f"{r['push_push_mb_per_s']:.0f} | {r['push_memcpy_mb_per_s']:.0f} |")
    print(f"\nwrote {path}; load average while measuring {os.getloadavg()}")


if __name__ == "__main__":
    main()
