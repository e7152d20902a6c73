"""rlpipe vs TRL's GRPOTrainer on equal work: tokens/s and reward per step.

Run: make bench-trl   (builds .venv-trl with TRL, then runs this file with .venv's python)
     .venv/bin/python benchmarks/vs_trl.py --repeats 3 --steps 50
Writes benchmarks/results/vs_trl.json and prints a Markdown table (copied into docs/benchmarks.md).

The task (issue 12): a 125k-parameter Qwen2 made from config (hidden 64, 2 layers, 4 query /
2 key-value heads, MLP 256, tied embeddings, fp32, random init with one seed, saved once and
loaded by both), a character vocabulary, 4-digit reversal prompts ``rev:DDDD=`` (9 tokens) with
partial credit per digit, 16 prompts × 8 samples × at most 8 new tokens per step, AdamW lr 1e-3,
grad clip 1.0, PPO clip 0.2, token-mean loss, no KL (no reference model), π_old = the rollout's
logprobs (no extra forward), 50 steps, MLflow tracking on (a sqlite store per run).

Variants: TRL (``benchmarks/vs_trl_trl.py`` in .venv-trl: TRL is not an rlpipe dependency) at its own
defaults (torch's thread count, no tracking callback: ``trl``) and with its MLflow callback
(``trl_mlflow``); rlpipe at its defaults (``trainer.torch_threads`` unset: rlpipe.engine.host picks it,
and the table shows the number) with MLflow on: inline sync (no Ray), sync on Ray (trainer and rollout
engine in Ray actors of their own, and ``ray_colocated``: in one, ``resources.colocate``), separate_async on
Ray (staleness threshold 2: one step off-policy, the overlap async training exists for). ``--threads N``
holds every variant to N threads instead. Each run is its own process, the variants are interleaved
(one run of each per repeat), each run starts once the 1-minute load average is below ``--max-load``
(the load at each start is in the table; a run that waited in vain is flagged), and the table shows
medians over repeats of each run's median step time (first ``--warmup`` steps excluded) and of the
step's parts: TRL's generation phase (``_generate_and_score_completions``: generate, score, advantages;
the rest of its step trains), rlpipe's generate and update nodes (lineage timings).
tokens/s = 128 × (prompt tokens + mean completion length of the run) / median step time,
so a framework whose completions stop earlier is not credited with tokens it did not make.
Repeat r runs every variant with seed r (sampling and prompt order; the starting weights are the
saved model's): a run is deterministic given its seed, so the reward columns (mean reward of steps
1-5, of all steps, of the last 10; medians over repeats) compare learning over as many trajectories
as there are repeats, not replays of one.

``--linearity``: rlpipe's cost against the size of the work (issue 12: linear in batch size and
response length). Inline sync (``--variants`` picks others) at 4 batch sizes (4, 8, 16, 32 prompts
× 8 samples, 8 new tokens) and 4 response lengths (4, 8, 16, 32 new tokens, 16 prompts); per size
the median step time and the cost per token (step time / (rows × (prompt + completion tokens))).
Writes benchmarks/results/vs_trl_linearity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dataclasses import asdict, dataclass, field

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRL_PY = ROOT / ".venv-trl/bin/python"
CHARS = "0123456789=rev:"
PROMPTS, SAMPLES, NEW_TOKENS, PROMPT_TOKENS = 16, 8, 8, 9


@dataclass(frozen=True)
class Workload:
    """The size of the job: the model and how much each step generates and trains on."""

    arch: dict = field(default_factory=dict)
    """ArchitectureConfig fields of the Qwen2 model both frameworks load."""
    prompts: int = PROMPTS
    samples: int = SAMPLES
    new_tokens: int = NEW_TOKENS
    full_length: bool = False
    """Every response runs to new_tokens (rlpipe: ignore_eos; TRL: min_new_tokens): a fixed amount of work."""


WORKLOADS = {
    # issue 12's job: a 125k-parameter model, where a step is mostly per-call overhead
    "toy": Workload(arch=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                              max_position_embeddings=64)),
    # issue 28's compute-bound size: ~24M parameters, 32 prompts x 4 samples x 128 new tokens
    "compute": Workload(arch=dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536,
                                  max_position_embeddings=160), prompts=32, samples=4, new_tokens=128,
                        full_length=True),
}
VARIANTS = ("trl", "trl_mlflow", "inline", "ray_sync", "ray_colocated", "separate_async")
TRL_VARIANTS = ("trl", "trl_mlflow")

PIPELINE = """\
name: vs-trl-{variant}
seed: {seed}
mode: {mode}
{mode_params}
{resources}
model: {{path: {model}{rollout_dtype}}}
tokenizer: {{path: {model}}}
data:
  source: jsonl
  params: {{path: {data}, data_source: digits}}
  prompts_per_step: {prompts}
  max_prompt_length: 16
