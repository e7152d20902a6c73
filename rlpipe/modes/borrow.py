"""separate_async's hybrid borrow, the driver's side: when the rollout pool starves the trainer, lend it to generation.

SPEC R2: "when the pool starves the trainer may temporarily serve as a rollout engine itself, then switch
back". The rule (:func:`borrow_groups`): while the driver waits for a step's batch, once it has waited
``after_s`` and the buffer holds fewer finished groups than the batch needs, trainer rank 0 generates
``min(max_groups, missing)`` groups with its current weights (:mod:`rlpipe.engine.state.borrowed_rollout`),
scores them as a replica's feeder would and stores them in the buffer; then the driver looks at the buffer
again, and borrows again only while it is still short. A buffer that holds a batch — even one the ``wait``
strategy's schedule holds back — is never a reason to borrow: more groups would not release it.

Prompts come from the same stream: the borrow first pulls the buffer's pending prompts (oldest first, the
call a replica makes), and draws new ones from the loader only for the rest, at the current step, as a
top-up does (under the mode's draw lock, with the top-ups' uid rules), up to what the buffer admits
(``room``: under ``wait`` the staleness schedule's room). Those are drawn beyond the capacity; the buffer's
exact refill accounting makes the next top-ups smaller by as many, so no prompt is skipped or drawn twice
and a checkpoint (taken between steps, when no borrow runs) resumes exactly.

Versions and staleness: a borrowed token carries the trainer's version when it was generated (its version
lag at that moment is 0); its group's staleness counts from its prompt's submission step like any group's,
so the buffer's threshold and the guard hold unchanged. Lineage: the borrow's ``generate`` and generation-side
records name the worker ``actor[0] (borrowed)``, and its trajectories' ``replica`` is
:data:`~rlpipe.engine.tracking.lineage.BORROWED_REPLICA` (-1). Metrics per step: ``rollout/borrowed_groups``
and ``rollout/borrow_s`` (the trainer's time generating, which ``async/trainer_idle_fraction`` does not count
as idle).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import pyarrow as pa
from pydantic import Field

from rlpipe.engine.state.trainer_backends import TRAINER_BACKENDS
from rlpipe.engine.tracking.lineage import BORROWED_REPLICA
from rlpipe.errors import ConfigError
from rlpipe.stage import StageParams

log = logging.getLogger(__name__)


class BorrowParams(StageParams):
    """``mode_params.borrow`` of separate_async: the trainer generates while the rollout pool cannot keep it fed."""

    enabled: bool = False
    """Lend the idle trainer (rank 0) to generation when the buffer runs dry. Off by default: the trainer then
    keeps a second copy of the policy (the embedded engine's), and where the trainer and the replicas share
    cores the borrowed generation takes them from the replicas; turn it on where the trainer has cores of its
    own. Needs trainer.backend replicated and resources.device cpu (the borrowed engine is the embedded one)."""
    after_s: float = Field(0.5, ge=0)
    """Borrow only after the driver has waited this long for a step's batch (short waits are the pool's normal
    jitter, not starvation)."""
    max_groups: int = Field(2, ge=1)
    """Prompt groups one borrow generates at most (one call of the trainer). After each the driver looks at
    the buffer again: fewer switch back to training sooner once the pool catches up, more batch the trainer's
    generation better."""


def borrow_groups(params: BorrowParams, waited_s: float, ready: int, needed: int) -> int:
    """How many groups to borrow now: none unless borrowing is on, the driver has waited ``after_s`` and the
    buffer's ``ready`` (finished) groups are fewer than the ``needed`` batch; then the missing ones, at most
    ``max_groups``."""
    if not params.enabled or waited_s < params.after_s or ready >= needed:
        return 0
    return min(params.max_groups, needed - ready)


def check_borrow(config, params: BorrowParams, sampler_cls: type) -> None:
    """Refuse a borrow that cannot run, saying what to change."""
    if not params.enabled:
        return
    where = "mode_params.borrow.enabled"
    if TRAINER_BACKENDS.get(config.trainer.backend).sharded:
        raise ConfigError(f"{where}: the borrowed engine loads trainer rank 0's whole model, which trainer.backend "
                          f"{config.trainer.backend} shards over the ranks; use trainer.backend: replicated or turn "
                          "the borrow off")
    if config.resources.device != "cpu":
        raise ConfigError(f"{where}: the borrowed engine is the embedded (CPU) one, so on device "
                          f"{config.resources.device} the trainer's accelerator would idle while its CPU generates "
                          "(a GPU engine in the trainer is not built); turn the borrow off")
    if not callable(getattr(sampler_cls, "room", None)):
        raise ConfigError(f"{where}: sampler {sampler_cls.__name__} has no room(submit_step) method (how many prompts "
                          "it admits beyond its capacity), which the borrow's draw needs; add one or turn the borrow off")


class TrainerBorrow:
    """Lends trainer rank 0 to generation while separate_async's driver waits for a batch."""

    def __init__(self, mode: Any, params: BorrowParams):
        self.mode = mode
        self.params = params
        self._groups = 0
        self._seconds = 0.0
        self._just_borrowed = False

    def wait_s(self, waited_s: float, default: float) -> float:
        """How long the driver's next wait for a batch may block: to the bound at most (the borrow is decided
        when it passes), not at all right after a borrow (look at the buffer, borrow again if still short)."""
        if not self.params.enabled:
            return default
        if self._just_borrowed:
            return 0.0
        return min(default, self.params.after_s - waited_s) if waited_s < self.params.after_s else default

    def maybe(self, step: int, waited_s: float, needed: int, head: list, pools: dict[str, list]) -> int:
        """Borrow if :func:`borrow_groups` says so; returns the groups generated. ``head``/``pools``: the
        generation-side stages and pool workers the replicas' feeders got."""
        self._just_borrowed = False
        if not self.params.enabled or waited_s < self.params.after_s:  # decided without a round trip
            return 0
        ready = int(self.mode.sampler("counts").get("finished", 0))
        count = borrow_groups(self.params, waited_s, ready, needed)
        if not count:
            return 0
        prompts = self._prompts(step, count)
        if not prompts.num_rows:
            return 0
        rt = self.mode.runtime
        report = rt.workers.call("actor", "borrowed_rollout", prompts, rt.workers.handle("sampler"), head,
                                 self.mode.gen_params, rt.config.seed, pools, rank=0)[0]
        self._record(step, report)
        log.debug("step %d: the trainer generated %d groups (version %d) in %.2f s, %d ready before", step,
                  len(report["uids"]), report["version"], report["seconds"], ready)
        self._just_borrowed = True
        return len(report["uids"])

    def _prompts(self, step: int, count: int) -> pa.Table:
        """Up to ``count`` prompts for the trainer: the buffer's pending ones first, then new ones drawn at ``step``."""
        sampler: Callable[..., Any] = self.mode.sampler
        prompts = sampler("next_pending", count)
        short = count - prompts.num_rows
        if short > 0 and (drawn := self.mode.draw(step, lambda: min(short, int(sampler("room", step))))) > 0:
            # a replica may pull some of them first: they are generated there, and the borrow takes fewer
            parts = [t for t in (prompts, sampler("next_pending", drawn)) if t.num_rows]
            prompts = pa.concat_tables(parts) if len(parts) > 1 else (parts[0] if parts else prompts)
        return prompts

    def _record(self, step: int, report: dict[str, Any]) -> None:
        """The borrow's lineage, as the replicas' drained records are written (as work of ``step``)."""
        executor = self.mode.runtime.executor
        hosts = getattr(executor.backend, "group_nodes", lambda role: [])("actor")
        worker = "actor[0]" + (f"@{hosts[0]}" if hosts else "") + " (borrowed)"
        nodes = {node.name: node for node in [self.mode.generate_node, *self.mode.head]}
        executor.note_replicas(report["uids"], BORROWED_REPLICA)
        for record in report["records"]:
            executor.record_external(step, nodes[record.pop("node")], worker=worker, **record)
        self._groups += len(report["uids"])
        self._seconds += float(report["seconds"])

    def take(self) -> tuple[int, float]:
        """Groups borrowed and seconds the trainer spent generating since the last call."""
        out, self._groups, self._seconds = (self._groups, self._seconds), 0, 0.0
        return out
