"""The pipeline config: what a ``pipeline.yaml`` may say.

Every model forbids unknown keys and documents every field; defaults live here
and nowhere else. Stage and mode params are validated against the params model
their implementation registers (see :mod:`rlpipe.engine.planning.plan`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlpipe.plugin_files import PluginFile
from rlpipe.schemas.lora import LoRAConfig
from rlpipe.schemas.strict import Strict, refuse_bool_for_number  # noqa: F401  (re-exported: their old home)


class TokenizerConfig(Strict):
    """Where the tokenizer comes from: a local Hugging Face directory, or built locally."""

    path: str | None = None
    """Local directory of a Hugging Face tokenizer. Nothing is downloaded."""
    chars: str | None = None
    """Build a character-level tokenizer over these characters (plus <pad>, <bos>, <eos>)."""
    byte_level: bool = False
    """Build a byte-level BPE-free tokenizer (256 byte tokens plus specials)."""
    chat_template: str | None = None
    """Chat template of the `byte_level` tokenizer: `chatml` (the `<|im_start|>role ... <|im_end|>` layout of
    Qwen2.5's instruct models, spelled in bytes: a CPU twin of a Qwen pipeline renders prompts the same way)
    or a Jinja template. None: rlpipe's compact default (rlpipe.agents.chat). A `path` tokenizer keeps its own."""

    @model_validator(mode="after")
    def _one_source(self) -> "TokenizerConfig":
        given = [name for name in ("path", "chars") if getattr(self, name)] + (["byte_level"] if self.byte_level else [])
        if len(given) != 1:
            raise ValueError(
                "tokenizer needs exactly one source: set `path` (a local HF tokenizer directory), "
                f"`chars` (a character vocabulary) or `byte_level: true`; got {given or 'none'}"
            )
        if self.chat_template is not None and not self.byte_level:
            raise ValueError("tokenizer.chat_template is for `byte_level: true` (a `path` tokenizer has its own; "
                             "`chars` cannot spell a template's markers): drop it or use byte_level")
        return self


class ArchitectureConfig(Strict):
    """A model built from scratch (random init) from these sizes; the vocabulary comes from the tokenizer."""

    family: Literal["qwen2", "llama"] = "qwen2"
    """Hugging Face architecture family."""
    hidden_size: int = Field(64, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(2, ge=1)
    """Number of transformer blocks."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    num_kv_heads: int | None = Field(None, ge=1)
    """Key/value heads (grouped-query attention); defaults to num_heads."""
    intermediate_size: int = Field(128, ge=8)
    """MLP width."""
    max_position_embeddings: int = Field(512, ge=16)
    """Longest prompt + response the model supports."""
    tie_word_embeddings: bool = True
    """Share input and output embeddings."""


class ModelConfig(Strict):
    """The policy (and, by default, reference) model."""

    path: str | None = None
    """Local directory of a Hugging Face causal LM. Nothing is downloaded."""
    architecture: ArchitectureConfig | None = None
    """Build a randomly initialized model of this shape instead of loading `path`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trainer (the rollout's too unless `rollout_dtype` says otherwise)."""
    rollout_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Parameter dtype of the embedded rollout engines' copy of the policy; None: `dtype`. `bfloat16` with
    float32 training is what verl and TRL's vLLM mode do: decoding runs at bfloat16 rates and each push is
    converted as it is loaded. The rollout's logprobs then carry bfloat16 rounding: with `old_log_prob: bypass`
    the PPO ratio starts off 1 by that gap (`old_log_prob: trainer` recomputes π_old in the trainer's numerics;
    `rollout_correction` weights the gap)."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.path is None) == (self.architecture is None):
            raise ValueError(
                "model needs exactly one of `path` (a local HF model directory) or "
                "`architecture` (sizes of a model built from scratch)"
            )
        return self


class DataConfig(Strict):
    """Where prompts come from."""

    source: str = "digits"
    """Registered dataset name (`rlpipe stages` lists them under `dataset`)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Params of the dataset, validated by its params model."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts drawn per global step (train_batch_size in verl); each yields `n` samples."""
    max_prompt_length: int = Field(64, ge=1)
    """Prompts longer than this (in tokens) are an error naming the row."""
    shuffle: bool = True
    """Reshuffle every epoch with the run seed."""
    apply_chat_template: bool = False
    """Wrap each prompt as a user message with the tokenizer's chat template (instruct models)."""
    check_whole_files_mb: float = Field(16, ge=0)
    """Dataset files up to this size (MB each) are checked row by row before anything starts (`rlpipe validate`
    and every run): each row parses, has the fields, has a scorer route and fits max_prompt_length, and an error
    names the file and line. A bigger file is checked on its first 2000 rows, the rest when the run loads it."""


class OptimizerConfig(Strict):
    """AdamW."""

    lr: float = Field(1e-4, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""


class LRScheduleConfig(Strict):
    """Learning-rate schedule; counts *local* updates (total_steps × updates per step)."""

    name: Literal["constant", "cosine", "linear"] = "constant"
    """Shape after warmup."""
    warmup_updates: int = Field(0, ge=0)
    """Linear warmup length, in local updates."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final LR as a fraction of the peak (cosine and linear)."""


DEFAULT_CHECKPOINT_EVERY = 50
"""Steps between checkpoints when trainer.checkpoint_every is not set: a crash loses at most this many."""


class TrainerConfig(Strict):
    """The actor: how updates are made."""

    total_steps: int = Field(10, ge=1)
    """Global steps to run."""
    dp_size: int = Field(1, ge=1)
    """Data-parallel trainer workers (torch.distributed, gloo on CPU)."""
    backend: str = "replicated"
    """How the DP ranks hold the model (a registered trainer backend): `replicated` (a full copy per
    rank, gradients all-reduced), `fsdp2` (torch FSDP2: parameters, gradients and AdamW state sharded
    over the ranks, ≈ 1/dp_size each; for models that do not fit one worker), `megatron` (megatron-core's
    GPTModel, schedules and distributed optimizer; TP = PP = 1; needs CUDA, refused on CPU)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each global batch."""
    ppo_mini_batch_size: int | None = Field(None, ge=1)
    """Prompts per optimizer step (one local update); None = the whole global batch."""
    micro_batch_size: int = Field(64, ge=1)
    """Rows per forward/backward on one worker; gradients accumulate over micro-batches."""
    parameter_sync_step: int = Field(1, ge=1)
    """Local updates per weight push; all of them use the same π_old."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this; None disables clipping."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    """Learning-rate schedule."""
    lora: LoRAConfig | None = None
    """Train LoRA adapters instead of the whole policy (see `trainer.lora`; docs/lora.md); None: full fine-tuning."""
    checkpoint_every: int | None = Field(None, ge=0)
    """Write a resumable checkpoint every N steps to <output_dir>/<run>/checkpoints/step_<N>, and one at the
    end (0 = never); None (the default): every 50 steps (`DEFAULT_CHECKPOINT_EVERY`), or never with
    `backend: megatron`, whose checkpoints are not implemented. `rlpipe run PIPELINE --resume latest` (or
    `--resume that/folder`) continues the run, in the same MLflow run."""
    keep_checkpoints: int = Field(2, ge=0)
    """Keep only the newest N checkpoint folders (older ones are deleted after a save succeeds); 0 keeps all."""
    save_every: int = Field(0, ge=0)
    """Save the policy as a HF model directory every N steps (0 = only at the end)."""
    output_dir: str = "outputs"
    """Where checkpoints and the final model go (a run-named folder below it)."""
    torch_threads: int | None = Field(None, ge=1)
    """torch intra-op threads per worker process. None (the default): each process's share of the CPUs —
    the CPUs available divided by the worker processes that compute at the same time (1 inline; the
    largest worker group in sync; trainer + rollout in the async modes), and 1 for a model of hidden size
    below 256, whose small ops only slow down with more threads (rlpipe/engine/host.py; `rlpipe validate`
    prints the number). On a multi-node cluster set it to each node's CPUs / workers per node."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """`bf16`: the trainer's forward passes (update, old_log_prob, ref) compute in bfloat16 under torch.autocast
    while parameters, gradients and AdamW state stay float32 (the master weights; what TRL and verl do on
    GPUs). Matrix products then run at bfloat16 rates (several times float32's on GPUs and on CPUs with AMX);
    logprobs, losses and advantages stay float32. Needs `model.dtype: float32`; not with `backend: megatron`
    (its own precision settings). `none`: everything in the model's dtype."""
    on_nonfinite: Literal["fail", "skip"] = "fail"
    """What a local update with a non-finite loss or gradient norm does: `fail` stops the run at that
    step, before its weight push (so NaN weights never reach the rollout); `skip` drops that update
    (no optimizer step), counts it in `actor/skipped_updates` and raises the `actor/nonfinite_alarm`
    metric. Non-finite *parameters* after an optimizer step always fail the run (it cannot be undone)."""
    max_zero_grad_updates: int = Field(3, ge=0)
    """Fail the run after this many consecutive local updates whose gradient norm is exactly 0 while
    their advantages are not all 0 (a saturated, diverged model: e.g. a far too large lr), before that
    step's weight push; 0 disables. The streak so far is the `actor/zero_grad_streak` metric of every
    step (the alarm to watch). There is no skip for it: a zero gradient holds nothing to drop."""
    max_failed_steps: int = Field(3, ge=0)
    """Fail the run after this many consecutive steps whose every row is an infrastructure failure
    (status `failed`, e.g. the reward sandbox is down); a single such step is a warning. 0 disables."""

    @model_validator(mode="after")
    def _default_checkpoints(self) -> "TrainerConfig":
        # decided here, once: every later reader sees a number
        if self.checkpoint_every is None:
            self.checkpoint_every = 0 if self.backend == "megatron" else DEFAULT_CHECKPOINT_EVERY
        return self


class ResourcesConfig(Strict):
    """Where things run."""

    ray_address: str | None = None
    """Ray cluster address; None = `RAY_ADDRESS` from the environment, else a local Ray."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a local Ray (None = all)."""
    rollout_replicas: int = Field(1, ge=1)
    """Rollout engine actors; prompts are split across them."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of the embedded torch backends."""
    placement: dict[str, str] = Field(default_factory=dict)
    """Worker role → the Ray custom resource of the node(s) it must run on, e.g. `{actor: node_a,
    rollout: node_b}` for nodes started with `ray start --resources '{"node_a": 1}'`. Each worker of
    the role asks for 0.001 of that resource; roles not named go wherever Ray puts them. The DP ranks of
    a sharded role (actor, critic) are packed onto one node by a placement group (gloo rendezvous on
    that node's address). Which files nodes must share: `shared_filesystem`."""
    gpus_per_worker: float = Field(0.0, ge=0)
    """GPUs each worker of a model-holding role (actor, critic, reference, rollout) asks Ray for; needs
    `device: cuda`. 0: none reserved, every worker sees all of its node's GPUs (roles colocated on one GPU,
    as the sync mode does); 1: a GPU of its own (Ray sets its CUDA_VISIBLE_DEVICES: separate GPUs, e.g. for
    NCCL weight broadcast or megatron DP ranks); a fraction shares one (0.5: two workers per GPU)."""
    shared_filesystem: bool | None = None
    """Whether every Ray node sees the driver's files at the same paths (one machine, or NFS / a shared disk).
    true: workers load `model.path` / `tokenizer.path` (and stage params `path` / `model_path` naming a folder:
    reward model, judge, SGLang server) themselves and trainer ranks write checkpoints and saved models into
    `trainer.output_dir` (nothing is copied). false: the driver packs those model folders once into Ray's
    object store (files checked by size and sha256) and every worker loads a verified copy from its node's
    `node_cache_dir`; trainer ranks send checkpoint files and saved models to the driver through the
    object store, and only the driver writes `trainer.output_dir`. None (the
    default): true on a one-node Ray (a laptop, a single machine: no copy, no extra cost), false on a
    cluster of several nodes. An inline run (one process) always reads the paths. See docs/trainers-and-multinode.md."""
    colocate: list[list[str]] = Field(default_factory=list)
    """Worker roles that share one Ray actor (one process) per rank, e.g. `[[actor, rollout, ref]]` (verl's hybrid
    engine): the trainer, the rollout engine and the reference take turns in one process. Their nodes, with the task
    nodes between them, then run as one call per step, and a weight push reaches the engine without leaving the
    process's memory. Roles of a group need as many workers each (actor: trainer.dp_size, rollout:
    resources.rollout_replicas, ref: 1) and at most one data-parallel role (actor or critic); sync mode only (the
    async modes generate while they train). Roles not in the run are ignored; [] (the default): every role has its
    own workers."""
    task_stages_in_workers: bool = True
    """Run task stages (reward, balance, advantage ...) inside the call of the worker next to them in the plan,
    when that worker's role has a single worker (e.g. generate, reward, balance as one call of the rollout replica;
    old_log_prob, advantage, update as one call of the trainer): one Ray round trip instead of one per node and no
    Ray task. A driver stage that declares the roles it calls (weight_sync) then runs at the end of that call too:
    the trainer exports, bumps its version and calls the rollout replicas itself. Such a call hands its last table
    straight to the next worker's call (the trainer's after the rollout's: worker to worker through Ray's object
    store, not through the driver). false: every task stage runs as
    a Ray task (consecutive ones as one task), on any node with a free CPU, and driver stages on the driver: for
    task stages heavy enough to need a CPU or memory of their own. Lineage records where each node ran
    (`task in actor×1@...`, `driver in actor×1@...`)."""
    concurrent_branches: bool = True
    """Start the next workers' chains beside the current call when no path of the DAG joins any two of them and
    each has a worker of its own (e.g. ref and critic_values on their workers while the trainer computes
    old_log_prob); results and lineage are those of running them in order.
    false: every call waits for the one before it (to measure what the overlap gains)."""
    node_cache_dir: str | None = None
    """Node-local folder where workers keep the model directories shipped through the object store
    (shared_filesystem false); one copy per node and model, reused by every worker on it and by later runs.
    None: `<system temp dir>/rlpipe-cache` on each node."""
    worker_call_timeout_s: float = Field(3600.0, gt=0)
    """Longest the driver waits for a worker's answer outside a node's own call: the calls modes and the
    runtime make (engine sleep and wake, checkpoint save and load, the final model's save, a deferred weight
    push settling). Past it the run fails with one line naming the workers (role, rank, pid) that did not
    answer and the method. The node calls themselves are bounded by each stage's `timeout_s`."""
    worker_start_timeout_s: float = Field(1800.0, gt=0)
    """Longest the run waits for its workers to start (Ray placing them, each building its model or starting its
    engine server); past it the run fails with one line naming the workers that had not started. What the
    workers ask Ray for (GPUs, placement resources) is checked against the cluster before any starts."""
    keep_freed_memory: bool = True
    """Every process that holds a model asks glibc's malloc to keep freed memory for reuse instead of
    handing it back to the kernel (torch frees and reallocates its CPU tensors every step, and each
    returned page is faulted in and zeroed again): ~10% off a CPU fwd+bwd; a process keeps its peak
    heap. No effect without glibc."""

    @model_validator(mode="after")
    def _gpus_need_cuda(self) -> "ResourcesConfig":
        if self.gpus_per_worker and self.device != "cuda":
            raise ValueError(f"resources.gpus_per_worker {self.gpus_per_worker:g} reserves GPUs, but resources.device "
                             "is cpu: set device: cuda, or gpus_per_worker: 0")
        return self


class WandbSettings(Strict):
    """The W&B run of `tracking.loggers: [wandb]`."""

    mode: Literal["offline", "online"] = "offline"
    """offline: the run is written under <output_dir>/<run>/wandb with no network (`wandb sync` uploads it);
    online: logged to the W&B server as it goes (needs `wandb login` or WANDB_API_KEY)."""
    project: str | None = None
    """W&B project; None = tracking.experiment."""
    entity: str | None = None
    """W&B entity (user or team); None = the account's default."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""


class TrackingConfig(Strict):
    """MLflow tracking and lineage."""

    enabled: bool = True
    """Log to MLflow. Off only for throwaway runs."""
    uri: str | None = None
    """Tracking URI; None = `MLFLOW_TRACKING_URI`, else a local sqlite store in the working directory."""
    experiment: str = "rlpipe"
    """MLflow experiment name."""
    sample_trajectories: int = Field(16, ge=0)
    """Trajectories per step saved to the trajectories Parquet artifact."""
    figures_every: int = Field(10, ge=0)
    """Steps between redraws of the run's figures (figures/*.png) and browsable tables (tables/*.json);
    0 = only at the run's end, which always draws them."""
    figures_min_interval_s: float = Field(30.0, ge=0)
    """Seconds at least between two redraws before the run's end (a redraw costs ~0.5 s of the writer's CPU;
    every 10 steps of a fast run was a third of a core)."""
    metrics_every_s: float = Field(5.0, ge=0)
    """Per-step metrics of the pipeline run and of the node runs are buffered and sent (one log_batch per
    run, several steps at once) at most this often and at the run's end; 0 = at every step end. The steps' traces
    go with them (one span write for all); lineage is written at every step end regardless. Unsent ones at a
    failed run end go to the tracking spool."""
    record_batches_every: int = Field(0, ge=0)
    """Every N steps, keep each node's input batch (batches/step_<S>/<node>.parquet) so `rlpipe replay`
    can re-run a stage on it; 0 = never (batches cost disk: rows × tokens per node)."""
    drain_timeout_s: float = Field(120.0, gt=0)
    """Longest the end of a run waits for tracking calls still queued (a server that went away); what is
    not delivered by then is written to `<output_dir>/<run>/tracking_spool.jsonl`, which
    `rlpipe spool replay PATH` sends to MLflow later."""
    start_timeout_s: float = Field(300.0, gt=0)
    """Longest the run waits for the tracking process to open its MLflow run (import MLflow, create or resume
    the run, log the config); past it the run fails before any step, naming this field (a store that hangs)."""
    max_queued_calls: int = Field(256, ge=1)
    """Most tracking calls (a node record, a step end ...; ~9 per step) waiting for the MLflow writer, which
    runs in its own process; past it the run waits for the writer (backpressure) instead of holding an
    unbounded backlog in memory."""
    http_timeout_s: int = Field(30, ge=1)
    """Timeout of one HTTP request to a tracking server (MLflow's MLFLOW_HTTP_REQUEST_TIMEOUT, default 120,
    which wins when set in the environment)."""
    http_max_retries: int = Field(2, ge=0, le=10)
    """Retries of a failed HTTP request to a tracking server (MLflow's MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    default 7: minutes of backoff per call; the environment variable wins when set)."""
    loggers: list[str] = Field(default_factory=list)
    """More dashboards for the same per-step metrics (registry `metric_logger`): `tensorboard` (event files in
    <output_dir>/<run>/tensorboard) and `wandb` (see `wandb`). MLflow stays the lineage store; they work with
    `enabled: false` too. Install them with `pip install 'rlpipe[loggers]'`."""
    wandb: WandbSettings = Field(default_factory=WandbSettings)
    """Settings of the `wandb` logger."""


class EvalConfig(Strict):
    """Evaluation during training: a validation dataset through the rollout side of the step DAG (the generate
    node, the scorers and what they need), with its own params; its trajectories never reach the trainer."""

    data: DataConfig
    """The validation prompts. `prompts_per_step` is the eval batch (prompts per call); the order is the
    dataset's (no shuffle)."""
    max_prompts: int | None = Field(None, ge=1)
    """Prompts per evaluation: the first ones of `data` (None: the whole dataset). A generated source (digits)
    is drawn with the run seed + 1, so its prompts are not the training ones' draw."""
    every: int = Field(0, ge=0)
    """Evaluate after every N-th step (0: only `at_end`); metrics `eval/...` join that step's."""
    at_end: bool = True
    """Evaluate the final weights after the last step."""
    before_training: bool = False
    """Evaluate the starting weights before the first step; metrics `eval_start/...` join the first step's."""
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Params overrides per node name, merged over the training ones, e.g. `{generate: {n: 4, temperature: 0.6}}`
    (n is the k of mean@k and pass@k)."""
    nodes: list[str] = Field(default_factory=list)
    """Nodes to run besides generate and the scorers (and what they need), e.g. a metric node of a plugin."""
    pass_threshold: float = 1.0
    """A sample passes (pass@k) when its reward is at least this."""


class StageConfig(Strict):
    """One node of the step DAG."""

    kind: str
    """Stage kind: generate, reward, balance, old_log_prob, ref, advantage, update, weight_sync, ... or one a
    plugin registers (`rlpipe stages` lists them)."""
    impl: str
    """Registered implementation name under that kind (`rlpipe stages` lists them)."""
    name: str | None = None
    """Node name (defaults to the kind); must be unique in the pipeline."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Params of the implementation, validated by its params model."""
    timeout_s: float | None = Field(3600.0, gt=0)
    """Longest one execution of this node may take, in seconds; past it the run fails with an error naming
    the stage, impl, step and worker (a hung Ray task is cancelled, a hung worker actor killed). None waits
    forever. The default bounds a hang without tripping slow real steps; lower it for small models."""
    after: list[str] = Field(default_factory=list, max_length=100)
    """Nodes this one runs after besides those whose columns it reads; needed where it replaces a column another
    node writes without reading it."""

    @property
    def node_name(self) -> str:
        return self.name or self.kind


class PipelineConfig(Strict):
    """A whole pipeline: the YAML's top level."""

    name: str = Field("rlpipe", min_length=1, max_length=100)
    """Run name (MLflow run name and output folder, so at most 100 characters and no path separators)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed of everything random: data order, sampling, initialization (0 ≤ seed < 2³²)."""
    mode: str = "sync"
    """Trainer mode: a registered mode name (sync, colocate_async, separate_async)."""
    mode_params: dict[str, Any] = Field(default_factory=dict)
    """Params of the mode, validated by its params model."""
    model: ModelConfig
    """The policy model."""
    tokenizer: TokenizerConfig
    """The policy tokenizer."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The prompt source."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """How the actor trains."""
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    """Where things run."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """MLflow and lineage."""
    eval: EvalConfig | None = None
    """Evaluation during training on a validation dataset (None: none)."""
    plugins: list[PluginFile] = Field(default_factory=list, max_length=100)
    """Python files imported before the pipeline is planned, on the driver and every worker: they register stage
    kinds and impls (rlpipe.stage_kinds, rlpipe.stage) or other parts, as a package's `rlpipe.plugins` entry point
    does. Paths are relative to the directory rlpipe is launched from; the driver ships their source."""
    stages: list[StageConfig]
    """The nodes of the step DAG. The column contracts wire them; the YAML order decides only which version a
    node sees of a column (or row set) that several nodes write: the last one listed before it."""

    @field_validator("name")
    @classmethod
    def _folder_name(cls, name: str) -> str:
        bad = sorted({c for c in name if c in '/\\\0' or not c.isprintable()})
        if bad or name in (".", ".."):
            raise ValueError(f"the name becomes a folder name; {name!r} has {bad or 'a reserved name'}: use letters, "
                             "digits, '-', '_' or '.'")
        return name

    @model_validator(mode="after")
    def _mixed_precision_needs_float32(self) -> "PipelineConfig":
        if self.trainer.mixed_precision != "none" and self.model.dtype != "float32":
            raise ValueError(f"trainer.mixed_precision {self.trainer.mixed_precision} keeps float32 master weights; "
                             f"set model.dtype: float32 (it is {self.model.dtype}) or mixed_precision: none")
        if self.trainer.mixed_precision != "none" and self.trainer.backend == "megatron":
            raise ValueError("trainer.mixed_precision is the replicated and fsdp2 backends' autocast; megatron has its "
                             "own precision settings: set mixed_precision: none")
        return self

    @model_validator(mode="after")
    def _unique_nodes(self) -> "PipelineConfig":
        seen: set[str] = set()
        for node in self.stages:
            if node.node_name in seen:
                raise ValueError(
                    f"two stages are named {node.node_name!r}; give one of them a distinct `name:`"
                )
            seen.add(node.node_name)
        return self
