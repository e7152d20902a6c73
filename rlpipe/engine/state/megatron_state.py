"""The trainer rank of ``trainer.backend: megatron`` (roles ``actor``): TrainState's contract on
megatron-core (rlpipe.backends.megatron_trainer).

Same stage functions, same global denominators: the update and old_log_prob stages hand their
passes to :meth:`MegatronTrainState.train_passes` / :meth:`forward_passes` (megatron's
schedule); :meth:`optimizer_step` applies the same numeric guards as the torch trainer (the
norm is measured before stepping, so a non-finite one never reaches the weights), counts the
LR schedule in local updates, and steps megatron's distributed optimizer. Weight pushes and
``save_hf`` export HF names. Left out: checkpoints (megatron's distributed checkpointing is not
wired; the backend's plan check refuses ``trainer.checkpoint_every``), a critic on megatron.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.engine.host import configure_process
from rlpipe.engine.state.train_state import NumericalError, TrainState, lr_lambda, updates_per_step
from rlpipe.engine.state.trainer_backend_registry import TRAINER_BACKENDS
from rlpipe.errors import ConfigError
from rlpipe.schemas.config import PipelineConfig

log = logging.getLogger(__name__)


class MegatronTrainState(TrainState):
    """One DP rank holding a megatron-core GPTModel (TP = PP = 1) and its distributed optimizer."""

    def __init__(self, config: PipelineConfig, rank: int, world_size: int, dist_address: str | None):
        # not TrainState.__init__: no torch AdamW / LambdaLR; megatron owns the optimizer
        from rlpipe.backends.megatron_trainer import MegatronEngine, MegatronPolicy

        configure_process(config)
        torch.manual_seed(config.seed)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = torch.device(config.resources.device)
        self._dist_host = dist_address.rsplit(":", 1)[0] if dist_address else None
        self.backend = TRAINER_BACKENDS.get(config.trainer.backend)
        self.tokenizer = build_tokenizer(config.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        if world_size > 1 and not dist.is_initialized():
            # NCCL for the CUDA grad buffers, gloo for rlpipe's CPU metric/denominator all-reduces
            dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://{dist_address}", rank=rank,
                                    world_size=world_size, timeout=timedelta(minutes=10))
        hf_model = build_model(config.model, self.tokenizer, config.seed)
        self.engine = MegatronEngine(hf_model, config.trainer.optimizer, config.trainer.grad_clip, config.seed,
                                     self.device)
        del hf_model
        self.model = MegatronPolicy(self.engine)
        self.total_updates = config.trainer.total_steps * updates_per_step(config)
        self._lr_factor = lr_lambda(config.trainer.lr_schedule, self.total_updates)
        self.local_updates = 0
        self.version = 0
        self.skipped_updates = 0
        self.zero_grad_streak = 0

    # --- passes: megatron's schedule -----------------------------------------------------------
    def forward_passes(self, seqs, consume):
        return self.engine.forward_passes(seqs, consume)

    def train_passes(self, jobs):
        return self.engine.train_passes(jobs)

    def lockstep_passes(self, count: int) -> int:
        # parameters are whole on every rank (the distributed optimizer shards only its states): no per-pass
        # collectives, so ranks may run different numbers of micro-batches
        return count

    # --- optimization -----------------------------------------------------------------------
    def current_lr(self) -> float:
        return self.config.trainer.optimizer.lr * self._lr_factor(self.local_updates)

    def optimizer_step(self, loss_finite: bool = True, expect_grad: bool = False) -> dict[str, float]:
        """Guards of :meth:`TrainState.optimizer_step` around megatron's optimizer (grads were DP-reduced when the
        schedule finished)."""
        if self.world_size > 1:
            flag = self.all_reduce_sum(torch.tensor([0.0 if loss_finite else 1.0], dtype=torch.float64))
            loss_finite = bool(flag.item() == 0)
        lr = self.current_lr()
        grad_norm = self.engine.reduce_and_clip()
        stepped = self._finite_or_skip(loss_finite, float(grad_norm))
        if stepped:
            self.engine.apply(lr)
            self._check_parameters()
        self.engine.zero_grad()
        self.local_updates += 1
        self._watch_zero_grad(stepped and expect_grad and grad_norm == 0.0)
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0 if stepped else 1.0}

    def _check_parameters(self) -> None:
        bad = [n for n, p in self.engine.gpt.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:  # every rank holds the whole, identical parameters: every rank raises
            raise NumericalError(
                f"local update {self.local_updates}: parameter {bad[0]!r} became non-finite after the optimizer "
                f"step (lr {self.current_lr():g}); the weights were not pushed. Lower trainer.optimizer.lr or set "
                "trainer.grad_clip")

    # --- weights and checkpoints --------------------------------------------------------------
    def export_weights(self):
        """HF-named weight buckets on rank 0 (every rank holds the full parameters; the others return None)."""
        from rlpipe.backends.weights import pack_buckets

        if self.rank != 0:
            return None
        return pack_buckets(self.model.named_hf_parameters())

    def save_hf(self, path: str) -> str:
        import os

        if self.rank == 0:
            from rlpipe.backends.model import save_hf_model

            os.makedirs(path, exist_ok=True)
            save_hf_model(self._unsharded_copy(self.model.named_hf_parameters()), self.tokenizer, path)
        return path

    def state_dict(self) -> dict:
        raise ConfigError("checkpoints of trainer.backend megatron are not implemented; set trainer.checkpoint_every: 0")

    def load_state_dict(self, state: dict) -> None:
        self.state_dict()

    def checkpoint_bytes(self) -> int:
        return 3 * sum(p.numel() * p.element_size() for p in self.engine.gpt.parameters())

    def idle_pass(self, backward: bool) -> None:
        raise ConfigError("megatron ranks run their own micro-batch counts; no idle passes are needed")

