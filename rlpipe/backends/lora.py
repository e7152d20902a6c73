"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), rlpipe's own.

A targeted ``nn.Linear`` becomes a :class:`LoRALinear`: the same frozen weight W0 (and bias) under the same
names, plus two trainable matrices ``lora_A`` [r, in] (Kaiming-uniform, as peft) and ``lora_B`` [out, r]
(zero, so the first policy is the base model); ``y = x·W0ᵀ + b + (alpha / r)·dropout(x)·Aᵀ·Bᵀ``.

Why not ``peft``: it is not a dependency, and what rlpipe needs is small and must fit places peft does not
reach: the lean forward (``rlpipe.backends.lean_forward``) reads each projection's weight directly and applies
:meth:`LoRALinear.delta` itself; FSDP2 shards the wrapped model like any other (the adapters are ordinary
parameters of the decoder layers); the rollout engine keeps the base and merges each pushed adapter into its
own copy (:class:`MergedAdapter`), recomputed from the kept base at every push so rounding never accumulates
(no merge → send → unmerge).

Left out: adapters on embeddings and the LM head (with tied embeddings an adapted head would untie them),
several adapters at once, rank-stabilized or DoRA scaling, quantized bases (QLoRA), adapters in a dtype other
than the model's.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
import xxhash

from rlpipe.errors import ConfigError

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` is a LoRA matrix (what trains, travels and is checkpointed)."""
    return name.endswith(ADAPTER_SUFFIXES)


class LoRALinear(torch.nn.Linear):
    """A frozen linear layer plus a trainable low-rank delta (see the module docstring). ``weight`` and ``bias``
    are the base layer's own parameters (not copies), so the model's other names and tied storage are unchanged."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float, dropout: float):
        torch.nn.Module.__init__(self)  # not Linear's: it would allocate and initialize a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = torch.nn.Parameter(torch.empty(rank, base.in_features, **like))
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank, **like))
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / rank
        self.dropout = dropout

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scale · dropout(x)·Aᵀ·Bᵀ``. Dropout only where gradients flow (the update): π_old, the reference and
        the rollout see the adapter without it, as in evaluation mode."""
        if self.dropout and self.training and torch.is_grad_enabled():
            x = F.dropout(x, self.dropout, training=True)
        return F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.delta(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}, dropout={self.dropout:g}"


def merged(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W0 + scale·B·A`` in float32, returned in ``base``'s dtype."""
    delta = lora_b.detach().float() @ lora_a.detach().float()
    return (base.detach().float() + scale * delta).to(base.dtype)


def targets(model: torch.nn.Module, names: Sequence[str]) -> list[str]:
    """Full names of ``model``'s linear modules whose last name part is in ``names`` (the LM head never), in
    module order. A name that matches nothing is a :class:`ConfigError` listing the names that would."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    missing = sorted(set(names) - {n.rsplit(".", 1)[-1] for n in found})
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n in found})
        raise ConfigError(f"trainer.lora.target_modules: {', '.join(map(repr, missing))} is not a linear module of "
                          f"{type(model).__name__}; its linear modules are {', '.join(known)}: use those names")
    return [n for n in found if n.rsplit(".", 1)[-1] in names]


def apply_lora(model: torch.nn.Module, cfg, seed: int) -> list[str]:
    """Freeze every parameter of ``model`` and put a :class:`LoRALinear` in place of each target of ``cfg``
    (``trainer.lora``); the A matrices are drawn from ``seed`` (the global torch RNG is left as it was). Returns
    the adapted modules' names."""
    names = targets(model, cfg.target_modules)
    for param in model.parameters():
        param.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name in names:
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, leaf, LoRALinear(getattr(owner, leaf), cfg.rank, cfg.alpha, cfg.dropout))
    return names


def adapted_modules(model: torch.nn.Module) -> dict[str, LoRALinear]:
    """Name → :class:`LoRALinear` of every adapted module of ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merged_parameters(named: Iterable[tuple[str, torch.Tensor]], adapted: set[str],
                      scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's (name, tensor) from a LoRA model's ``named`` parameters (in ``named_parameters`` order:
    a module's ``weight`` before its ``lora_A`` and ``lora_B``): each adapted module's weight merged, the adapters
    dropped. Consumed lazily (a sharded trainer's gather); holds at most one module's tensors."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        module, _, leaf = name.rpartition(".")
        if module not in adapted or leaf == "bias":
            yield name, tensor
            continue
        held[leaf] = tensor
        if leaf == "lora_B":
            yield f"{module}.weight", merged(held["weight"], held["lora_A"], held["lora_B"], scale)
            held = {}


def base_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """XXH3-128 of the frozen (non-adapter) tensors' names, dtypes, shapes and bytes: the base model's identity in
    a checkpoint (a resume on another base would train adapters made for different weights)."""
    digest = xxhash.xxh3_128()
    for name, tensor in named:
        if is_adapter(name):
            continue
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def base_identity(model_config) -> dict:
    """Where the base model comes from, as a checkpoint and an adapter export record it."""
    if model_config.path is not None:
        return {"path": model_config.path, "dtype": model_config.dtype}
    return {"architecture": model_config.architecture.model_dump(mode="json"), "dtype": model_config.dtype}


class MergedAdapter:
    """The rollout engine's side of LoRA: the base weights W0 of the adapted modules are kept; a push brings A and
    B (checked like any weight push: names, shapes, dtypes, checksums) and each module's weight becomes
    ``W0 + scale·B·A``, recomputed from the kept W0 every time. The engine's model stays a plain model, so its
    decode (the lean forward included) runs at full speed; the price is one extra copy of the adapted weights."""

    def __init__(self, model: torch.nn.Module, cfg):
        self.model = model
        self.scale = cfg.alpha / cfg.rank
        self.names = targets(model, cfg.target_modules)
        self.base = {n: model.get_submodule(n).weight.detach().clone() for n in self.names}
        """The base weight of every adapted module, as the engine's model was built."""
        self.slots = adapter_holder(model, self.names, cfg.rank)
        """A module tree holding ``<module>.lora_A`` / ``.lora_B`` (float32) under the trainer's names: a push is
        checked and loaded into it by the ordinary bucket loaders."""

    @property
    def weight_names(self) -> list[str]:
        """The engine model's parameters a merge rewrites (``<module>.weight``)."""
        return [f"{n}.weight" for n in self.names]

    @torch.no_grad()
    def load(self, push) -> list[str]:
        """Load a push (buckets, or :class:`~rlpipe.backends.weights.LocalTensors`) into the slots, every tensor
        checked before any is written, then merge; returns the names loaded."""
        from rlpipe.backends.weights import LocalTensors, load_buckets, load_tensors

        loaded = load_tensors(self.slots, push.tensors) if isinstance(push, LocalTensors) else \
            load_buckets(self.slots, push)
        slots = dict(self.slots.named_modules())
        for name in self.names:
            weight, base = self.model.get_submodule(name).weight, self.base[name]
            slot = slots[name]
            if weight.dtype == base.dtype == slot.lora_A.dtype == torch.float32:
                # one pass over the weight (read W0, write W): the merge is memory-bound, and the general path's
                # temporaries made a 2.5 MB adapter push slower than the 97 MB full push it replaces
                torch.addmm(base, slot.lora_B, slot.lora_A, alpha=self.scale, out=weight)
            else:
                weight.copy_(merged(base, slot.lora_A, slot.lora_B, self.scale))
        return loaded


def adapter_holder(model: torch.nn.Module, names: Sequence[str], rank: int) -> torch.nn.Module:
    """A module tree with zero float32 ``<module>.lora_A`` [rank, in] / ``.lora_B`` [out, rank] for each adapted
    module of ``model`` in ``names``, under the trainer's names: an engine loads an adapter push into it with the
    ordinary bucket loaders (checksums, names, shapes, full coverage checked; other float dtypes converted)."""
    holder = torch.nn.Module()
    for name in names:
        weight = model.get_submodule(name).weight
        slot = torch.nn.Module()
        slot.lora_A = torch.nn.Parameter(torch.zeros(rank, weight.shape[1], device=weight.device), requires_grad=False)
        slot.lora_B = torch.nn.Parameter(torch.zeros(weight.shape[0], rank, device=weight.device), requires_grad=False)
        _put(holder, name, slot)
    return holder


def _put(root: torch.nn.Module, dotted: str, module: torch.nn.Module) -> None:
    """Place ``module`` at ``dotted`` below ``root``, creating empty parents."""
    *parents, leaf = dotted.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            node.add_module(part, torch.nn.Module())
        node = getattr(node, part)
    node.add_module(leaf, module)


def linear_module_names(model_config) -> tuple[str, set[str]]:
    """The model class name and the last name parts of its linear modules (the LM head left out), from the config
    alone: the model is built on the meta device with one layer, so nothing is allocated and no weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if model_config.path is not None:
        hf = AutoConfig.from_pretrained(model_config.path, local_files_only=True)
    else:
        arch = model_config.architecture
        hf = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch.family](
            hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads, intermediate_size=arch.intermediate_size,
            num_key_value_heads=arch.num_kv_heads or arch.num_heads, vocab_size=16)
    hf.num_hidden_layers = 1  # every layer has the same modules
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    head = model.get_output_embeddings()
    return type(model).__name__, {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                  if isinstance(m, torch.nn.Linear) and m is not head}
