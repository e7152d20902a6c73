"""trainer.backend megatron vs the torch trainer on one GPU: same weights, same batch, same PPO update.

Builds both trainer ranks the way a run does (``TrainState`` with ``trainer.backend: replicated`` and
``MegatronTrainState`` with ``trainer.backend: megatron``) from the same randomly initialized
Qwen2/Llama model (``model.architecture``, byte-level vocabulary), makes one random batch
(prompts and responses of the given lengths, random advantages), then on both:

* π_old logprobs (old_log_prob/trainer: megatron's forward-only schedule vs eager forwards);
* one PPO update (update/ppo: megatron's schedule with the injected loss, its distributed
  optimizer) → loss and grad norm, which must agree to bf16 tolerance (``--rtol``, default 2e-2);
* ``--repeats`` more updates timed → trained tokens per second (prompt + response tokens through
  forward, backward and optimizer step).

Prints one JSON line (also to ``$OUT/gpu_check.json`` when ``OUT`` is set). Needs CUDA and
megatron-core; run by benchmarks/gpu_check.sh, which lists the wheels.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import torch


def pipeline_config(args, backend: str):
    from rlpipe.schemas.config import (
        ArchitectureConfig, DataConfig, ModelConfig, OptimizerConfig, PipelineConfig, ResourcesConfig, TokenizerConfig,
        TrainerConfig,
    )

    arch = ArchitectureConfig(family=args.family, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                              num_kv_heads=args.kv_heads, intermediate_size=args.ffn,
                              max_position_embeddings=args.prompt_len + args.response_len)
    trainer = TrainerConfig(backend=backend, total_steps=args.repeats + 1, micro_batch_size=args.micro, grad_clip=1.0,
                            optimizer=OptimizerConfig(lr=1e-5))
    return PipelineConfig(model=ModelConfig(architecture=arch, dtype=args.dtype), tokenizer=TokenizerConfig(byte_level=True),
                          data=DataConfig(prompts_per_step=args.rows), trainer=trainer,
                          resources=ResourcesConfig(device=args.device), stages=[])


def random_batch(args, vocab: int) -> pa.Table:
    rng = np.random.default_rng(1)
    lens_p = rng.integers(args.prompt_len // 2, args.prompt_len + 1, args.rows)
    lens_r = rng.integers(args.response_len // 2, args.response_len + 1, args.rows)
    ids = lambda n: rng.integers(3, vocab, n).astype(np.int32).tolist()  # noqa: E731
    return pa.table({
        "prompt_ids": pa.array([ids(n) for n in lens_p], pa.list_(pa.int32())),
        "response_ids": pa.array([ids(n) for n in lens_r], pa.list_(pa.int32())),
        "response_mask": pa.array([[1] * n for n in lens_r], pa.list_(pa.int8())),
        "advantages": pa.array([rng.normal(size=n).astype(np.float32).tolist() for n in lens_r], pa.list_(pa.float32())),
    })  # fmt: skip


def update(state, table) -> dict[str, float]:
    from rlpipe.stage import StageContext, stage_registry

    spec = stage_registry("update").get("ppo")
    return spec.fn(state, table, spec.params_model(), StageContext(step=0, seed=0)).metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=["qwen2", "llama"], default="qwen2")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rtol", type=float, default=2e-2, help="relative tolerance of loss and grad norm (bf16)")
    ap.add_argument("--backends", default="torch,megatron", help="comma-separated; torch alone also runs on CPU")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    backends = args.backends.split(",")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA device (--device cpu --backends torch checks the script itself)")
    from rlpipe.engine.state.train_state import TrainState
    from rlpipe.stages.logprobs import score_batch

    states = {"torch": TrainState(pipeline_config(args, "replicated"), 0, 1, None)}
    if "megatron" in backends:
        from rlpipe.engine.state.megatron_state import MegatronTrainState

        states["megatron"] = MegatronTrainState(pipeline_config(args, "megatron"), 0, 1, None)
    table = random_batch(args, states["torch"].model.config.vocab_size)
    old = score_batch(states["torch"].model, table, 0, 1.0, args.micro)
    # π_old off by a little from the current policy: ratios ≠ 1 and some clipped, so the loss depends on the logits
    noise = np.random.default_rng(2).normal(0.0, 0.2, len(old.values)).astype(np.float32)
    old_np = pa.ListArray.from_arrays(old.offsets, pa.array(old.values.to_numpy() + noise))
    table = table.append_column("old_logprobs", old_np)
    result: dict = {"torch": torch.__version__, "args": vars(args),
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    if "megatron" in states:
        mg_old = score_batch(states["megatron"].model, table, 0, 1.0, args.micro,
                             forward_passes=states["megatron"].forward_passes)
        result["old_logprob_max_abs_diff"] = float(np.abs(old.values.to_numpy() - mg_old.values.to_numpy()).max())
    lengths = lambda col: pa.compute.list_value_length(table.column(col)).to_numpy()  # noqa: E731
    tokens = int(lengths("prompt_ids").sum() + lengths("response_ids").sum())
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for name, state in states.items():
        first = update(state, table)
        result[f"{name}_pg_loss"], result[f"{name}_grad_norm"] = first["actor/pg_loss"], first["actor/grad_norm"]
        sync()
        start = time.perf_counter()
        for _ in range(args.repeats):
            update(state, table)
        sync()
        result[f"{name}_tokens_per_s"] = args.repeats * tokens / (time.perf_counter() - start)
    if "megatron" in states:
        for key in ("pg_loss", "grad_norm"):
            ref = result[f"torch_{key}"]
            result[f"{key}_rel_diff"] = abs(result[f"megatron_{key}"] - ref) / max(abs(ref), 1e-12)
        result["agree"] = result["pg_loss_rel_diff"] < args.rtol and result["grad_norm_rel_diff"] < args.rtol
    line = json.dumps(result)
    print(line)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as f:
            f.write(line + "\n")
    if result.get("agree") is False:
        raise SystemExit(f"megatron and torch disagree beyond rtol {args.rtol}: {line}")

if __name__ == "__main__":
    main()
