"""``trainer.lora``: train low-rank adapters instead of the whole policy (rlpipe.backends.lora)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlpipe.schemas.strict import Strict

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear projection of a Qwen2 / Llama decoder layer (what peft calls `all-linear` there, LM head left out)."""


class LoRAConfig(Strict):
    """LoRA (Hu et al. 2021): each targeted linear layer keeps its weight W0 frozen and learns a low-rank delta,
    y = x·W0ᵀ + (alpha / rank)·dropout(x)·Aᵀ·Bᵀ, with A [rank, in] random and B [out, rank] zero at the start (the
    first policy is the base model). Only A and B train, the optimizer holds only their state, weight pushes carry
    only them, checkpoints hold them with the base model's identity. The actor only: a critic trains its whole
    model, and the reference is the base model itself."""

    rank: int = Field(8, ge=1)
    """Rank r of every adapter (A is [r, in_features], B is [out_features, r])."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the delta is multiplied by alpha / rank (peft's `lora_alpha`; the LoRA paper's scaling, which
    lessens retuning the lr when the rank changes)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input, in gradient passes only (the update): the π_old and reference passes and
    the rollout engine see no dropout, so the PPO ratio starts at 1."""
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGETS), min_length=1)
    """Names of the linear layers that get an adapter: matched against the last part of each module's name
    (`q_proj` adapts `model.layers.<i>.self_attn.q_proj` of every layer). `rlpipe validate` checks every name
    against the model's linear modules."""
    export: Literal["merged", "adapter"] = "merged"
    """What the final (and every `save_every`) model folder holds: `merged` — a plain Hugging Face model whose
    weights are W0 + (alpha / rank)·B·A (loads anywhere, no adapter code needed); `adapter` — only the adapters in
    peft's layout (`adapter_model.safetensors`, `adapter_config.json`, loadable by peft and vLLM's LoRA) plus
    `rlpipe_base.json` naming the base model and the checksum of its weights."""

    @field_validator("target_modules")
    @classmethod
    def _distinct_names(cls, names: list[str]) -> list[str]:
        bad = [n for n in names if not n or "." in n or n != n.strip()]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a module name; give the last part of a linear module's name, "
                             "e.g. q_proj")
        if len(set(names)) != len(names):
            raise ValueError(f"{sorted(n for n in set(names) if names.count(n) > 1)[0]!r} is listed twice; list "
                             "each module name once")
        return names
