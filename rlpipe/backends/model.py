"""Causal LMs of the embedded backends, built from a :class:`ModelConfig`.

Either a local Hugging Face directory (``AutoModelForCausalLM``,
``local_files_only``; nothing is downloaded) or a randomly initialized Qwen2 /
Llama model of the sizes in ``cfg.architecture``, whose vocabulary and
pad/bos/eos ids come from the tokenizer. Initialization is a pure function of
the seed and leaves the global torch RNG untouched.

Left out: quantization, device maps and sharded loading (the embedded backends
hold one full copy per process); the SGLang / megatron backends have their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlpipe.errors import ConfigError
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig

if TYPE_CHECKING:  # transformers' model classes cost seconds to import: only the processes that build a model pay
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _family(name: str) -> tuple[type, type]:
    """The config and model classes of an architecture family."""
    if name == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        return Qwen2Config, Qwen2ForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaConfig, LlamaForCausalLM


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (``float32``, ``bfloat16``, ``float16``)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPES))}") from None


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """The model ``cfg`` describes, in ``cfg.dtype``, in train mode, on CPU."""
    dtype = torch_dtype(cfg.dtype)
    if cfg.path is not None:
        model = _load_local(cfg.path, dtype)
    else:
        model = _from_architecture(cfg.architecture, tokenizer, seed).to(dtype)
    _check_vocab(model, tokenizer)
    return model


def _from_architecture(arch: ArchitectureConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    if arch.hidden_size % arch.num_heads:
        raise ConfigError(
            f"architecture.hidden_size {arch.hidden_size} is not divisible by num_heads {arch.num_heads}; "
            "pick sizes with hidden_size = num_heads × head_dim"
        )
    kv_heads = arch.num_kv_heads or arch.num_heads
    if arch.num_heads % kv_heads:
        raise ConfigError(
            f"architecture.num_heads {arch.num_heads} is not a multiple of num_kv_heads {kv_heads}; "
            "grouped-query attention needs whole groups"
        )
    config_cls, model_cls = _family(arch.family)
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=kv_heads,
        intermediate_size=arch.intermediate_size,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # fork_rng: a seeded init must not shift the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config)


def _load_local(path: str, dtype: torch.dtype) -> PreTrainedModel:
    if not Path(path).is_dir():
        raise ConfigError(
            f"model.path {path!r} is not a directory on this node; point it at a local Hugging Face model "
            "folder (nothing is downloaded) or give `architecture` instead. On a Ray cluster whose nodes do not all "
            "have that folder, set resources.shared_filesystem: false (the driver ships it to every node)"
        )
    from transformers import AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the model in {path!r}: {exc}") from exc
    model.train()  # from_pretrained returns eval mode; callers choose, like for built models
    return model


def _check_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ConfigError(
            f"the model embeds {rows} token ids but the tokenizer has {len(tokenizer)}; "
            "use the tokenizer the model was trained with"
        )


def save_hf_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Write model and tokenizer as one Hugging Face directory that ``build_model`` / ``build_tokenizer`` reload."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
