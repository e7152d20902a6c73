"""Discriminative reward model: one forward pass, the score read at the last valid token.

The outcome reward model of InstructGPT (Ouyang et al., 2022) as verl's ``RewardModelWorker``
runs it: the prompt and the response (only its ``response_mask == 1`` tokens) are decoded
with the *policy* tokenizer, joined, and re-encoded with the *reward model's* tokenizer
when it has its own (a reward model trained with another vocabulary scores text, not ids).
Rows are right-padded into micro-batches, the backbone runs once, and the scalar head is
applied to the hidden state of each row's last non-padding token.

Two heads (``head``):

* ``sequence_classification`` — ``AutoModelForSequenceClassification`` with ``num_labels=1``
  (its ``score`` linear layer), from a local directory or built from an architecture;
* ``value_head`` — a causal LM's backbone plus a ``Linear(hidden, 1)`` value head (TRL's
  ``AutoModelForCausalLMWithValueHead``); from a local directory the head is read from
  ``value_head.pt`` there when present, else it starts at zero (a config-built model's
  head is seeded).

The model lives on the ``reward_model`` worker role (:mod:`rlpipe.engine.state.reward_pool`).
Left out: pairwise (Bradley–Terry) training of the RM, token-level (process) reward models,
and chat templates around prompt and response.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlpipe.errors import ConfigError
from rlpipe.schemas.config import ArchitectureConfig, TokenizerConfig


class RewardModelConfig(BaseModel):
    """Which reward model scores, and how."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: str | None = None
    """Local Hugging Face model directory (nothing is downloaded); exactly one of path / architecture."""
    architecture: ArchitectureConfig | None = None
    """Build a randomly initialized reward model of this shape instead (tests, smoke runs)."""
    tokenizer: TokenizerConfig | None = None
    """The reward model's own tokenizer; None = the policy's (ids are then still re-encoded from text)."""
    head: Literal["sequence_classification", "value_head"] = "sequence_classification"
    """`sequence_classification` (num_labels=1) or a causal LM with a linear value head."""
    micro_batch_size: int = Field(16, ge=1)
    """Rows per forward pass."""
    max_length: int = Field(1024, ge=2)
    """Re-encoded prompt+response tokens kept per row (the end is kept: the score is read there)."""
    seed: int = Field(0, ge=0)
    """Initialization seed of a model built from `architecture`."""
    timeout_s: float = Field(60.0, gt=0)
    """Per-call deadline of one scoring call (all rows of a pool worker); past it those rows get status
    `failed` (an infrastructure failure) and the call is abandoned."""
    latency_s: float = Field(0.0, ge=0)
    """Simulated latency added to each scoring call (tests, benchmarks: a remote RM's round trip); 0 = none."""

    @model_validator(mode="after")
    def _one_source(self) -> "RewardModelConfig":
        if (self.path is None) == (self.architecture is None):
            raise ValueError("reward model: give exactly one of `path` (a local model directory) or `architecture`")
        return self


