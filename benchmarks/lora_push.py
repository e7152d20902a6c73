"""Weight push with trainer.lora vs full fine-tuning (issue 27): bytes a push carries and its time.

The model is vs_trl.py's compute size (a 24.1M-parameter Qwen2: hidden 512, 8 layers, 8/2 heads, MLP 1536) and,
with ``--size small``, the toy one. For each of full and LoRA (rank 8, every projection) a trainer and an
embedded rollout engine are built in this process, and each push goes the way it goes between Ray actors:
the trainer exports checksummed buckets (``export_for_push``), the engine loads them (``push_weights``: for
LoRA, ``W0 + scale·B·A`` recomputed from its kept base). One optimizer step before every push so the
adapters are not zero. Full and LoRA pushes alternate, ``--repeats`` times; medians per variant.

    .venv/bin/python benchmarks/lora_push.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from rlpipe.engine.state.roles import RolloutState
from rlpipe.engine.state.train_state import TrainState
from rlpipe.schemas.config import (ArchitectureConfig, ModelConfig, OptimizerConfig, PipelineConfig, TokenizerConfig,
                                   TrainerConfig)

SIZES = {
    "compute": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536,
                    max_position_embeddings=256),
    "small": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                  max_position_embeddings=64),
}
IDS = torch.arange(3, 67).view(2, 32) % 19


def build(size: str, lora: dict | None) -> tuple[TrainState, RolloutState]:
    config = PipelineConfig(model=ModelConfig(architecture=ArchitectureConfig(**SIZES[size])),
                            tokenizer=TokenizerConfig(chars="0123456789=rev:+-*/"),
                            trainer=TrainerConfig(optimizer=OptimizerConfig(lr=1e-3), lora=lora), stages=[], seed=0)
    return TrainState(config, 0, 1, None), RolloutState(config, 0, 1, None)


def push_once(trainer: TrainState, rollout: RolloutState) -> dict[str, float]:
    trainer.model(input_ids=IDS).logits.logsumexp(-1).mean().backward()
    trainer.optimizer_step()
    start = time.perf_counter()
    stats = rollout.push_weights(trainer.export_for_push(), trainer.bump_version())
    return {"push_s": time.perf_counter() - start, "bytes": float(stats["bytes"]),
            "full_model_bytes": float(stats.get("full_model_bytes", stats["bytes"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="compute")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "lora_push.json"))
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    variants = {"full": build(args.size, None),
                f"lora_r{args.rank}": build(args.size, {"rank": args.rank, "alpha": 2 * args.rank})}
    for trainer, rollout in variants.values():
        push_once(trainer, rollout)  # warm-up: first allocations, first checksum
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    loads = []
    for _ in range(args.repeats):  # interleaved
        loads.append(os.getloadavg()[0])
        for name, (trainer, rollout) in variants.items():
            runs[name].append(push_once(trainer, rollout))
    full_bytes = runs["full"][0]["bytes"]
    table = {name: {"bytes": r[0]["bytes"], "share_of_full": r[0]["bytes"] / full_bytes,
                    "push_ms_median": 1e3 * statistics.median(x["push_s"] for x in r),
                    "push_ms_all": [round(1e3 * x["push_s"], 1) for x in r]} for name, r in runs.items()}
    result = {"size": args.size, "rank": args.rank, "params": sum(p.numel() for p in variants["full"][0].model.parameters()),
              "load_at_each_repeat": [round(x, 2) for x in loads], "variants": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"model {args.size}: {result['params']:,} parameters; load at each repeat {result['load_at_each_repeat']}")
    print("| variant | bytes a push | share of full | push (median) | pushes (ms) |\n|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['bytes'] / 1e6:.2f} MB | {100 * row['share_of_full']:.2f}% | "
              f"{row['push_ms_median']:.1f} ms | {', '.join(map(str, row['push_ms_all']))} |")


if __name__ == "__main__":
    main()
