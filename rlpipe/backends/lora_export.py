"""What a LoRA trainer writes (``trainer.lora``): its checkpoint part and its saved model.

* Checkpoint: only the adapters (the optimizer holds only theirs) plus the base model's identity — where it
  comes from (``model.path`` or ``model.architecture``, dtype) and an XXH3-128 checksum of this rank's frozen
  tensors. A resume on another base, or a full-model checkpoint resumed with LoRA (and the reverse), is refused
  naming both sides: adapters only mean something on the weights they were trained against.
* Saved model (``trainer.lora.export``): ``merged`` — a plain Hugging Face folder (``config.json``,
  ``model.safetensors``, the tokenizer) whose adapted weights are ``W0 + scale·B·A``; ``adapter`` — peft's
  layout (``adapter_model.safetensors`` with keys ``base_model.model.<module>.lora_A.weight``,
  ``adapter_config.json``), which peft and vLLM's LoRA support load onto the base, plus ``rlpipe_base.json``.

Both are written by rank 0 from a stream of gathered tensors (every rank of a sharded backend iterates it).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlpipe.backends.lora import adapted_modules, base_checksum, base_identity, is_adapter, merged_parameters
from rlpipe.errors import ConfigError

BASE_FILE = "rlpipe_base.json"


def _checksum(trainer) -> str:
    """The checksum of this rank's base tensors (frozen: computed once per trainer)."""
    if getattr(trainer, "_lora_base_checksum", None) is None:
        local = trainer.backend.local
        trainer._lora_base_checksum = base_checksum((k, local(v)) for k, v in trainer.model.state_dict().items())
    return trainer._lora_base_checksum


def lora_checkpoint(trainer, model_state: dict) -> dict:
    """The model part of a LoRA trainer's checkpoint: the adapters of ``model_state`` and the base's identity."""
    return {"model": {k: v for k, v in model_state.items() if is_adapter(k)},
            "lora_base": {**base_identity(trainer.config.model), "checksum": _checksum(trainer)}}


def check_lora_checkpoint(trainer, state: dict) -> None:
    """Refuse ``state`` unless it was written by a trainer of the same kind (LoRA or not) on the same base."""
    saved = state.get("lora_base")
    if trainer.lora is None:
        if saved is not None:
            raise ConfigError("this checkpoint holds LoRA adapters (a run with trainer.lora) but this run trains the "
                              "whole model; resume with the same trainer.lora, or start a new run")
        return
    if saved is None:
        raise ConfigError("this checkpoint holds a whole model (a run without trainer.lora) but this run trains LoRA "
                          "adapters; resume without trainer.lora, or start a new run from its saved model "
                          "(model.path)")
    current = {**base_identity(trainer.config.model), "checksum": _checksum(trainer)}
    if saved != current:
        changed = sorted(k for k in {*saved, *current} if saved.get(k) != current.get(k))
        raise ConfigError(f"this checkpoint's adapters were trained on another base model ({', '.join(changed)} "
                          f"differ: checkpoint {[saved.get(k) for k in changed]}, this run "
                          f"{[current.get(k) for k in changed]}); resume with the model the checkpoint was made on")
    local = trainer.backend.local
    expected = {k: tuple(local(v).shape) for k, v in trainer.model.state_dict().items() if is_adapter(k)}
    saved_shapes = {k: tuple(v.shape) for k, v in state["model"].items()}
    if saved_shapes != expected:
        differ = sorted(k for k in {*saved_shapes, *expected} if saved_shapes.get(k) != expected.get(k))
        raise ConfigError(f"the checkpoint's adapters and this run's differ (e.g. {differ[0]}: checkpoint "
                          f"{saved_shapes.get(differ[0])}, this run {expected.get(differ[0])}); resume with the same "
                          "trainer.lora rank and target_modules")


def save_lora_model(trainer, path: str) -> str:
    """Save the policy of a LoRA ``trainer`` as ``trainer.lora.export`` says (see the module docstring), on rank 0;
    call it on every rank (a sharded model is gathered one parameter at a time)."""
    cfg = trainer.lora
    if cfg.export == "adapter":
        named = trainer.backend.full_parameters(trainer.model, is_adapter)
    else:
        named = merged_parameters(trainer.backend.full_parameters(trainer.model), set(adapted_modules(trainer.model)),
                                  cfg.alpha / cfg.rank)
    if trainer.rank != 0:
        for _ in named:
            pass  # take part in every gather
        return path
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in named}
    if cfg.export == "adapter":
        write_peft_adapter(out, tensors, cfg, trainer.config.model.path)
        # a sharded rank holds a shard of the base: its checksum would not identify the whole base
        checksum = None if trainer.backend.sharded else _checksum(trainer)
        (out / BASE_FILE).write_text(json.dumps({**base_identity(trainer.config.model), "checksum": checksum},
                                                indent=2))
    else:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        trainer.model.config.save_pretrained(out)
    trainer.tokenizer.save_pretrained(out)
    return path


def write_peft_adapter(out: Path, tensors: dict, cfg, base_path: str | None) -> Path:
    """Write adapters in peft's layout into the folder ``out`` (made if missing): ``adapter_model.safetensors``
    (``tensors``: the trainer's names, ``<module>.lora_A`` / ``.lora_B``, stored as peft's
    ``base_model.model.<module>.lora_A.weight``) and ``adapter_config.json`` (``cfg``: ``trainer.lora``). The final
    export (``export: adapter``) and every adapter push to vLLM (rlpipe.inference.vllm_lora) write it."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{k}.weight": v.detach().cpu().contiguous() for k, v in tensors.items()},
              out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(cfg, base_path), indent=2))
    return out


def peft_config(cfg, base_path: str | None) -> dict:
    """peft's ``adapter_config.json`` for adapters of ``cfg`` (``trainer.lora``) on the base at ``base_path``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": sorted(cfg.target_modules), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_path}