class ValueHeadModel(torch.nn.Module):
    """A causal LM's backbone and a scalar value head."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.backbone = getattr(lm, lm.base_model_prefix)
        self.v_head = torch.nn.Linear(lm.config.hidden_size, 1)


def _load_value_head(head: torch.nn.Linear, path: Path) -> None:
    """``head``'s weight and bias from ``path`` (a state dict saved with ``torch.save``), read as tensors only (no
    pickled objects run) and checked: a file that is not such a state dict, or whose shapes differ, is a
    ConfigError naming the file and what it must hold."""
    want = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or {k: tuple(getattr(v, "shape", ())) for k, v in state.items()} != want:
            raise ValueError(f"it holds {_describe(state)}")
        if not all(bool(torch.isfinite(v).all()) for v in state.values()):
            raise ValueError("it holds non-finite values")
        head.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - any unreadable or wrong file is the same user error
        raise ConfigError(f"reward model value head {str(path)!r} is unusable: {exc}. It must be the state dict of "
                          f"the head, tensors {want} (torch.save(v_head.state_dict(), path)); remove it to start "
                          "the head at zero") from None


def _describe(state) -> str:
    if isinstance(state, dict):
        return "{" + ", ".join(f"{k!r}: {tuple(getattr(v, 'shape', ()))}" for k, v in state.items()) + "}"
    return f"a {type(state).__name__}"


def build_reward_model(cfg: RewardModelConfig, tokenizer) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone, scalar head) of the reward model ``cfg`` describes, in eval mode."""
    from transformers import AutoModelForSequenceClassification

    from rlpipe.backends.model import build_model
    from rlpipe.schemas.config import ModelConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.head == "value_head":
            lm = build_model(ModelConfig(path=cfg.path, architecture=cfg.architecture), tokenizer, cfg.seed)
            model = ValueHeadModel(lm)
            head_file = Path(cfg.path or "") / "value_head.pt"
            if cfg.path is not None:
                torch.nn.init.zeros_(model.v_head.weight), torch.nn.init.zeros_(model.v_head.bias)
                if head_file.is_file():
                    _load_value_head(model.v_head, head_file)
            backbone, head = model.backbone, model.v_head
        elif cfg.path is not None:
            if not Path(cfg.path).is_dir():
                raise ConfigError(f"reward model path {cfg.path!r} is not a directory; point it at a local "
                                  "Hugging Face model folder or give `architecture`")
            model = AutoModelForSequenceClassification.from_pretrained(cfg.path, num_labels=1, local_files_only=True)
            backbone, head = getattr(model, model.base_model_prefix), model.score
        else:
            lm = build_model(ModelConfig(architecture=cfg.architecture), tokenizer, cfg.seed)
            config = copy.deepcopy(lm.config)
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config)
            backbone, head = getattr(model, model.base_model_prefix), model.score
    backbone.eval(), head.eval()
    return backbone, head


def decode_pairs(prompt_ids: pa.Array, response_ids: pa.Array, response_mask: pa.Array, tokenizer) -> list[str]:
    """Prompt + response text of every row with the policy tokenizer (only ``response_mask == 1`` tokens)."""
    out = []
    for prompt, response, mask in zip(prompt_ids.to_pylist(), response_ids.to_pylist(), response_mask.to_pylist()):
        kept = [t for t, m in zip(response, mask) if m == 1]
        out.append(tokenizer.decode(prompt, skip_special_tokens=True) + tokenizer.decode(kept, skip_special_tokens=True))
    return out


class RewardModel:
    """A reward model and its tokenizer; ``score(texts)`` is one batched forward pass per micro-batch."""

    def __init__(self, cfg: RewardModelConfig, policy_tokenizer):
        from rlpipe.backends.tokenizer import build_tokenizer

        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg.tokenizer) if cfg.tokenizer is not None else policy_tokenizer
        self.backbone, self.head = build_reward_model(cfg, self.tokenizer)

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``[B, T]`` ids and attention mask of ``texts`` under the RM tokenizer (ends kept)."""
        rows = [self.tokenizer.encode(t, add_special_tokens=False)[-self.cfg.max_length:] or
                [self.tokenizer.eos_token_id] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return ids, mask

    @torch.no_grad()
    def score(self, texts: list[str]) -> np.ndarray:
        """float32 ``[B]``: the head applied at each row's last valid token."""
        out = np.zeros(len(texts), dtype=np.float32)
        if self.cfg.latency_s:
            time.sleep(self.cfg.latency_s)
        size = self.cfg.micro_batch_size
        for start in range(0, len(texts), size):
            ids, mask = self.encode(texts[start : start + size])
            hidden = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
            last = mask.sum(dim=1) - 1
            at_last = hidden[torch.arange(ids.shape[0]), last]
            out[start : start + len(ids)] = self.head(at_last).squeeze(-1).float().numpy()
        return out
