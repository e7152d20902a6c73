"""State of a data-parallel trainer worker (roles ``actor`` and ``critic``).

Holds the model, AdamW, the LR schedule (counted in *local* updates) and the
gloo process group joining the DP ranks. Gradients are **summed** across ranks
by :meth:`TrainState.optimizer_step`: losses are normalized by global token or
sequence counts agreed before the backward pass (see
``rlpipe.stages.algos.policy_loss``), so the sum is the exact full-batch
gradient whatever the micro-batch and DP split.

With ``trainer.lora`` the actor's targeted layers get LoRA adapters before the
backend wraps the model (``rlpipe.backends.lora``): only they train, AdamW holds
only theirs, pushes carry only them, and checkpoints and saved models are written
by ``rlpipe.backends.lora_export``.
"""

from __future__ import annotations

import logging
import math
import warnings
import os
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlpipe.backends.lora import apply_lora, is_adapter
from rlpipe.backends.lora_export import check_lora_checkpoint, lora_checkpoint, save_lora_model
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import LocalTensors, WeightPush, pack_buckets
from rlpipe.engine.host import configure_process
from rlpipe.engine.state.trainer_backend_registry import TRAINER_BACKENDS
from rlpipe.errors import ConfigError, RlpipeError
from rlpipe.schemas.config import LRScheduleConfig, PipelineConfig

log = logging.getLogger(__name__)


class NumericalError(RlpipeError):
    """An update produced non-finite numbers or stopped learning (trainer.on_nonfinite,
    trainer.max_zero_grad_updates); raised before the step's weight push."""


def lr_lambda(schedule: LRScheduleConfig, total_updates: int):
    """Multiplier of the peak LR after ``u`` local updates."""

    def factor(u: int) -> float:
        if schedule.warmup_updates and u < schedule.warmup_updates:
            return (u + 1) / schedule.warmup_updates
        if schedule.name == "constant":
            return 1.0
        span = max(1, total_updates - schedule.warmup_updates)
        progress = min(1.0, (u - schedule.warmup_updates) / span)
        if schedule.name == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * shape

    return factor


