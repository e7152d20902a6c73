"""Trainer backends: how the DP ranks of a trainer hold the model (``trainer.backend``).

* ``replicated`` — every rank holds the full model, gradients and AdamW state; gradients are
  summed over the ranks by one gloo all-reduce of the flattened grads before clipping.
* ``fsdp2`` — torch's FSDP2 (``torch.distributed.fsdp.fully_shard``, Zhao et al. 2023, "PyTorch
  FSDP"): every decoder layer and the root are sharded along dim 0 over the DP ranks, so
  parameters, gradients and AdamW moments are all ``DTensor`` shards (≈ 1/world of each per
  rank). Parameters are all-gathered per layer in forward/backward and gradients
  reduce-scattered as the backward leaves each layer, **summed** (divide factor 1) to keep the
  global-token-denominator contract of ``rlpipe.stages.algos.policy_loss``. Ranks must run the
  same number of forward/backward passes: :meth:`TrainState.lockstep_passes` agrees on it.
  Runs on gloo/CPU (measured with torch 2.13) and NCCL alike. Left out: mixed precision policies,
  CPU offload, prefetch tuning, resharding a checkpoint to another world size.
* ``megatron`` — megatron-core's GPTModel built from the HF config, passes through its
  pipeline schedule (``forward_only`` log-prob passes; the policy loss injected as the
  schedule's loss function, with the global denominator), its distributed optimizer, export to
  HF names (``rlpipe.backends.megatron_trainer``, ``rlpipe.engine.state.megatron_state``). CUDA
  only (megatron-core's RNG tracker, RoPE, schedules and DDP allocate on ``cuda``): refused by
  the plan check on CPU; TP = PP = 1; no checkpoints, no critic.

A backend is registered in the ``trainer_backend`` registry
(:mod:`rlpipe.engine.state.trainer_backend_registry`, re-exported here); ``TrainState`` looks its
backend up there and calls its hooks, and ``build_state`` builds the rank's state, so this module
sits above the states it builds.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rlpipe.engine.state.megatron_state import MegatronTrainState
from rlpipe.engine.state.train_state import TrainState
from rlpipe.engine.state.trainer_backend_registry import TRAINER_BACKENDS
from rlpipe.errors import ConfigError


class ReplicatedBackend:
    """Full replica per rank; gradients all-reduced (summed) as one flat tensor."""

    name = "replicated"
    sharded = False
    """Whether every rank must take part in exports, saves and forward passes (collectives inside)."""

    def check(self, config) -> None:
        """Plan-time check of the pipeline for this backend (raises ConfigError saying what to change)."""

    def build_state(self, config, rank: int, world_size: int, dist_address: str | None):
        """The actor's trainer state for one DP rank under this backend."""
        return TrainState(config, rank, world_size, dist_address)

    def wrap(self, model: torch.nn.Module, world_size: int) -> torch.nn.Module:
        return model

    def reduce_gradients(self, params: list[torch.nn.Parameter], world_size: int) -> None:
        if world_size == 1 or not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def full_parameters(self, model: torch.nn.Module,
                        only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every parameter (those whose name ``only`` accepts), one at a time (tied ones
        once)."""
        for name, p in model.named_parameters():
            if only is None or only(name):
                yield name, p.detach()

    def local(self, tensor):
        """This rank's part of ``tensor`` as a plain tensor."""
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    @staticmethod
    def full(tensor):
        """The whole of a (possibly sharded) tensor; a collective for a ``DTensor``."""
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class FSDP2Backend(ReplicatedBackend):
    """``fully_shard`` on every decoder layer (HF ``_no_split_modules``) and on the root."""

    name = "fsdp2"
    sharded = True

    def wrap(self, model: torch.nn.Module, world_size: int) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if world_size > 1 and not dist.is_initialized():
            raise ConfigError("trainer.backend fsdp2 needs the DP process group; it is joined before wrapping")
        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
        layer_classes = set()
        for module in model.modules():
            layer_classes.update(getattr(module, "_no_split_modules", None) or ())
        for module in list(model.modules()):
            if module is not model and type(module).__name__ in layer_classes:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # sum, not mean: losses are already normalized by the global token/sequence counts. A plain
                # SUM reduce-scatter (a divide factor alone becomes PREMUL_SUM, which gloo lacks)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    def reduce_gradients(self, params: list[torch.nn.Parameter], world_size: int) -> None:
        """Nothing to do: FSDP2 reduce-scattered (summed) every gradient during the backward."""

    def full_parameters(self, model: torch.nn.Module,
                        only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """All-gathers one parameter at a time (every rank must iterate in step)."""
        for name, p in model.named_parameters():
            if only is None or only(name):
                yield name, self.full(p.detach())


class MegatronBackend(ReplicatedBackend):
    """megatron-core GPTModel, its schedules and distributed optimizer (rlpipe.backends.megatron_trainer); CUDA only."""

    name = "megatron"
    sharded = True

    def check(self, config) -> None:
        if config.resources.device != "cuda":
            raise ConfigError(
                "trainer.backend megatron needs CUDA (resources.device: cuda on a GPU machine): megatron-core's "
                "RNG tracker, RoPE, attention, DDP and pipeline schedules allocate on a GPU. On CPU use "
                "trainer.backend fsdp2 (sharded) or replicated"
            )
        if config.trainer.checkpoint_every:
            raise ConfigError("trainer.backend megatron does not write checkpoints (megatron's distributed "
                              "checkpointing is not wired in); set trainer.checkpoint_every: 0")
        if config.trainer.lora is not None:
            raise ConfigError("trainer.lora is not implemented for trainer.backend megatron (megatron-core has its own "
                              "GPTModel layers); use trainer.backend replicated or fsdp2, or drop trainer.lora")
        critics = [s.kind for s in config.stages if s.kind.startswith("critic")]
        if critics:
            raise ConfigError(f"trainer.backend megatron trains the actor only; the pipeline has {critics[0]} "
                              "stages (a critic): use trainer.backend fsdp2 or replicated for PPO with a critic")

    def build_state(self, config, rank: int, world_size: int, dist_address: str | None):
        return MegatronTrainState(config, rank, world_size, dist_address)

    def wrap(self, model: torch.nn.Module, world_size: int) -> torch.nn.Module:
        raise ConfigError("trainer.backend megatron builds its own model (MegatronTrainState); it wraps no torch module")

    def full_parameters(self, model, only=None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names of the GPTModel's weights (fused QKV and gate/up split back); ``only`` is not used (LoRA is
        refused by :meth:`check`)."""
        yield from model.named_hf_parameters()


TRAINER_BACKENDS.add("replicated", ReplicatedBackend())
TRAINER_BACKENDS.add("fsdp2", FSDP2Backend())
TRAINER_BACKENDS.add("megatron", MegatronBackend())
