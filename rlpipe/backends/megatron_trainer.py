"""megatron-core as the trainer's engine (``trainer.backend: megatron``): Shoeybi et al. 2019,
"Megatron-LM", through megatron-core's ``GPTModel``, DDP, distributed optimizer and schedules.

* the model: a ``GPTModel`` (local layer spec: no Transformer Engine, no fused kernels) built
  from the policy's Hugging Face config and filled with its weights by
  :func:`rlpipe.backends.megatron_convert.hf_to_megatron` (fused QKV, gate/up, tied embeddings);
* passes: megatron's own schedule (``get_forward_backward_func``). Log-prob passes run it with
  ``forward_only=True``; an update injects rlpipe's policy loss as the schedule's loss function.
  That loss is already normalized by the *global* token/sequence counts the DP ranks agreed on
  (``rlpipe.stages.algos.policy_loss.LossDenominators``), so megatron must not rescale it:
  ``calculate_per_token_loss=True`` stops the division by the number of micro-batches and makes
  DDP *sum* gradients over the DP ranks, and the grad-finalize function drops megatron's own
  token count (it would divide once more);
* optimizer: megatron's distributed optimizer (Adam(W) states sharded over the DP ranks;
  parameters all-gathered after each step, so every rank holds the full weights);
* export: the GPTModel's state dict converted back to HF names for the rollout engine.

Sequences are packed to the left edge (no left padding) before the GPTModel sees them: its
rotary embedding takes positions 0..S-1 and ignores ``position_ids``, so left-padded prompts would
shift every position. The logits are moved back into rlpipe's layout (left-padded prompt,
right-padded response) afterwards, so the stages' logprob code is shared with the torch backends.

Needs CUDA: on a CPU torch, megatron-core 0.16.1 fails in ``model_parallel_cuda_manual_seed``
(``torch.cuda``), in RoPE (``rotary_pos_embedding.py``: ``inv_freq.to(torch.cuda.current_device())``),
in the no-pipelining schedule (``schedules.py``: ``torch.zeros(..., device="cuda")``) and in DDP's
grad buffers (``param_and_grad_buffer.py``: ``torch.cuda.current_device()``). Left out: tensor,
pipeline, context and expert parallelism (TP = PP = 1; the conversion handles the full layout
only), sequence packing without padding, Transformer Engine layers, megatron checkpoints.
"""

from __future__ import annotations

import math
import socket
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from rlpipe.backends.megatron_convert import DecoderShape, hf_to_megatron, megatron_to_hf
from rlpipe.errors import ConfigError


def rope_base(hf_config) -> float:
    """The rotary base of an HF config (transformers 5 keeps it in ``rope_parameters``)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def transformer_config(hf_config, dtype: torch.dtype):
    """A megatron ``TransformerConfig`` equal in function to a Llama-style HF decoder (Qwen2: QKV biases)."""
    from megatron.core.transformer import TransformerConfig

    heads = hf_config.num_attention_heads
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=heads,
        num_query_groups=hf_config.num_key_value_heads or heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn_hidden_size=hf_config.intermediate_size, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf_config, "attention_bias", hf_config.model_type == "qwen2")),
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, attention_softmax_in_fp32=True,
        # no fused kernels: the local spec's plain torch paths (no Transformer Engine or Apex needed)
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        perform_initialization=False,  # every weight is loaded from the HF model
        calculate_per_token_loss=True,  # the loss carries the global denominator (module docstring)
    )


def left_packed(seq) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq``'s tokens moved to the left edge of each row, and the per-row shift (its leading padding: the index
    of the row's first attended token). Real tokens are contiguous in a row (left-padded prompt, response)."""
    width = seq.input_ids.shape[1]
    shift = seq.attention_mask.long().argmax(1)  # the first 1 (0 for a row without any)
    cols = torch.arange(width, device=seq.input_ids.device)
    src = (cols[None] + shift[:, None]).clamp(max=width - 1)  # past a row's end: copies, causally invisible
    return seq.input_ids.gather(1, src), shift


