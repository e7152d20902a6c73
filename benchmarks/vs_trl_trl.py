"""The TRL side of benchmarks/vs_trl.py: TRL's GRPOTrainer on the same task, in .venv-trl.

Run by vs_trl.py (not by hand): .venv-trl/bin/python benchmarks/vs_trl_trl.py --workdir W --steps 50 --out R.json
It imports no rlpipe (TRL is not an rlpipe dependency, and rlpipe is not installed in .venv-trl); it
loads the model, tokenizer and prompts vs_trl.py saved in W and writes per-step wall-clock stamps,
mean rewards and mean completion lengths to R.json.

Settings matched to rlpipe's run (vs_trl.PIPELINE): fp32 (bf16 off), no gradient checkpointing
(TRL turns it on by default), AdamW lr 1e-3 constant, grad clip 1.0, clip ε 0.2, loss_type "dapo"
(token-mean over the batch), beta 0 (no KL, no reference model), one iteration per generation
(π_old = the detached current logprobs: no extra forward), temperature 1, no top-k/top-p,
group-std-scaled advantages, 16 prompts × 8 generations × at most 8 new tokens, MLflow on.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def digits_reward(completions, ground_truth, **kwargs) -> list[float]:
    """Positional matches / max(len(target), len(response)) — the scoring rlpipe's `digits` scorer does."""
    scores = []
    for response, target in zip(completions, ground_truth):
        response = "".join(response.split())
        matched = sum(a == b for a, b in zip(response, target))
        scores.append(matched / max(len(target), len(response), 1) if target else 0.0)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--no-mlflow", action="store_true")
    parser.add_argument("--generations", type=int, default=8, help="samples per prompt")
    parser.add_argument("--batch", type=int, default=128, help="rows per step (prompts x generations)")
    parser.add_argument("--new-tokens", type=int, default=8, help="most new tokens per response")
    parser.add_argument("--full-length", action="store_true", help="every response runs to --new-tokens")
    parser.add_argument("--bf16", action="store_true", help="TRL's default bf16 autocast (off: fp32, as rlpipe's default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling and prompt-order seed (the model is the saved one)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(args.workdir / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.workdir / "model")
    data = load_dataset("json", data_files=str(args.workdir / "data.jsonl"), split="train")
    stamps: list[float] = []
    rewards: list[float] = []
    lengths: list[float] = []

    class Record(TrainerCallback):
        def on_step_end(self, *a, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                lengths.append(float(logs.get("completions/mean_length", float("nan"))))

    config = GRPOConfig(
        output_dir=str(args.workdir / "out-trl"), use_cpu=True, bf16=args.bf16, gradient_checkpointing=False,
        max_steps=args.steps, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.new_tokens, temperature=1.0,
        generation_kwargs={"min_new_tokens": args.new_tokens} if args.full_length else None, top_k=0, top_p=1.0, learning_rate=1e-3,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, epsilon=0.2, loss_type="dapo", beta=0.0,
        num_iterations=1, logging_steps=1, report_to=[] if args.no_mlflow else ["mlflow"], save_strategy="no", seed=args.seed, disable_tqdm=True,
    )
    generate_s: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """Times TRL's generation phase (generate, score, advantages) per step; the rest of a step trains."""

        def _generate_and_score_completions(self, *a, **kw):
            start = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **kw)
            finally:
                generate_s.append(time.perf_counter() - start)

    trainer = TimedGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=digits_reward, args=config,
                               train_dataset=data, callbacks=[Record()])
    trainer.train()
    args.out.write_text(json.dumps({"stamps": stamps, "rewards": rewards, "completion_lengths": lengths,
                                    "phases": {"generate_and_score": generate_s}, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
