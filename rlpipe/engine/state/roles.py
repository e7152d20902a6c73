"""Worker roles: the long-lived state that stateful stages run against.

A role (``actor``, ``rollout``, ``ref``, ``critic`` ...) is registered in the
``worker_role`` registry with a builder and whether it is data-parallel
(*sharded*: each worker gets the rows whose ``dp_rank`` is its rank) or
replicated (rows split evenly across replicas). The Ray actor that hosts a
role is generic (:mod:`rlpipe.engine.execution.ray_worker`); this module is Ray-free so
the same states run inline in tests and benchmarks.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from rlpipe.agents.loop import build_agent
from rlpipe.engine.host import configure_process
from rlpipe.inference.engines import ROLLOUT_ENGINES, EngineInputs, build_engine
from rlpipe.inference.vllm_lora import mode_params_of
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weight_broadcast import BroadcastPlan, BroadcastReceiver
from rlpipe.backends.weight_delta import DeltaPush, DeltaReceiver, as_weight_push
from rlpipe.backends.weights import LocalTensors, WeightBucket, WeightPush, load_buckets, pack_buckets
from rlpipe.engine.state.train_state import TrainState
from rlpipe.engine.state.trainer_backends import TRAINER_BACKENDS
from rlpipe.errors import ConfigError, RlpipeError
from rlpipe.registry import registry
from rlpipe.schemas.config import PipelineConfig

WORKER_ROLES = registry("worker_role")

ALWAYS_ROLES = ("actor", "rollout")
"""Roles every run needs: the trainer (weights' source of truth) and the rollout engine."""


class WeightSyncError(RlpipeError):
    """A weight push failed; the message names the boundary (seed 6.x) where it failed."""


@contextmanager
def _boundary(name: str) -> Iterator[None]:
    try:
        yield
    except WeightSyncError:
        raise
    except Exception as exc:
        raise WeightSyncError(f"weight sync failed at boundary {name}: {exc}") from exc


@dataclass(frozen=True)
class RoleSpec:
    """How to build one worker of a role."""

    build: Callable[[PipelineConfig, int, int, str | None], Any]
    """(config, rank, world_size, dist_address) → state object."""
    sharded: bool
    """True: data-parallel ranks (rows routed by dp_rank); False: replicas (rows split evenly)."""
    size: Callable[[PipelineConfig], int]
    """Number of workers of this role for a config."""
    max_concurrency: int = 1
    """Calls one worker serves at once (threads of its Ray actor); > 1 only for thread-safe states
    whose methods may block (the async modes' sampler: ``sample_wait`` waits while replicas store)."""
    holds_model: bool = False
    """Holds a model on ``resources.device``: on Ray each worker asks for ``resources.gpus_per_worker`` GPUs."""


class RolloutState:
    """A rollout replica: its rollout engine (the one ``generate.impl`` names, behind the agent
    ``generate.params.agent`` names) and the policy tokenizer."""

    def __init__(self, config: PipelineConfig, rank: int, world_size: int, dist_address: str | None):
        configure_process(config)
        self.rank = rank
        self.tokenizer = build_tokenizer(config.tokenizer)
        model_config = config.model.model_copy(update={"dtype": config.model.rollout_dtype or config.model.dtype})
        model = build_model(model_config, self.tokenizer, config.seed)
        impl, params = _generate_stage(config)
        self._loads_local = impl == "embedded"
        """Its engine copies a :class:`LocalTensors` push straight in (server engines take buckets)."""
        workdir = os.path.join(tempfile.gettempdir(), f"rlpipe-{config.name}-rollout{rank}-{os.getpid()}")
        self._full_bytes = _full_push_bytes(model, config) if config.trainer.lora is not None else None
        """With trainer.lora: the bytes a whole-model push would carry (the weight_sync/full_model_bytes metric)."""
        inputs = EngineInputs(model, self.tokenizer, params, rank, workdir, name=f"rollout replica {rank}",
                              lora=config.trainer.lora,
                              mode_params=mode_params_of(config) if config.trainer.lora is not None else None)
        engine = build_engine(impl, inputs)
        # the agent (generate.params.agent) wraps the engine: generate, the rollout service and pushes drive it alike
        self.engine = engine if params is None else build_agent(engine, self.tokenizer, params)
        self._released_aborted = 0
        self._delta_receiver = DeltaReceiver()
        """The buckets this replica last loaded from a delta push (weight_sync impl delta)."""
        self._broadcast_receiver = BroadcastReceiver(rank, config.resources.device)
        """This replica's membership of the weight group (weight_sync impl broadcast)."""

    def load_weights(self, buckets, version: int) -> int:
        self.engine.load_weights(buckets, version)
        return version

    def push_weights(self, push: WeightPush | DeltaPush | Sequence[WeightBucket], version: int,
                     full_every: int = 1) -> dict[str, float]:
        """Weight-push boundaries 0 and 2-4 on this replica: quiesce (abort in-flight requests),
        transport (arrival of the buckets), engine load, cache invalidation, resume.

        With a rollout service the aborted partial trajectories resume on the new weights
        (partial rollout), also after ``release_for_training``; without one the engine is
        idle (sync) and simply loads. Returns ``aborted`` (requests aborted) and seconds per
        boundary (``quiesce_s``, ``transport_s``, ``load_s``, ``cache_reset_s``, ``resume_s``) with
        the export's ``export_s``, ``bytes`` and ``buckets``.
        A failure names its boundary.

        A :class:`~rlpipe.backends.weight_delta.DeltaPush` (weight_sync impl ``delta``, flushed whole every
        ``full_every`` versions) is rebuilt against this replica's last buckets and checksum-verified
        before anything is quiesced or written; ``bytes`` is then what was sent."""
        sent, delta_parts = None, 0.0
        if isinstance(push, LocalTensors) and not self._loads_local:  # a server engine takes buckets
            push = WeightPush(tuple(pack_buckets(push.tensors)), export_s=push.export_s, exported_at=time.time())
        if isinstance(push, DeltaPush):
            with _boundary(f"2 (transport: delta checksum, rollout replica {self.rank})"):
                if push.version != version:
                    raise ValueError(f"a delta push made for version {push.version} arrived as version {version}")
                rebuilt = self._delta_receiver.rebuild(push, full_every)
            sent, delta_parts = float(push.nbytes), float(push.delta_parts)
            push = as_weight_push(push, rebuilt)
        if isinstance(push, LocalTensors):  # nothing travelled: the engine copies the trainer's tensors in
            buckets = push
            stats = {"transport_s": 0.0, "export_s": push.export_s, "bytes": float(push.nbytes), "buckets": 0.0,
                     "delta_buckets": 0.0}
        else:
            buckets = push.buckets if isinstance(push, WeightPush) else tuple(push)
            # transport: from the export until the buckets are here (and, for a delta, rebuilt and verified)
            stats = {"transport_s": time.time() - push.exported_at if isinstance(push, WeightPush) else 0.0,
                     "export_s": push.export_s if isinstance(push, WeightPush) else 0.0,
                     "bytes": sent if sent is not None else float(sum(b.nbytes for b in buckets)),
                     "buckets": float(len(buckets)), "delta_buckets": delta_parts}
        self.engine.wake()
        service = getattr(self, "_service", None)
        t0 = time.perf_counter()
        with _boundary(f"0 (quiesce rollout replica {self.rank})"):
            aborted = len(self.engine.abort_all()) if service is None else service.pause() + self._released_aborted
        self._released_aborted = 0
        t1 = time.perf_counter()
        with _boundary(f"3 (engine load, rollout replica {self.rank})"):
            loaded = self.engine.load_weights(buckets, version) if service is None else \
                service.load_weights(buckets, version)
        t2 = time.perf_counter()
        with _boundary(f"4 (resume, rollout replica {self.rank})"):
            if service is not None:
                service.resume()
        t3 = time.perf_counter()
        if sent is not None:  # loaded: the base of the next delta
            self._delta_receiver.commit(tuple(buckets))
        cache_reset_s = float((loaded or {}).get("cache_reset_s", 0.0))
        if self._full_bytes is not None:
            stats["full_model_bytes"] = self._full_bytes
        return {**stats, "aborted": float(aborted), "quiesce_s": t1 - t0, "load_s": t2 - t1 - cache_reset_s,
                "cache_reset_s": cache_reset_s, "resume_s": t3 - t2}

    def colocated_with(self, states: dict[str, Any]) -> None:
        """The states of the roles sharing this worker's process (resources.colocate): the trainer's, when there."""
        self._local_trainer = states.get("actor")

    def push_from_local_trainer(self, export: str, *export_args: Any, **replica_kwargs: Any) -> dict[str, float]:
        """A weight push from the trainer sharing this process (resources.colocate, one trainer rank): its
        ``export`` (a TrainState method), the version bump and :meth:`push_weights` in one call, the buckets
        never leaving this process's memory. Returns push_weights' stats and ``version``."""
        trainer = getattr(self, "_local_trainer", None)
        if trainer is None:
            raise WeightSyncError("weight sync failed at boundary 1 (export): no trainer shares this rollout "
                                  "replica's process (resources.colocate)")
        with _boundary("1 (export)"):
            push = getattr(trainer, export)(*export_args)
        with _boundary("1 (version bump)"):
            version = trainer.bump_version()
        return {**self.push_weights(push, version, **replica_kwargs), "version": float(version)}

    def receive_broadcast(self, plan: BroadcastPlan, version: int) -> dict[str, float]:
        """Weight push over the weight group (weight_sync impl broadcast): receive every bucket trainer rank 0
        broadcasts (checksums verified), then quiesce, load and resume as :meth:`push_weights`."""
        with _boundary(f"2 (transport: broadcast, rollout replica {self.rank})"):
            if plan.version != version:
                raise ValueError(f"a broadcast planned for version {plan.version} arrived as version {version}")
            push = self._broadcast_receiver.receive(plan)
        return self.push_weights(push, version)

    def release_for_training(self) -> int:
        """Shared devices (colocate_async): abort in-flight requests (kept, resumed at the next
        push) and free the engine's weights while the trainer updates; returns the aborted count."""
        aborted = self.service().pause()
        self.engine.sleep(discard_weights=True)
        self._released_aborted += aborted  # reported by the next push, which resumes them
        return aborted

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def abort_all(self):
        return self.engine.abort_all()

    def get_version(self) -> int:
        return self.engine.version

    # -- the continuous rollout service of the async modes (started on first use) -------------------

    def service(self):
        """This replica's :class:`~rlpipe.engine.state.rollout_service.RolloutService` (its thread starts on first use)."""
        if getattr(self, "_service", None) is None:
            from rlpipe.engine.state.rollout_service import RolloutService

            self._service = RolloutService(self.engine, self.tokenizer, name=f"rollout-service-{self.rank}")
        return self._service

    def service_submit(self, prompts, params, seed: int, lane: str = "train") -> int:
        return self.service().submit(prompts, params, seed, lane)

    def service_collect(self, min_groups: int = 0, timeout: float | None = None, max_groups: int | None = None,
                        lane: str = "train"):
        return self.service().collect(min_groups, timeout, max_groups, lane)

    def service_pause(self) -> int:
        return self.service().pause()

    def service_load_weights(self, buckets, version: int) -> int:
        self.service().load_weights(buckets, version)
        return version

    def service_resume(self) -> int:
        return self.service().resume()

    def service_push_weights(self, buckets, version: int) -> int:
        return self.service().push_weights(buckets, version)

    def service_drop(self, uids) -> int:
        return self.service().drop(uids)

    def service_stats(self) -> dict[str, float]:
        return self.service().stats()

    def service_clear(self) -> int:
        self.feed_stop()
        return self.service().clear()

    # -- separate_async: the replica pulls its prompts and stores its scored groups itself --------

    def feed_start(self, sampler, head, gen_params: dict, max_groups: int, store_groups: int, poll_s: float,
                   run_seed: int, pools: dict[str, list] | None = None) -> None:
        """Start this replica's :class:`~rlpipe.engine.state.rollout_feeder.RolloutFeeder` on ``sampler``
        (the sampler role's actor handle, or the object inline); restarts a running one. ``pools``: pool
        role → its workers (actor handles, or the states inline) for head stages that run on a pool."""
        from rlpipe.engine.state.pool_client import PoolClient
        from rlpipe.engine.state.rollout_feeder import RolloutFeeder, SamplerClient
        from rlpipe.stage import StageContext
        from rlpipe.stages.generate import generation_seed

        self.feed_stop()
        rank = self.rank
        self._feeder = RolloutFeeder(
            self.service(), SamplerClient(sampler), head, gen_params,
            lambda step: generation_seed(StageContext(step=step, seed=run_seed, dp_rank=rank)),
            max_groups, store_groups, poll_s, run_seed, name=f"rollout-feeder-{rank}",
            pools={role: PoolClient(workers) for role, workers in (pools or {}).items()})

    def feed_drain(self) -> dict:
        """The feeder's lineage records since the last drain, its counters and the service's stats."""
        return {**self._feeder.drain(), "stats": self.service().stats()}

    def feed_stop(self) -> None:
        if getattr(self, "_feeder", None) is not None:
            self._feeder.stop()
            self._feeder = None

    def service_shutdown(self) -> None:
        self.feed_stop()
        if getattr(self, "_service", None) is not None:
            self._service.shutdown()
            self._service = None

    def close(self) -> None:
        """Stop the feeder and service threads and close the engine (a server it owns is stopped); idempotent."""
        self.service_shutdown()
        self.engine.close()


def _full_push_bytes(model: torch.nn.Module, config: PipelineConfig) -> float:
    """Bytes of a whole-model push of ``model`` from the trainer (parameters in ``model.dtype``, tied ones once)."""
    from rlpipe.backends.model import torch_dtype

    return float(sum(p.numel() for p in model.parameters()) * torch_dtype(config.model.dtype).itemsize)


def _generate_stage(config: PipelineConfig) -> tuple[str, Any]:
    """The engine a replica runs (the generate stage's impl when it names one) and that stage's params."""
    from rlpipe.stage import stage_registry

    node = next((s for s in config.stages if s.kind == "generate"), None)
    if node is None or node.impl not in ROLLOUT_ENGINES:
        return "embedded", None
    return node.impl, stage_registry("generate").get(node.impl).params_model.model_validate(node.params)


class ReferenceState:
    """The frozen reference policy (forward only)."""

    def __init__(self, config: PipelineConfig, rank: int, world_size: int, dist_address: str | None):
        configure_process(config)
        self.rank = rank
        self.tokenizer = build_tokenizer(config.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self.model = build_model(config.model, self.tokenizer, config.seed)
        self.model.eval()
        self.config = config

    def load_weights(self, buckets, version: int = 0) -> int:
        load_buckets(self.model, buckets)
        return version


WORKER_ROLES.add(
    "actor",
    # the trainer backend builds the rank's state (TrainState; MegatronTrainState for megatron)
    RoleSpec(lambda c, r, w, a: TRAINER_BACKENDS.get(c.trainer.backend).build_state(c, r, w, a), sharded=True,
             size=lambda c: c.trainer.dp_size, holds_model=True),
)
WORKER_ROLES.add(
    "rollout",
    RoleSpec(RolloutState, sharded=False, size=lambda c: c.resources.rollout_replicas, holds_model=True),
)
WORKER_ROLES.add("ref", RoleSpec(ReferenceState, sharded=False, size=lambda c: 1, holds_model=True))


def _build_critic(config: PipelineConfig, rank: int, world_size: int, dist_address: str | None) -> TrainState:
    """A trainer whose model is the policy backbone with a value head (initialized from the policy)."""
    from rlpipe.stages.critic import CriticModel

    # trainer.lora is the actor's: the critic trains its whole model
    return TrainState(config, rank, world_size, dist_address, adapters=False,
                      model_factory=lambda tok: CriticModel(build_model(config.model, tok, config.seed)))


WORKER_ROLES.add("critic", RoleSpec(_build_critic, sharded=True, size=lambda c: c.trainer.dp_size,
                                    holds_model=True))


def colocated_groups(config: PipelineConfig, roles: set[str]) -> list[tuple[str, ...]]:
    """The groups of ``resources.colocate`` restricted to ``roles`` (the run's), each led by its data-parallel role
    (whose rendezvous the shared workers join); groups left with one role are dropped."""
    groups = []
    for group in config.resources.colocate:
        present = [role for role in group if role in roles]
        present.sort(key=lambda role: not WORKER_ROLES.get(role).sharded)  # stable: the DP role first
        if len(present) > 1:
            groups.append(tuple(present))
    return groups


def worker_processes(config: PipelineConfig, roles: set[str]) -> dict[str, tuple[str, ...]]:
    """One entry per worker group of a run with ``roles``, in role order: the role whose workers they are →
    every role those workers host (itself alone unless ``resources.colocate`` puts guests with it)."""
    colocated = {group[0]: group for group in colocated_groups(config, roles)}
    guests = {role for group in colocated.values() for role in group[1:]}
    return {role: colocated.get(role, (role,)) for role in sorted(roles - guests)}


def check_colocation(config: PipelineConfig, weight_sync_impl: str | None = None) -> None:
    """Refuse a ``resources.colocate`` that cannot run, naming the group and the fix."""
    seen: set[str] = set()
    for i, group in enumerate(config.resources.colocate):
        where = f"resources.colocate[{i}] = {list(group)}"
        if len(group) < 2:
            raise ConfigError(f"{where}: a group shares one process between two or more roles; list at least two "
                              "(e.g. [actor, rollout]) or remove it")
        for role in group:
            spec = WORKER_ROLES.get(role)  # an unknown role raises, listing the known ones
            if role in seen:
                raise ConfigError(f"{where}: role {role!r} is in more than one group; a role runs in one place")
            if not spec.holds_model:
                raise ConfigError(f"{where}: role {role!r} holds no model; only model-holding roles colocate "
                                  "(actor, rollout, ref, critic)")
            seen.add(role)
        sharded = [role for role in group if WORKER_ROLES.get(role).sharded]
        if len(sharded) > 1:
            raise ConfigError(f"{where}: {' and '.join(sharded)} are both data-parallel groups (one rendezvous each); "
                              "colocate at most one of them")
        sizes = {role: WORKER_ROLES.get(role).size(config) for role in group}
        if len(set(sizes.values())) > 1:
            raise ConfigError(f"{where}: the roles need as many workers each, got "
                              f"{', '.join(f'{r}: {n}' for r, n in sizes.items())} (actor and critic: trainer.dp_size, "
                              "rollout: resources.rollout_replicas, ref: 1); make them equal or colocate fewer roles")
        places = {config.resources.placement[r] for r in group if r in config.resources.placement}
        if len(places) > 1:
            raise ConfigError(f"{where}: resources.placement puts these roles on different nodes ({sorted(places)}); "
                              "one process runs on one node")
        if weight_sync_impl == "broadcast" and {"actor", "rollout"} <= set(group):
            raise ConfigError(f"{where}: weight_sync broadcast sends from the trainer's process to the engine's, which "
                              "are one process here (it would wait for itself); use weight_sync object_store")
    if config.resources.colocate and config.mode != "sync":
        raise ConfigError(f"resources.colocate: colocated roles take turns in one process, which only mode sync does "
                          f"(mode {config.mode} generates while it trains); remove resources.colocate or use mode sync")