trainer:
  total_steps: {steps}
  micro_batch_size: 128
  optimizer: {{lr: 1.0e-3}}
  grad_clip: 1.0
{threads_line}{precision_line}  output_dir: {out}
stages:
  - {{kind: generate, impl: embedded, params: {{n: {samples}, max_tokens: {max_tokens}, temperature: 1.0, ignore_eos: {full_length}}}}}
  - {{kind: reward, impl: rule}}
{guard}  - {{kind: balance, impl: tokens}}
  - {{kind: old_log_prob, impl: bypass}}
  - {{kind: advantage, impl: grpo}}
  - {{kind: update, impl: ppo, params: {{policy_loss: vanilla, loss_agg_mode: token-mean, clip_ratio: 0.2}}}}
  - {{kind: weight_sync, impl: object_store}}
"""


def prepare(workdir: Path, seed: int = 0, size: str = "toy") -> None:
    """The shared model of workload ``size`` (random init, saved once), tokenizer and prompt file."""
    from rlpipe.backends.model import build_model, save_hf_model
    from rlpipe.backends.tokenizer import build_tokenizer
    from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig

    tokenizer = build_tokenizer(TokenizerConfig(chars=CHARS))
    arch = ArchitectureConfig(family="qwen2", tie_word_embeddings=True, **WORKLOADS[size].arch)
    model = build_model(ModelConfig(architecture=arch), tokenizer, seed)
    save_hf_model(model, tokenizer, workdir / "model")
    rng = np.random.default_rng(seed)
    digits = rng.integers(0, 10, size=(4096, 4))
    with open(workdir / "data.jsonl", "w") as f:
        for row in digits:
            text = "".join(map(str, row))
            f.write(json.dumps({"prompt": f"rev:{text}=", "ground_truth": text[::-1]}) + "\n")
    params = sum(p.numel() for p in model.parameters())
    (workdir / "meta.json").write_text(json.dumps({"params": params, "vocab": len(tokenizer), "size": size,
                                                   "workload": asdict(WORKLOADS[size])}))


def workload_of(workdir: Path) -> Workload:
    """The workload ``prepare`` saved the model of ``workdir`` for."""
    return WORKLOADS[json.loads((workdir / "meta.json").read_text()).get("size", "toy")]


def run_rlpipe(variant: str, workdir: Path, steps: int, threads: int, prompts: int | None = None,
               max_tokens: int | None = None, seed: int = 0, precision: str = "fp32") -> dict:
    """One rlpipe run in this process; per-step wall-clock stamps, rewards and completion lengths."""
    work = workload_of(workdir)
    prompts, max_tokens = prompts or work.prompts, max_tokens or work.new_tokens
    from rlpipe.engine.planning.config_io import load_pipeline
    from rlpipe.engine.runtime import run_pipeline

    mode = "separate_async" if variant == "separate_async" else "sync"
    asynchronous = mode == "separate_async"
    text = PIPELINE.format(
        variant=variant, seed=seed, mode=mode, steps=steps, model=workdir / "model", prompts=prompts,
        threads_line=f"  torch_threads: {threads}\n" if threads else "",  # 0: rlpipe's own choice (rlpipe.engine.host)
        precision_line="  mixed_precision: bf16\n" if precision == "bf16" else "",
        rollout_dtype=", rollout_dtype: bfloat16" if precision == "bf16" else "",
        max_tokens=max_tokens, samples=work.samples, full_length=str(work.full_length).lower(),
        data=workdir / "data.jsonl", out=workdir / f"out-{variant}",
        # rlpipe counts staleness as consuming step - submission step + 1, so threshold 1 is on-policy (a batch's
        # prompts are submitted at the step that trains on them: nothing to overlap); 2 lets the rollout generate the
        # next step's batch with the weights one push behind while the trainer updates (verl's one-step off-policy)
        mode_params="mode_params: {max_off_policy_threshold: 2, strategy: wait, capacity_steps: 2}" if asynchronous else "",
        guard="  - {kind: staleness_guard, impl: max_staleness}\n" if asynchronous else "",
        # verl's hybrid engine: the trainer and the rollout engine in one Ray actor
        resources="resources: {colocate: [[actor, rollout]]}" if variant == "ray_colocated" else "",
    )
    path = workdir / f"{variant}.yaml"
    path.write_text(text)
    config, yaml_text = load_pipeline(path)
    stamps, rewards, lengths, phases, pushes = [], [], [], {}, {}

    def on_step(step, metrics):
        stamps.append(time.perf_counter())
        rewards.append(metrics.get("reward/mean", float("nan")))
        lengths.append(metrics.get("generate/response_length_mean", float("nan")))
        for key, value in metrics.items():  # per-node wall time of the step (separate_async: the trainer's nodes)
            if key.startswith("timing/") and key.endswith("_s"):
                phases.setdefault(key[len("timing/"):-2], []).append(value)
            elif key.startswith("weight_sync/"):  # what benchmarks/limits.py reads: bytes and push times
                pushes.setdefault(key, []).append(value)

    from rlpipe.engine.host import run_thread_budget
    from rlpipe.engine.planning.plan import build_plan

    threads = run_thread_budget(config, build_plan(config), inline=variant == "inline")[1]
    run_pipeline(config, yaml_text, on_step=on_step, inline=variant == "inline")
    return {"stamps": stamps, "rewards": rewards, "completion_lengths": lengths, "phases": phases, "pushes": pushes,
            "threads": threads.threads, "threads_reason": threads.reason}


def one_run(variant: str, workdir: Path, steps: int, threads: int, compare_root: Path | None,
            size: tuple[int, int] | None = None, seed: int = 0, precision: str = "fp32") -> dict:
    """A fresh process per run (no warm caches carried between variants).

    ``<variant>@before`` runs the rlpipe checkout at ``compare_root`` instead of this one (its own
    ``benchmarks/vs_trl.py``, imported first through PYTHONPATH): a before/after table in one
    interleaved measurement."""
    out = workdir / f"result-{variant}.json"
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{workdir}/mlflow-{variant}.db",
               MLFLOW_DISABLE_TELEMETRY="true", RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    name, _, before = variant.partition("@")
    script = Path(__file__).resolve()
    if before:
        script = compare_root / "benchmarks/vs_trl.py"
        env["PYTHONPATH"] = str(compare_root)
    if name in TRL_VARIANTS:
        work = workload_of(workdir)
        cmd = [str(TRL_PY), str(ROOT / "benchmarks/vs_trl_trl.py"), "--workdir", str(workdir), "--steps", str(steps),
               "--out", str(out), "--threads", str(threads), "--seed", str(seed), "--generations", str(work.samples),
               "--batch", str(work.prompts * work.samples), "--new-tokens", str(work.new_tokens)]
        if work.full_length:
            cmd.append("--full-length")
        if precision == "bf16":  # TRL's own default (GRPOConfig.bf16 = not fp16): autocast, fp32 master weights
            cmd.append("--bf16")
        if name == "trl":  # TRL's own default: no tracking callback
            cmd.append("--no-mlflow")
    else:
        if before and not threads:
            threads = 1  # a checkout from before trainer.torch_threads could be left unset: its default, 1
        cmd = [sys.executable, str(script), "--child", name, "--workdir", str(workdir), "--steps", str(steps),
               "--threads", str(threads), "--out", str(out), "--seed", str(seed)]
        if precision != "fp32":
            cmd += ["--precision", precision]
        if size:  # (prompts, new tokens) of a --linearity run
            cmd += ["--prompts", str(size[0]), "--max-tokens", str(size[1])]
    with open(workdir / f"log-{variant}.txt", "a") as log:  # the child's chatter, kept for a failed run
        subprocess.run(cmd, check=True, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    result = json.loads(out.read_text())
    result.setdefault("threads", threads)  # an older checkout's child does not report it
    return result


def summarize(run: dict, warmup: int, work: Workload = WORKLOADS["toy"]) -> dict:
    steps = np.diff(np.asarray(run["stamps"]))[warmup:]
    step_s = float(np.median(steps))
    lengths = np.asarray(run["completion_lengths"], dtype=float)
    # NaN for separate_async (no per-step length), filled in by _fill_async_lengths
    completion = float(np.nanmean(lengths)) if np.isfinite(lengths).any() else float("nan")
    phases = {name: float(np.median(values[warmup:] or values)) for name, values in run.get("phases", {}).items()}
    return {"step_s": step_s, "completion_len": completion,
            "tokens_per_s": work.prompts * work.samples * (PROMPT_TOKENS + completion) / step_s,
            "reward_first5": float(np.mean(run["rewards"][:5])), "reward_mean": float(np.mean(run["rewards"])),
            "reward_last10": float(np.mean(run["rewards"][-10:])),
            "rewards": run["rewards"], "phases_s": phases, "threads": run.get("threads"),
            "pushes": {k: float(np.median(v[warmup:] or v)) for k, v in run.get("pushes", {}).items()},
            "threads_reason": run.get("threads_reason")}


def phase_text(variant: str, phases: dict[str, float]) -> str:
    """The step's parts: TRL's generation phase and the rest (its training); rlpipe's generate and update nodes
    and the rest of the nodes together."""
    if not phases:
        return "–"
    if variant.partition("@")[0] in TRL_VARIANTS:
        return f"generate+score {phases.get('generate_and_score', float('nan')) * 1e3:.0f} ms"
    rest = sum(v for k, v in phases.items() if k not in ("generate", "update"))
    parts = [f"{k} {phases[k] * 1e3:.0f}" for k in ("generate", "update") if k in phases]
    return ", ".join(parts + [f"other nodes {rest * 1e3:.0f} ms"])


def wait_for_quiet(max_load: float, wait_s: float) -> tuple[float, bool]:
    """Wait (at most ``wait_s``) until the 1-minute load average is below ``max_load``; the load average at the
    start and whether it was quiet."""
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(5)
    load = os.getloadavg()[0]
    return load, load < max_load


def _fill_async_lengths(runs: dict[str, list[dict]], work: Workload) -> None:
    """separate_async reports no per-step completion length (generation runs in the rollout service):
    its tokens/s uses the median completion length of the sync rlpipe runs (same model, seed and sampler)."""
    for variant, rs in runs.items():
        name, _, before = variant.partition("@")
        sync = [r["completion_len"] for v in (f"inline{'@' + before if before else ''}",
                                               f"ray_sync{'@' + before if before else ''}") for r in runs.get(v, [])]
        for r in rs:
            if np.isnan(r["completion_len"]) and sync:
                r["completion_len"] = float(np.median(sync))
                r["tokens_per_s"] = work.prompts * work.samples * (PROMPT_TOKENS + r["completion_len"]) / r["step_s"]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


BATCH_SIZES = (4, 8, 16, 32)
"""Prompts per step of the --linearity batch-size series (× 8 samples, 8 new tokens)."""
RESPONSE_LENGTHS = (4, 8, 16, 32)
"""Most new tokens of the --linearity response-length series (16 prompts × 8 samples)."""


def linearity(args: argparse.Namespace) -> None:
    """Step time and cost per token against batch size and response length; interleaved over repeats."""
    variants = [v for v in args.variants.split(",") if v != "trl"] if args.variants != ",".join(VARIANTS) else ["inline"]
    sizes = [("batch", (p, NEW_TOKENS)) for p in BATCH_SIZES] + [("length", (PROMPTS, t)) for t in RESPONSE_LENGTHS]
    workdir = Path(tempfile.mkdtemp(prefix="vs_trl_lin_"))
    prepare(workdir)
    runs: dict[str, list[dict]] = {}
    loads = [load_average()]
    for repeat in range(args.repeats):
        for variant in variants:
            for series, (prompts, tokens) in sizes:
                key = f"{variant}/{series}/{prompts}x{tokens}"
                run = summarize(one_run(variant, workdir, args.steps, args.threads, None, (prompts, tokens)), args.warmup)
                rows = prompts * SAMPLES
                run.update(prompts=prompts, max_tokens=tokens, rows=rows,
                           s_per_token=run["step_s"] / (rows * (PROMPT_TOKENS + run["completion_len"])))
                runs.setdefault(key, []).append(run)
                loads.append(load_average())
                print(f"repeat {repeat} {key}: {run['step_s'] * 1e3:.0f} ms/step", file=sys.stderr)
    table = {k: {f: float(np.median([r[f] for r in rs])) for f in ("step_s", "completion_len", "s_per_token")}
             | {f: rs[0][f] for f in ("prompts", "max_tokens", "rows")} for k, rs in runs.items()}
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "steps": args.steps, "repeats": args.repeats,
              "warmup": args.warmup, "load_average_1_5_15": loads, "median": table, "runs": runs}
    (ROOT / "benchmarks/results/vs_trl_linearity.json").write_text(json.dumps(result, indent=2))
    print(f"load average (1/5/15 min) during the runs: {loads[0]} … {loads[-1]}")
    print("| run | rows | new tokens (max) | completion len | step (median) | µs per token |")
    print("|---|---|---|---|---|---|")
    for key, row in table.items():
        print(f"| {key} | {row['rows']} | {row['max_tokens']} | {row['completion_len']:.2f} | "
              f"{row['step_s'] * 1e3:.0f} ms | {row['s_per_token'] * 1e6:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads of every variant; 0 (the default): each framework's own default "
                             "(TRL: torch's, all cores; rlpipe: trainer.torch_threads unset, rlpipe.engine.host)")
    parser.add_argument("--max-load", type=float, default=1.0,
                        help="a run starts once the 1-minute load average is below this (waiting at most "
                             "--load-wait-s); a run that started above it is flagged in the results")
    parser.add_argument("--load-wait-s", type=float, default=180.0)
    parser.add_argument("--compare-root", type=Path,
                        help="an older rlpipe checkout (with rlpipe/stages and rlpipe/schemas linked to its stages/ and "
                             "schemas/): adds <variant>@before for each rlpipe variant")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--size", choices=sorted(WORKLOADS), default="toy",
                        help="the workload: toy (issue 12's 125k-parameter job) or compute (~24M parameters, 32 x 4 x "
                             "128 tokens; --compare-root checkouts older than this option run the toy job)")
    parser.add_argument("--linearity", action="store_true",
                        help="step time and cost per token at 4 batch sizes and 4 response lengths (rlpipe inline "
                             "unless --variants names others)")
    parser.add_argument("--child", choices=VARIANTS[len(TRL_VARIANTS):], help=argparse.SUPPRESS)  # one run, here
    parser.add_argument("--prompts", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="fp32 (both frameworks in float32) or bf16: the trainers' forward passes under bfloat16 "
                             "autocast with float32 master weights (TRL: bf16=True, its default, which generates "
                             "with the same model under autocast; rlpipe: trainer.mixed_precision: bf16 and a "
                             "bfloat16 rollout copy, model.rollout_dtype)")
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.out.write_text(json.dumps(run_rlpipe(args.child, args.workdir, args.steps, args.threads, args.prompts,
                                                  args.max_tokens, args.seed, args.precision)))
        return
    if args.linearity:
        linearity(args)
        return
    variants = args.variants.split(",")
    if args.compare_root:
        variants += [f"{v}@before" for v in variants if v not in TRL_VARIANTS]
    workdir = Path(tempfile.mkdtemp(prefix="vs_trl_"))
    prepare(workdir, size=args.size)
    work = WORKLOADS[args.size]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants:  # interleaved: load drifts hit every variant alike
            load, quiet = wait_for_quiet(args.max_load, args.load_wait_s)
            # repeat r samples (and orders the prompts) with seed r in every variant: the rewards compare learning
            # over 3 trajectories, not 3 replays of one (a run is deterministic given its seed)
            run = summarize(one_run(variant, workdir, args.steps, args.threads, args.compare_root, seed=repeat,
                                    precision=args.precision), args.warmup, work)
            run.update(load_at_start=load, quiet=quiet, load_at_end=os.getloadavg()[0])
            runs[variant].append(run)
            print(f"repeat {repeat} {variant}: {run['step_s'] * 1e3:.0f} ms/step, load {load:.2f} -> "
                  f"{run['load_at_end']:.2f}{'' if quiet else ' (NOT QUIET)'}", file=sys.stderr)
    _fill_async_lengths(runs, work)
    table = {v: {k: float(np.median([r[k] for r in rs])) for k in ("step_s", "tokens_per_s", "completion_len",
                                                                      "reward_first5", "reward_mean", "reward_last10")}
             | {"phases_s": {name: float(np.median([r["phases_s"][name] for r in rs if name in r["phases_s"]]))
                             for name in rs[0]["phases_s"]},
                "threads": rs[0]["threads"], "loads": [round(r["load_at_start"], 2) for r in rs],
                "all_quiet": all(r["quiet"] for r in rs)}
             for v, rs in runs.items()}
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "steps": args.steps, "size": args.size,
              "precision": args.precision,
              "repeats": args.repeats, "warmup": args.warmup, "max_load": args.max_load, "threads_arg": args.threads,
              "meta": json.loads((workdir / "meta.json").read_text()), "median": table, "runs": runs}
    name = "vs_trl" + ("" if args.size == "toy" else f"_{args.size}") + ("" if args.precision == "fp32" else
                                                                           f"_{args.precision}") + ".json"
    (ROOT / "benchmarks/results" / name).write_text(json.dumps(result, indent=2))
    base = table.get("trl", {}).get("tokens_per_s")
    print(f"medians of {args.repeats} interleaved repeats × {args.steps} steps (first {args.warmup} excluded); "
          f"ratios against TRL at its defaults without tracking")
    print("| variant | torch threads | step (median) | tokens/s | vs TRL | step's parts (medians) | completion len | "
          "reward steps 1-5 | reward, all steps | reward last 10 | load at each start |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v, row in table.items():
        ratio = f"{row['tokens_per_s'] / base:.2f}×" if base else "–"
        loads = ", ".join(f"{x:.2f}" for x in row["loads"]) + ("" if row["all_quiet"] else " (not all quiet)")
        print(f"| {v} | {row['threads']} | {row['step_s'] * 1e3:.0f} ms | {row['tokens_per_s']:.0f} | {ratio} | "
              f"{phase_text(v, row['phases_s'])} | {row['completion_len']:.2f} | {row['reward_first5']:.3f} | "
              f"{row['reward_mean']:.3f} | {row['reward_last10']:.3f} | {loads} |")


if __name__ == "__main__":
    main()