def unpack_logits(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Logits of left-packed rows back at the columns of rlpipe's layout (left-padded prompts)."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    src = (cols[None] - shift[:, None]).clamp(min=0)  # left-padding columns: a copy of column 0, never read
    return logits.gather(1, src[..., None].expand(-1, -1, logits.shape[-1]))


def packed_logits(forward: Callable[..., torch.Tensor], seq) -> torch.Tensor:
    """Logits in rlpipe's layout from ``forward(input_ids, position_ids, attention_mask)`` run on the packed rows
    (causal mask only: after packing every pad sits after the row's last real token)."""
    ids, shift = left_packed(seq)
    positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    return unpack_logits(forward(ids, positions, None), shift)


def _single_rank_group() -> None:
    """A one-rank default process group (world size 1 joins none in TrainState; megatron needs one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(minutes=10))


def cuda_index(device: torch.device) -> int:
    """The index of a cuda device (``cuda`` alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def build_gpt(hf_model: torch.nn.Module, device: torch.device):
    """A GPTModel (local spec) of ``hf_model``'s architecture holding its weights, and the shape used to convert.

    Runs on CPU too (``use_cpu_initialization``), where megatron-core builds and loads but cannot run forward."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    hf_config = hf_model.config
    dtype = next(hf_model.parameters()).dtype
    shape = DecoderShape.from_hf(hf_config)
    config = transformer_config(hf_config, dtype)
    config.use_cpu_initialization = device.type == "cpu"
    gpt = GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
        rotary_base=rope_base(hf_config), share_embeddings_and_output_weights=shape.tied,
    ).to(device=device, dtype=dtype)
    hf_state = {k: v for k, v in hf_model.state_dict().items() if not (shape.tied and k == "lm_head.weight")}
    result = gpt.load_state_dict(hf_to_megatron(hf_state, shape), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ConfigError(f"the HF model does not convert to this GPTModel: missing {missing[:3]}, unexpected "
                          f"{result.unexpected_keys[:3]}; only Llama/Qwen2-style decoders are supported")
    return gpt, shape, config


def hf_weights(gpt, shape: DecoderShape) -> dict[str, torch.Tensor]:
    """A GPTModel's weights under HF names (fused QKV and gate/up split back)."""
    mg = {k: v.detach() for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    return megatron_to_hf(mg, shape)


class MegatronEngine:
    """GPTModel + DDP + distributed optimizer of one DP rank (TP = PP = 1)."""

    def __init__(self, hf_model: torch.nn.Module, optimizer, grad_clip: float | None, seed: int, device):
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError("trainer.backend megatron needs a CUDA device (resources.device: cuda); megatron-core's "
                              "RNG tracker, RoPE, schedules and DDP allocate on cuda")
        torch.cuda.set_device(cuda_index(self.device))
        if not dist.is_initialized():
            _single_rank_group()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        dtype = next(hf_model.parameters()).dtype
        self.gpt, self.shape, self.config = build_gpt(hf_model, self.device)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False,
                                                   overlap_param_gather=False, grad_reduce_in_fp32=True)
        self.ddp = DistributedDataParallel(self.config, ddp_config, self.gpt)
        # sum DP gradients (no 1/dp scaling under calculate_per_token_loss) and drop megatron's token count:
        # rlpipe's loss is already divided by the global denominator
        self.config.finalize_model_grads_func = (
            lambda models, num_tokens, **kw: finalize_model_grads(models, None, **kw))
        self.config.no_sync_func = self.ddp.no_sync  # accumulate micro-batches locally, reduce once
        self.clip = grad_clip if grad_clip else math.inf  # an infinite clip still measures the norm
        self.weight_decay = optimizer.weight_decay
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=optimizer.lr, weight_decay=optimizer.weight_decay, adam_beta1=optimizer.betas[0],
            adam_beta2=optimizer.betas[1], adam_eps=optimizer.eps, bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16, params_dtype=dtype, use_distributed_optimizer=True, clip_grad=self.clip,
        ), [self.ddp])

    # --- passes through megatron's schedule ------------------------------------------------
    def _schedule(self, items: list, step: Callable, forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not items:
            return
        width = max(int(s.input_ids.shape[1]) for s in (i[0] if isinstance(i, tuple) else i for i in items))
        rows = max(int(s.input_ids.shape[0]) for s in (i[0] if isinstance(i, tuple) else i for i in items))
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter(items), model=self.ddp,
                                    num_microbatches=len(items), seq_length=width, micro_batch_size=rows,
                                    forward_only=forward_only)

    def _one(self) -> torch.Tensor:
        return torch.ones((), dtype=torch.int, device=self.device)

    @torch.no_grad()
    def forward_passes(self, seqs: list, consume: Callable[[Any, torch.Tensor], Any]) -> list:
        """``consume(seq, logits)`` of every micro-batch, from ``forward_only=True`` passes of the schedule."""
        out: list = []

        def step(data: Iterator, model):
            seq = next(data)

            def loss_func(logits):
                out.append(consume(seq, logits))
                return torch.zeros((), device=self.device), self._one(), {}

            return packed_logits(model, seq), loss_func

        self.ddp.eval()
        self._schedule(seqs, step, forward_only=True)
        self.ddp.train()
        return out

    def train_passes(self, jobs: list) -> list[tuple[torch.Tensor, dict]]:
        """Forward + backward of every ``(seq, loss_of)`` job with ``loss_of`` as the schedule's loss function;
        gradients are then summed over the DP ranks (in the grad-finalize step). Detached losses and metrics."""
        out: list = []

        def step(data: Iterator, model):
            seq, loss_of = next(data)

            def loss_func(logits):
                loss, metrics = loss_of(seq, logits)
                out.append((loss.detach(), metrics))
                return loss, self._one(), {}

            return packed_logits(model, seq), loss_func

        self._schedule(jobs, step, forward_only=False)
        return out

    # --- optimizer --------------------------------------------------------------------------
    def reduce_and_clip(self) -> float:
        """Hand the DP-reduced gradients to the optimizer's (sharded) main parameters, clip them to the configured
        norm and return the global norm (a collective over the DP ranks). Call :meth:`apply` or :meth:`zero_grad`
        next: a non-finite norm is reported before anything is stepped."""
        self.optimizer.prepare_grads()
        return float(self.optimizer.clip_grad_norm(self.clip))

    def apply(self, lr: float) -> None:
        """The optimizer step at ``lr`` on the prepared gradients; parameters are all-gathered afterwards."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            # rlpipe's AdamW decays every parameter; megatron's groups exempt biases and norms (wd_mult 0)
            group["weight_decay"] = self.weight_decay
        self.optimizer.step_with_ready_grads()

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    # --- weights ----------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights under HF names (every rank holds them: parameters are all-gathered after a step)."""
        return hf_weights(self.gpt, self.shape)


class MegatronPolicy(torch.nn.Module):
    """The trainer's ``model`` under this backend: the GPTModel as a submodule (parameters, train/eval) and an
    HF-style ``forward`` (``.logits`` in rlpipe's layout) for callers that run a plain forward."""

    def __init__(self, engine: MegatronEngine):
        super().__init__()
        self.engine = engine
        self.gpt = engine.gpt

    def forward(self, input_ids, attention_mask, position_ids):
        seq = SimpleNamespace(input_ids=input_ids, attention_mask=attention_mask)
        del position_ids  # implied by the mask: packed rows start at position 0
        return SimpleNamespace(logits=packed_logits(self.engine.ddp, seq))

    def named_hf_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.engine.hf_state_dict().items()
