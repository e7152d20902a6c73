"""A lean forward of the Qwen2 / Llama decoder family, on the Hugging Face model's own parameters.

Hugging Face's forward builds a mask object, a cache object and a dozen module calls per layer on every
call; for the small models and batches of CPU runs that Python work costs more than the matrix
products (a 2-layer, 64-wide Qwen2 decodes a batch of 128 in ~3 ms a token, most of it outside
torch's kernels). This module computes the same function (the same parameters, the same operations in
the same order up to float rounding: RMSNorm in float32, rotary embeddings from the model's own
``inv_freq``, scaled-dot-product attention, SiLU MLP) with plain tensor calls:

- grouped-query attention folds each key/value head's query heads into the query length, so keys and
  values are never repeated per head;
- a :class:`StaticKV` cache is preallocated for a whole cohort (decoding writes one column a step, no
  concatenation); a :class:`GrowingKV` cache concatenates instead, so gradients flow through it
  (the trainer's shared-prompt forward, ``rlpipe.stages.logprobs``).

It reads the parameters through the model's modules at each call, so weight pushes (copied in place)
and sleep/wake (which rebinds ``param.data``) need nothing from it. A projection that is a LoRA adapter
(``rlpipe.backends.lora.LoRALinear``, the trainer's ``trainer.lora``) adds its low-rank delta to the base
product (``_project``), so a LoRA trainer keeps this forward's speed and computes what the adapted model does.
:func:`lean_unsupported` says why a model cannot take it (another family, sliding-window layers, a rotary
embedding that changes with the sequence length, an FSDP-sharded model); callers fall back to the model's own
forward.

Left out: sliding-window attention, dynamic / long-rope rotary scaling, attention or logit soft-capping
(not in these families), dropout (inference and RL updates run without it here), and hooks registered on
modules inside the layers (the input embedding is still called as a module).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlpipe.backends.lora import LoRALinear

FAMILIES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
"""Model classes whose forward this module reproduces."""

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rotary types whose ``inv_freq`` does not change with the sequence (``dynamic`` and ``longrope`` do)."""