def updates_per_step(config: PipelineConfig) -> int:
    """Local optimizer updates in one global step: mini-batches × epochs."""
    trainer = config.trainer
    mini = trainer.ppo_mini_batch_size or config.data.prompts_per_step
    return (config.data.prompts_per_step // mini) * trainer.ppo_epochs


class TrainState:
    """Model + optimizer + schedule + DP group of one trainer rank."""

    def __init__(self, config: PipelineConfig, rank: int, world_size: int, dist_address: str | None,
                 model_factory: Callable[[Any], torch.nn.Module] | None = None, adapters: bool = True):
        configure_process(config)
        torch.manual_seed(config.seed)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(config.resources.device)
        self._dist_host = dist_address.rsplit(":", 1)[0] if dist_address else None
        """This node's address as the DP rendezvous knows it (the broadcast transport's default store host)."""
        self.tokenizer = build_tokenizer(config.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        factory = model_factory or (lambda tok: build_model(config.model, tok, config.seed))
        self.backend = TRAINER_BACKENDS.get(config.trainer.backend)
        self.model = factory(self.tokenizer).to(self.device)
        self.model.train()
        self.lora = config.trainer.lora if adapters else None
        """``trainer.lora`` when this trainer trains adapters only (the actor; a critic passes ``adapters=False``)."""
        if self.lora is not None:  # before sharding: FSDP2 then shards the adapters like any parameter
            apply_lora(self.model, self.lora, config.seed)
        if world_size > 1:
            self._join_group(dist_address)
        self.model = self.backend.wrap(self.model, world_size)
        opt = config.trainer.optimizer
        # torch's fused AdamW: one kernel over all parameters (~5x the multi-tensor loop's speed on CPU at 24M
        # parameters); the sharded backends' DTensor parameters keep the default implementation
        fused = config.trainer.backend == "replicated" and self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.AdamW(  # only what trains: with trainer.lora the adapters alone
            [p for p in self.model.parameters() if p.requires_grad], lr=opt.lr, betas=opt.betas, eps=opt.eps,
            weight_decay=opt.weight_decay,
            **({"fused": True} if fused else {}),
        )
        self.total_updates = config.trainer.total_steps * updates_per_step(config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(config.trainer.lr_schedule, self.total_updates)
        )
        self.local_updates = 0
        self.version = 0
        self.skipped_updates = 0
        """Updates dropped for a non-finite loss or grad norm (trainer.on_nonfinite: skip)."""
        self.zero_grad_streak = 0
        """Consecutive updates with a zero grad norm although their advantages were not all zero."""

    def _join_group(self, address: str | None) -> None:
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"tcp://{address}", rank=self.rank, world_size=self.world_size,
                timeout=timedelta(minutes=10),
            )

    # --- collectives -------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over DP ranks (in place) and return it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_reduce_mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Average scalar metrics over DP ranks (same keys on every rank)."""
        if self.world_size == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        self.all_reduce_sum(values)
        return {k: float(v) / self.world_size for k, v in zip(keys, values)}

    def lockstep_passes(self, count: int) -> int:
        """How many forward passes this rank runs where it has ``count`` micro-batches: ``count``, or the most
        any rank has when the backend's collectives (FSDP2's per-layer all-gathers) need every rank in every
        pass; the rest are :meth:`idle_pass` es."""
        if not self.backend.sharded or self.world_size == 1:
            return count
        most = torch.tensor([float(count)], dtype=torch.float64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    def idle_pass(self, backward: bool) -> None:
        """A forward (and, with ``backward``, a zero-gradient backward) on one pad token: keeps this rank in
        step with ranks that have more micro-batches; it changes no gradient."""
        ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward):
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.zeros_like(ids))
            out = getattr(out, "logits", out)
            if backward:
                (out.sum() * 0.0).backward()

    # --- optimization ------------------------------------------------------
    def optimizer_step(self, loss_finite: bool = True, expect_grad: bool = False) -> dict[str, float]:
        """Sum grads over ranks, clip, step the optimizer and the schedule; returns grad norm, LR and
        ``skipped`` (1.0 when the update was dropped).

        The numbers are guarded: a non-finite loss (``loss_finite`` False on any rank) or grad norm
        fails the run (:class:`NumericalError`) or drops the update (``trainer.on_nonfinite``);
        non-finite parameters after the step always fail; ``expect_grad`` (the advantages are not all
        zero) with a zero grad norm for ``trainer.max_zero_grad_updates`` updates in a row fails.
        """
        trainer = self.config.trainer
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.world_size > 1:
            flag = self.all_reduce_sum(torch.tensor([0.0 if loss_finite else 1.0], dtype=torch.float64))
            loss_finite = bool(flag.item() == 0)
            self.backend.reduce_gradients(params, self.world_size)
        clip = trainer.grad_clip
        # on sharded (DTensor) grads clip_grad_norm_ reduces the norm over the ranks itself
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf")) if params else torch.tensor(0.0)
        grad_norm = self.backend.full(grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        stepped = self._finite_or_skip(loss_finite, float(grad_norm))
        if stepped:
            self.optimizer.step()
            self._check_parameters()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # a skipped update still counts in the schedule (it counts local updates); torch warns about that order
            if not stepped:
                warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        self.local_updates += 1
        self._watch_zero_grad(stepped and expect_grad and float(grad_norm) == 0.0)
        return {"grad_norm": float(grad_norm), "lr": lr, "skipped": 0.0 if stepped else 1.0}

    def _finite_or_skip(self, loss_finite: bool, grad_norm: float) -> bool:
        """Whether this update may step: False (counted and logged) when the loss or gradient norm is
        non-finite and trainer.on_nonfinite is skip; a NumericalError when it is fail."""
        if loss_finite and math.isfinite(grad_norm):
            return True
        what = "the loss is non-finite" if not loss_finite else f"the gradient norm is {grad_norm}"
        if self.config.trainer.on_nonfinite == "fail":
            raise NumericalError(
                f"local update {self.local_updates}: {what}; the update was not applied and no weights were "
                "pushed. Lower trainer.optimizer.lr, set trainer.grad_clip, check the rewards/advantages, or "
                "set trainer.on_nonfinite: skip to drop such updates"
            )
        self.skipped_updates += 1
        log.warning("non-finite grad norm %s at local update %d (%s): update skipped",
                    grad_norm, self.local_updates, what)
        return False

    def _check_parameters(self) -> None:
        bad = [name for name, p in self.model.named_parameters()
               if p.requires_grad and not bool(torch.isfinite(self.backend.local(p)).all())]
        if self.backend.sharded and self.world_size > 1:  # every rank raises, none waits in a collective
            flags = self.all_reduce_sum(torch.tensor([float(bool(bad))], dtype=torch.float64))
            bad = bad or (["<a shard on another rank>"] if flags.item() else [])
        if bad:
            raise NumericalError(
                f"local update {self.local_updates}: parameter {bad[0]!r} became non-finite after the optimizer "
                f"step (lr {self.scheduler.get_last_lr()[0]:g}); the weights were not pushed. Lower "
                "trainer.optimizer.lr or set trainer.grad_clip"
            )

    def _watch_zero_grad(self, zero: bool) -> None:
        self.zero_grad_streak = self.zero_grad_streak + 1 if zero else 0
        limit = self.config.trainer.max_zero_grad_updates
        if limit and self.zero_grad_streak >= limit:
            raise NumericalError(
                f"the gradient norm was 0 for {self.zero_grad_streak} consecutive updates although the advantages "
                "were not all 0: the model stopped learning (saturated or diverged, e.g. a far too large lr). Lower "
                "trainer.optimizer.lr, or raise trainer.max_zero_grad_updates (0 disables this check)"
            )

    # --- weights -----------------------------------------------------------
    def export_weights(self):
        """Inference-layout weight buckets of the current model (see rlpipe.backends.weights), on rank 0.

        Call it on every rank: a sharded backend all-gathers one parameter at a time (every rank takes
        part) and rank 0 packs them, holding at most one bucket of full tensors beyond its shard. Other
        ranks return None (a replicated one at once, without any work).
        """
        if self.rank != 0:
            if self.backend.sharded:
                for _ in self.pushed_parameters():
                    pass  # take part in every gather
            return None
        return pack_buckets(self.pushed_parameters())

    def pushed_parameters(self):
        """(name, full tensor) of what a push carries, one at a time: every parameter, or with trainer.lora the
        adapters alone (the engines keep the base). Call on every rank of a sharded backend (gathers)."""
        return self.backend.full_parameters(self.model, is_adapter if self.lora is not None else None)

    def export_for_push(self) -> WeightPush | None:
        """``export_weights`` timed, for a weight push (boundary 1 of weight sync); None off rank 0."""
        start = time.perf_counter()
        buckets = self.export_weights()
        if buckets is None:
            return None
        return WeightPush(tuple(buckets), export_s=time.perf_counter() - start, exported_at=time.time())

    def export_local_push(self) -> LocalTensors | WeightPush | None:
        """A push to a rollout engine in this process (the inline backend, resources.colocate), not deferred: the
        parameters themselves (:class:`LocalTensors`; the engine copies them in at once), or
        :meth:`export_for_push`'s buckets when this rank does not hold them whole. None off rank 0."""
        if self.backend.sharded:
            return self.export_for_push()
        if self.rank != 0:
            return None
        start = time.perf_counter()
        tensors = tuple(self.pushed_parameters())
        return LocalTensors(tensors, export_s=time.perf_counter() - start)

    def export_delta_push(self, full_every: int):
        """A delta push (rlpipe.backends.weight_delta) of the next version against this rank's last one; every
        ``full_every``-th push is whole. Call on every rank (gathers); None off rank 0."""
        from rlpipe.backends.weight_delta import DeltaSender

        start = time.perf_counter()
        buckets = self.export_weights()
        if buckets is None:
            return None
        if getattr(self, "_delta_sender", None) is None:
            self._delta_sender = DeltaSender()
        return self._delta_sender.make(buckets, self.version + 1, full_every, time.perf_counter() - start)

    def broadcast_export(self, replicas: int, backend: str, host: str | None, timeout_s: float):
        """Pack the next push for the broadcast transport (rlpipe.backends.weight_broadcast) and return its plan
        (metadata only); the bytes go in :meth:`broadcast_send`. Call on every rank (gathers); None off rank 0."""
        from rlpipe.backends.weight_broadcast import BroadcastSender

        start = time.perf_counter()
        buckets = self.export_weights()
        if buckets is None:
            return None
        if getattr(self, "_broadcast", None) is None:
            self._broadcast = BroadcastSender(self.device, self._dist_host)
        return self._broadcast.plan(buckets, self.version + 1, replicas, backend, host, timeout_s,
                                    time.perf_counter() - start)

    def broadcast_send(self) -> dict[str, float]:
        """Rank 0: broadcast the buckets :meth:`broadcast_export` packed to the weight group (other ranks: nothing)."""
        if self.rank != 0:
            return {}
        return self._broadcast.send()

    def bump_version(self) -> int:
        self.version += 1
        return self.version

    def get_version(self) -> int:
        return self.version

    def borrowed_rollout(self, *args: Any) -> dict:
        """separate_async's hybrid borrow: generate, score and store groups with this rank's current weights
        (:mod:`rlpipe.engine.state.borrowed_rollout`; its engine is built on the first borrow)."""
        if getattr(self, "_borrowed", None) is None:
            from rlpipe.engine.state.borrowed_rollout import BorrowedRollout

            self._borrowed = BorrowedRollout(self)
        return self._borrowed.run(*args)

    def save_hf(self, path: str) -> str:
        """Save the policy as a HF model directory on rank 0 (call on every rank: a sharded model is gathered)."""
        from rlpipe.backends.model import save_hf_model

        if self.lora is not None:
            return save_lora_model(self, path)
        if self.backend.sharded:  # every rank takes part in each gather; only rank 0 keeps (and saves) a copy
            gathered = self.backend.full_parameters(self.model)
            if self.rank != 0:
                for _ in gathered:
                    pass
                return path
            os.makedirs(path, exist_ok=True)
            save_hf_model(self._unsharded_copy(gathered), self.tokenizer, path)
            return path
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            save_hf_model(self.model, self.tokenizer, path)
        return path

    @torch.no_grad()
    def _unsharded_copy(self, gathered) -> torch.nn.Module:
        """A plain (unsharded) model of the same architecture filled from ``gathered`` (name, full tensor) pairs,
        one tensor at a time."""
        model = build_model(self.config.model, self.tokenizer, self.config.seed)
        params = dict(model.named_parameters())
        seen = set()
        for name, tensor in gathered:
            if name not in params:
                raise RlpipeError(f"cannot save the sharded model as HF: {name!r} is not a parameter of the model")
            params[name].copy_(tensor)
            seen.add(name)
        if seen != set(params):
            raise RlpipeError(f"cannot save the sharded model as HF: {sorted(set(params) - seen)[:3]} were not gathered")
        return model

    # --- checkpoint --------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state; a sharded backend's tensors are this rank's local shards (plain tensors)."""
        local = self.backend.local
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {k: {n: local(v) for n, v in st.items()} for k, st in optimizer["state"].items()}
        model = {k: local(v) for k, v in self.model.state_dict().items()}
        return {
            **(lora_checkpoint(self, model) if self.lora is not None else {"model": model}),
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "local_updates": self.local_updates,
            "version": self.version,
            "rng": torch.get_rng_state(),
            "layout": {"backend": self.config.trainer.backend, "world_size": self.world_size},
        }

    def save_checkpoint(self, prefix: str) -> list[str]:
        """Write this rank's state as ``<prefix>_rank<r>.safetensors`` (tensors) + ``.json`` (the rest); no pickle."""
        from pathlib import Path

        from rlpipe.engine.state.safe_io import save_state

        target = Path(f"{prefix}_rank{self.rank}")
        return [str(p) for p in save_state(self.state_dict(), target.parent, target.name)]

    def load_checkpoint(self, prefix: str) -> None:
        """Load what :meth:`save_checkpoint` wrote (safetensors and JSON: data only, nothing executed)."""
        from pathlib import Path

        from rlpipe.engine.state.safe_io import load_state

        target = Path(f"{prefix}_rank{self.rank}")
        self.load_state_dict(load_state(target.parent, target.name))

    def checkpoint_files(self, stem: str) -> dict[str, bytes]:
        """This rank's state as the files :meth:`save_checkpoint` would write for prefix ``stem`` (name → bytes),
        for a driver on another node to write (resources.shared_filesystem false); no pickle."""
        from rlpipe.engine.state.safe_io import encode_state

        return encode_state(self.state_dict(), f"{stem}_rank{self.rank}")

    def load_checkpoint_files(self, stem: str, files: dict[str, bytes]) -> None:
        """Load the files :meth:`checkpoint_files` made (sent back by the driver); parses data only."""
        from rlpipe.engine.state.safe_io import decode_state

        self.load_state_dict(decode_state(files, f"{stem}_rank{self.rank}"))

    def hf_files(self) -> dict[str, bytes]:
        """:meth:`save_hf` into a node-local temporary folder, returned as file name → bytes on rank 0 (empty on the
        others, which only take part in a sharded model's gathers); the driver writes them."""
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="rlpipe-hf-") as tmp:
            self.save_hf(tmp)
            if self.rank != 0:
                return {}
            return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}

    def checkpoint_bytes(self) -> int:
        """Estimated size of this rank's checkpoint: the model (with trainer.lora: the adapters) plus AdamW's two
        moments."""
        return 3 * sum(self.backend.local(p).numel() * p.element_size() for p in self.model.parameters()
                       if p.requires_grad or self.lora is None)

    def saved_model_bytes(self) -> int:
        """This rank's share of the model :meth:`save_hf` writes: every parameter; with trainer.lora the base's
        (export ``merged``) or the adapters alone (export ``adapter``)."""
        def saved(name: str) -> bool:
            return self.lora is None or is_adapter(name) == (self.lora.export == "adapter")

        return sum(self.backend.local(p).numel() * p.element_size() for n, p in self.model.named_parameters()
                   if saved(n))

    def load_state_dict(self, state: dict) -> None:
        layout = state.get("layout", {"backend": "replicated", "world_size": self.world_size})
        sharded = self.backend.sharded or layout["backend"] != "replicated"
        if sharded and (layout["backend"], layout["world_size"]) != (self.config.trainer.backend, self.world_size):
            raise ConfigError(
                f"this checkpoint holds {layout['backend']} shards of {layout['world_size']} rank(s), but the trainer "
                f"runs {self.config.trainer.backend} on {self.world_size}; resume with the same trainer.backend and "
                "trainer.dp_size (resharding a checkpoint is not implemented)"
            )
        check_lora_checkpoint(self, state)  # adapters only load onto the base they were trained on
        if self.backend.sharded:
            self._load_sharded(state)
        else:
            self.model.load_state_dict(state["model"], strict=self.lora is None)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.local_updates = state["local_updates"]
        self.version = state["version"]
        torch.set_rng_state(state["rng"])

    @torch.no_grad()
    def _load_sharded(self, state: dict) -> None:
        """Copy local shards into the DTensors of the model and re-wrap the optimizer's moments as DTensors."""
        from torch.distributed.tensor import DTensor

        current = {k: v for k, v in self.model.state_dict().items() if self.lora is None or is_adapter(k)}
        if set(current) != set(state["model"]):
            raise ConfigError(f"checkpoint and model differ in names: {sorted(set(current) ^ set(state['model']))[:3]}")
        for name, value in current.items():
            self.backend.local(value).copy_(state["model"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        for param, st in self.optimizer.state.items():
            for key, value in st.items():
                if isinstance(param, DTensor) and not isinstance(value, DTensor) and value.dim() > 0:
                    st[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                 shape=param.shape, stride=param.stride())
