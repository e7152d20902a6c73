"""HF Qwen2 / Llama ⇄ megatron-core GPTModel state dicts (pure tensor reshuffling, runs on CPU).

megatron-core (0.16, ``get_gpt_layer_local_spec``) names and fuses the weights differently:

=====================================================  =====================================================
HF                                                     megatron-core GPTModel
=====================================================  =====================================================
model.embed_tokens.weight                              embedding.word_embeddings.weight
model.layers.i.input_layernorm.weight                  decoder.layers.i.input_layernorm.weight
model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}    decoder.layers.i.self_attention.linear_qkv.{weight,bias}
model.layers.i.self_attn.o_proj.weight                 decoder.layers.i.self_attention.linear_proj.weight
model.layers.i.post_attention_layernorm.weight         decoder.layers.i.pre_mlp_layernorm.weight
model.layers.i.mlp.{gate,up}_proj.weight               decoder.layers.i.mlp.linear_fc1.weight
model.layers.i.mlp.down_proj.weight                    decoder.layers.i.mlp.linear_fc2.weight
model.norm.weight                                      decoder.final_layernorm.weight
lm_head.weight (absent when tied)                      output_layer.weight (absent when shared)
=====================================================  =====================================================

The fused QKV rows are grouped by key/value head (GQA): for each of the ``num_kv_heads`` groups,
that group's ``num_heads / num_kv_heads`` query heads, then its key head, then its value head
(each ``head_dim`` rows). ``linear_fc1`` is ``[gate; up]`` stacked along the output dimension.
With the Transformer-Engine spec the layernorms are fused into the next linear
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``): pass ``fused_norms=True``.
Left out: tensor/pipeline-parallel splitting (the dicts are the full, TP=1 PP=1 layout), MoE
experts, and architectures other than Llama-style decoders (Qwen2 adds the QKV biases).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.errors import RlpipeError


class ConversionError(RlpipeError):
    """A state dict does not match the architecture it is converted for."""


@dataclass(frozen=True)
class DecoderShape:
    """The numbers the conversion needs from a HF Llama/Qwen2 config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_hf(cls, config) -> "DecoderShape":
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if heads % kv:
            raise ConversionError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
        return cls(config.num_hidden_layers, config.hidden_size, heads, kv, head_dim,
                   bool(getattr(config, "tie_word_embeddings", False)))


def _norm_names(i: int, fused: bool) -> tuple[str, str]:
    layer = f"decoder.layers.{i}"
    if fused:
        return f"{layer}.self_attention.linear_qkv.layer_norm_weight", f"{layer}.mlp.linear_fc1.layer_norm_weight"
    return f"{layer}.input_layernorm.weight", f"{layer}.pre_mlp_layernorm.weight"


def _pop(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return sd.pop(name)
    except KeyError:
        raise ConversionError(f"the state dict has no {name!r}; is it a Llama/Qwen2 decoder of this shape?") from None


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: DecoderShape, fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """A megatron-core GPTModel state dict (TP=1, PP=1) holding the weights of HF state dict ``hf``."""
    sd = dict(hf)
    out = {"embedding.word_embeddings.weight": _pop(sd, "model.embed_tokens.weight")}
    group = shape.num_heads // shape.num_kv_heads
    for i in range(shape.num_layers):
        src, dst = f"model.layers.{i}", f"decoder.layers.{i}"
        attn_norm, mlp_norm = _norm_names(i, fused_norms)
        out[attn_norm] = _pop(sd, f"{src}.input_layernorm.weight")
        for kind in ("weight", "bias"):
            if f"{src}.self_attn.q_proj.{kind}" not in sd:
                continue
            q, k, v = (_pop(sd, f"{src}.self_attn.{p}_proj.{kind}") for p in "qkv")
            tail = q.shape[1:]
            q = q.reshape(shape.num_kv_heads, group * shape.head_dim, *tail)
            k = k.reshape(shape.num_kv_heads, shape.head_dim, *tail)
            v = v.reshape(shape.num_kv_heads, shape.head_dim, *tail)
            out[f"{dst}.self_attention.linear_qkv.{kind}"] = torch.cat([q, k, v], dim=1).reshape(-1, *tail)
        out[f"{dst}.self_attention.linear_proj.weight"] = _pop(sd, f"{src}.self_attn.o_proj.weight")
        out[mlp_norm] = _pop(sd, f"{src}.post_attention_layernorm.weight")
        gate, up = _pop(sd, f"{src}.mlp.gate_proj.weight"), _pop(sd, f"{src}.mlp.up_proj.weight")
        out[f"{dst}.mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[f"{dst}.mlp.linear_fc2.weight"] = _pop(sd, f"{src}.mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = _pop(sd, "model.norm.weight")
    head = sd.pop("lm_head.weight", None)
    if not shape.tied:
        if head is None:
            raise ConversionError("the model's embeddings are not tied but the state dict has no 'lm_head.weight'")
        out["output_layer.weight"] = head
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if sd:
        raise ConversionError(f"{len(sd)} HF tensor(s) have no megatron counterpart, e.g. {sorted(sd)[:3]}")
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], shape: DecoderShape, fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """The HF Llama/Qwen2 state dict of megatron-core GPTModel state dict ``mg`` (TP=1, PP=1)."""
    sd = {k: v for k, v in mg.items() if not k.endswith("_extra_state")}
    out = {"model.embed_tokens.weight": _pop(sd, "embedding.word_embeddings.weight")}
    group = shape.num_heads // shape.num_kv_heads
    for i in range(shape.num_layers):
        src, dst = f"decoder.layers.{i}", f"model.layers.{i}"
        attn_norm, mlp_norm = _norm_names(i, fused_norms)
        out[f"{dst}.input_layernorm.weight"] = _pop(sd, attn_norm)
        for kind in ("weight", "bias"):
            name = f"{src}.self_attention.linear_qkv.{kind}"
            if name not in sd:
                continue
            fused = sd.pop(name)
            tail = fused.shape[1:]
            grouped = fused.reshape(shape.num_kv_heads, (group + 2) * shape.head_dim, *tail)
            q, k, v = grouped.split([group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
            for p, t in zip("qkv", (q, k, v)):
                out[f"{dst}.self_attn.{p}_proj.{kind}"] = t.reshape(-1, *tail).clone()
        out[f"{dst}.self_attn.o_proj.weight"] = _pop(sd, f"{src}.self_attention.linear_proj.weight")
        out[f"{dst}.post_attention_layernorm.weight"] = _pop(sd, mlp_norm)
        gate, up = _pop(sd, f"{src}.mlp.linear_fc1.weight").chunk(2, dim=0)
        out[f"{dst}.mlp.gate_proj.weight"], out[f"{dst}.mlp.up_proj.weight"] = gate.clone(), up.clone()
        out[f"{dst}.mlp.down_proj.weight"] = _pop(sd, f"{src}.mlp.linear_fc2.weight")
    out["model.norm.weight"] = _pop(sd, "decoder.final_layernorm.weight")
    if shape.tied:
        sd.pop("output_layer.weight", None)
    else:
        out["lm_head.weight"] = _pop(sd, "output_layer.weight")
    if sd:
        raise ConversionError(f"{len(sd)} megatron tensor(s) have no HF counterpart, e.g. {sorted(sd)[:3]}")
    return out