def lean_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run the lean forward, or None when it can."""
    name = type(model).__name__
    if name not in FAMILIES:
        return f"{name} is not one of {', '.join(FAMILIES)}"
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return "the model is FSDP-sharded (its forward all-gathers each layer)"
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window attention layers"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE_TYPES:
        return f"rope_type {rope!r} (its frequencies change with the sequence length)"
    if getattr(cfg, "pretraining_tp", 1) > 1:
        return "pretraining_tp > 1"
    for layer in model.model.layers:
        modules = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
        if any(type(m) not in (torch.nn.Linear, LoRALinear) for m in modules):  # e.g. quantized layers
            return "a projection is not a plain Linear nor a LoRA adapter of rlpipe.backends.lora (quantized?)"
    if type(model.lm_head) is not torch.nn.Linear:
        return "the LM head is not a plain Linear"
    return None


_BUILT: "weakref.WeakKeyDictionary[torch.nn.Module, LeanForward | None]" = weakref.WeakKeyDictionary()


def lean_forward_for(model: torch.nn.Module) -> "LeanForward | None":
    """``model``'s lean forward, built once per model; None when it cannot take one (:func:`lean_unsupported`) or
    trains with gradient checkpointing (the lean forward keeps every layer's activations)."""
    if getattr(model, "is_activation_checkpointing", False):
        return None
    lean = _BUILT.get(model, False)
    if lean is False or (lean is not None and lean.model_type is not type(model)):  # e.g. FSDP-wrapped since
        lean = LeanForward(model) if lean_unsupported(model) is None else None
        _BUILT[model] = lean
    return lean


@dataclass
class _Layer:
    """One decoder layer's modules, looked up once (the parameters are read from them at each call)."""

    input_norm: torch.nn.Module
    q: torch.nn.Linear
    k: torch.nn.Linear
    v: torch.nn.Linear
    o: torch.nn.Linear
    post_norm: torch.nn.Module
    gate: torch.nn.Linear
    up: torch.nn.Linear
    down: torch.nn.Linear


class StaticKV:
    """Keys and values of a cohort, preallocated: ``[layers, B, kv_heads, capacity, head_dim]`` each, ``length``
    positions filled. No gradients (inference)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.k = torch.empty(layers, batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` (``[B, kv_heads, T, head_dim]``) after the filled positions; all keys and values so far."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {end} asked for")
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, count: int) -> None:
        self.length += count

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) the batch rows ``rows``, in that order."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)


class GrowingKV:
    """Keys and values kept by concatenation: differentiable (the trainer's prompt cache shared by its rows)."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def advance(self, count: int) -> None:
        self.length += count

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) the batch rows ``rows``; a gather, so a repeated row's gradients add up."""
        self.k = [t[rows] if t is not None else None for t in self.k]
        self.v = [t[rows] if t is not None else None for t in self.v]


class LeanForward:
    """The forward of a Qwen2 / Llama model (see the module docstring); check :func:`lean_unsupported` first."""

    def __init__(self, model: torch.nn.Module):
        reason = lean_unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean forward cannot run this model: {reason}")
        self.model_type = type(model)
        cfg = model.config
        self.max_positions = int(cfg.max_position_embeddings)
        base = model.model
        self.embed = base.embed_tokens
        self.norm = base.norm
        self.lm_head = model.lm_head
        self.eps = float(cfg.rms_norm_eps)
        attn = base.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.groups = self.heads // self.kv_heads
        self.scaling = float(attn.scaling)
        self.layers = [_Layer(layer.input_layernorm, layer.self_attn.q_proj, layer.self_attn.k_proj,
                              layer.self_attn.v_proj, layer.self_attn.o_proj, layer.post_attention_layernorm,
                              layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
                       for layer in base.layers[: cfg.num_hidden_layers]]
        rotary = base.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().float().clone()
        self._rope_scale = float(rotary.attention_scaling)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def static_cache(self, batch: int, capacity: int) -> StaticKV:
        """An empty preallocated cache for ``batch`` rows of at most ``capacity`` positions."""
        weight = self.embed.weight
        return StaticKV(len(self.layers), batch, self.kv_heads, capacity, self.head_dim, weight.dtype, weight.device)

    def growing_cache(self) -> GrowingKV:
        return GrowingKV(len(self.layers))

    def _rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[B, T, head_dim]`` at ``positions``, from a table over every position seen so far (the
        values HF computes per call: ``position * inv_freq``, doubled, times the attention scaling)."""
        top = int(positions.max()) + 1 if positions.numel() else 1
        weight = self.embed.weight
        if (self._rope is None or self._rope[0].shape[0] < top or self._rope[0].dtype != weight.dtype
                or self._rope[0].device != weight.device):
            size = max(top, self.max_positions)
            inv_freq = self._inv_freq.to(weight.device)
            freqs = torch.arange(size, dtype=torch.float32, device=weight.device)[:, None] * inv_freq[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            self._rope = ((emb.cos() * self._rope_scale).to(weight.dtype), (emb.sin() * self._rope_scale).to(weight.dtype))
        cos, sin = self._rope
        return cos[positions], sin[positions]

    def _rms(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return norm.weight * y.to(x.dtype)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, key_mask: torch.Tensor,
                 cache: StaticKV | GrowingKV | None = None, logits_at: slice | None = None) -> torch.Tensor:
        """Logits ``[B, T', V]`` of ``input_ids`` (``[B, T]``) at ``position_ids``, after the ``cache.length``
        positions already in ``cache`` (which this call extends; None: no earlier positions, nothing kept).

        ``key_mask``: bool ``[B, >= length + T]``, which key positions are real tokens (False: padding). Query t
        attends to the real keys up to its own position (always to itself, so a padding query stays finite).
        ``logits_at``: the positions of the T whose logits are computed (default all): the LM head is the
        largest matrix of a small model and most positions' logits are never read."""
        batch, width = input_ids.shape
        past = cache.length if cache is not None else 0
        mask = self._mask(key_mask, past, width)
        cos, sin = self._rope_at(position_ids)
        device = input_ids.device.type
        if torch.is_autocast_enabled(device):  # q and k come out of the projections in the autocast dtype: rotate
            # them in it (as a model in that dtype does) rather than promoting them to float32 for the attention
            cos, sin = cos.to(torch.get_autocast_dtype(device)), sin.to(torch.get_autocast_dtype(device))
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        x = self.embed(input_ids)  # the module: hooks on the input embeddings (token counters, tests) still see it
        for index, layer in enumerate(self.layers):
            h = self._rms(layer.input_norm, x)
            q = _project(layer.q, h).view(batch, width, self.heads, self.head_dim)
            k = _project(layer.k, h).view(batch, width, self.kv_heads, self.head_dim)
            v = _project(layer.v, h).view(batch, width, self.kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = (k * cos + _rotate_half(k) * sin).transpose(1, 2)
            v = v.transpose(1, 2)
            if cache is not None:
                k, v = cache.update(index, k, v)
            # [B, T, H, D] -> [B, kv_heads, groups * T, D]: query head h reads key/value head h // groups
            q = q.transpose(1, 2).reshape(batch, self.kv_heads, self.groups * width, self.head_dim)
            out = _attend(q, k, v, mask, self.scaling)
            out = out.view(batch, self.heads, width, self.head_dim).transpose(1, 2).reshape(batch, width, -1)
            x = x + _project(layer.o, out)
            h = self._rms(layer.post_norm, x)
            gated = F.silu(_project(layer.gate, h)) * _project(layer.up, h)
            x = x + _project(layer.down, gated)
        if cache is not None:
            cache.advance(width)
        if logits_at is not None:
            x = x[:, logits_at]
        return F.linear(self._rms(self.norm, x), self.lm_head.weight, self.lm_head.bias)

    def _mask(self, key_mask: torch.Tensor, past: int, width: int) -> torch.Tensor:
        """Bool ``[B, 1, groups * T, past + T]`` (``[B, 1, 1, past + 1]`` for one new position)."""
        total = past + width
        keys = key_mask[:, :total].bool()
        if width == 1:
            return keys[:, None, None, :]
        query_at = torch.arange(past, total, device=keys.device)[:, None]
        key_at = torch.arange(total, device=keys.device)[None, :]
        mask = (keys[:, None, :] & (key_at <= query_at)[None]) | (key_at == query_at)[None]
        return mask[:, None].repeat(1, 1, self.groups, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q`` ``[B, kv_heads, Q, D]`` over ``k``/``v`` ``[B, kv_heads, L, D]`` where ``mask``
    (bool, broadcast to ``[B, 1, Q, L]``) allows. A decode step (the mask one row per batch row) multiplies
    explicitly: on CPU, torch's fused kernel costs twice as much at a handful of queries and keys per head; for
    longer queries and for gradients the fused kernel is the faster one."""
    if mask.shape[2] != 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _project(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` with plain tensor calls: the weight read directly, plus the low-rank delta of a LoRA adapter
    (the trainer's adapted projections; the rollout engine merges its adapters into plain weights instead)."""
    out = F.linear(x, module.weight, module.bias)
    return out if type(module) is torch.nn.Linear else out + module.delta(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
