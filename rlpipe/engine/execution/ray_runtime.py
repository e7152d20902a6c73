"""The Ray backend of the step executor: starting Ray, the run's worker groups, and the calls the executor
makes on them (stage tasks, worker chains, stages on every worker of a role).

The pieces live by concern: the worker actor and stage tasks in rlpipe.engine.execution.ray_worker, a role's
workers in rlpipe.engine.execution.worker_group, the driver's bounded calls to workers in
rlpipe.engine.execution.worker_calls.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import numpy as np
import pyarrow as pa
import ray

from rlpipe.deadline import StageTimeout
from rlpipe.engine import interrupt
from rlpipe.engine.execution import ray_watchdog, worker_pool
from rlpipe.engine.execution.ray_errors import actor_error_line
from rlpipe.engine.execution.ray_worker import Peers, run_task_chain, run_task_stage
from rlpipe.engine.execution.wire import register_arrow_ipc
from rlpipe.engine.execution.worker_calls import RayWorkerCalls, WorkerDied, actor_died
from rlpipe.engine.execution.worker_group import WorkerGroup
from rlpipe.engine.execution.worker_start import Demand, check_demand
from rlpipe.engine.files.ship import ShippedDirs
from rlpipe.engine.stage_call import ChainedStage, ChainStep, shard_rows
from rlpipe.engine.state.roles import WORKER_ROLES, worker_processes
from rlpipe.jagged import contiguous
from rlpipe.stage import StageContext, StageResult

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0
"""How long shutdown waits for workers to close their states (engine servers, threads) before killing them."""


def init_ray(address: str | None, num_cpus: int | None) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``), else start a local Ray; idempotent."""
    if ray.is_initialized():
        register_arrow_ipc()
        return
    address = address or os.environ.get("RAY_ADDRESS")
    ours = interrupt.installed()
    runtime_env = {"env_vars": {"MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false"}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # "local": start a Ray of our own; with no address, ray.init joins whatever Ray instance
        # another process last started on this machine (/tmp/ray/ray_current_cluster)
        # No prestarted workers: by default Ray starts one idle worker per CPU when the driver connects. rlpipe's
        # actors never take them (each gets a fresh process), so they only compete with the actors' start-up for
        # the cores and hold memory; a stage task's worker spends far longer importing the stages than starting
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
                 log_to_driver=True,
                 _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
        ray_watchdog.start(os.getpid())  # a driver killed without ray.shutdown leaves nothing running
    interrupt.keep_over_ray(ours)  # ray.init replaces the SIGTERM handler of `rlpipe run` with sys.exit
    register_arrow_ipc()


@dataclasses.dataclass
class ChainCall:
    """A worker chain submitted and not yet waited for (:meth:`RayBackend.start_worker_chain`)."""

    role: str
    stages: list[ChainedStage]
    step: int
    ref: ray.ObjectRef
    """Its steps (list[ChainStep])."""
    table_ref: ray.ObjectRef | None
    """Its last table, for the next chain (None: not handed on)."""


class RayBackend:
    """How the executor runs stages on Ray: tasks, worker actors, and the driver-stage facade."""

    def __init__(self, groups: dict[str, WorkerGroup], shared_filesystem: bool = True,
                 task_stages_in_workers: bool = True, call_timeout_s: float | None = None):
        self.groups = groups
        self.shared_filesystem = shared_filesystem
        self.task_stages_in_workers = task_stages_in_workers
        """Task stages next to a single worker's stages run in that worker's call (resources.task_stages_in_workers)."""
        self.workers = RayWorkerCalls(groups, call_timeout_s)

    chains_tasks = True
    """Consecutive task stages run as one Ray task."""

    def overlap(self, work: Callable[[], None]) -> bool:
        """Call ``work()`` each time the driver waits on a remote call (stage calls and the workers facade's
        ``resolve``): the executor's lineage records of the nodes before are written while this one runs."""
        self.workers.while_waiting = work
        return True

    @classmethod
    def start(cls, config, roles: set[str], shipped: ShippedDirs | None = None) -> "RayBackend":
        """Start one worker group per role (all concurrently: DP ranks rendezvous while starting); ``shipped``:
        the model folders packed into the object store (resources.shared_filesystem false), or None."""
        config_dict = config.model_dump(mode="json")
        processes = worker_processes(config, roles)
        groups, starts = {}, {}
        for role, hosted in processes.items():
            specs = [WORKER_ROLES.get(r) for r in hosted]
            gpus = config.resources.gpus_per_worker if any(s.holds_model for s in specs) else 0
            placed = next(((r, config.resources.placement[r]) for r in hosted if r in config.resources.placement), None)
            starts[role] = (specs, Demand(hosted, specs[0].size(config), gpus, placed))
        # refused before any worker exists: Ray would keep such workers pending forever
        check_demand([d for _, d in starts.values()], ray.cluster_resources(), config.resources.gpus_per_worker)
        for role, (specs, demand) in starts.items():
            groups[role] = WorkerGroup(role, demand.size, specs[0].sharded, config_dict,
                                       max(s.max_concurrency for s in specs),
                                       demand.placement[1] if demand.placement else None, demand.gpus, shipped,
                                       demand.roles, config.resources.worker_start_timeout_s)
        for host, hosted in processes.items():
            for role in hosted[1:]:  # colocated guests
                groups[role] = groups[host].view(role, WORKER_ROLES.get(role).sharded)
        backend = cls(groups, shared_filesystem=shipped is None,
                      task_stages_in_workers=config.resources.task_stages_in_workers,
                      call_timeout_s=config.resources.worker_call_timeout_s)
        try:
            hosts = [group for role, group in groups.items() if group.host == role]
            for group in hosts:
                group.ready()
            # a driver stage fused into a worker's chain (StageSpec.calls) calls the other roles from there: each
            # worker knows them all once, instead of actor handles travelling with every chain call
            peers = Peers({r: (g.host, g.actors, [g.name(rank) for rank in range(g.size)]) for r, g in groups.items()},
                          config.resources.worker_call_timeout_s)
            ray.get([a.meet_peers.remote(peers) for group in hosts for a in group.actors])
        except Exception:
            backend.shutdown()
            raise
        return backend

    def shutdown(self, finished: bool = False) -> None:
        """Close every worker's state (a rollout replica stops the engine server it owns), then kill the actors;
        ``finished`` (the run ended by finishing): where rlpipe.engine.execution.worker_pool keeps idle workers,
        those that may be kept are released for the next run instead."""
        hosts = [g for role, g in self.groups.items() if g.host == role]  # colocated roles: their host's workers
        keep = finished and worker_pool.enabled()
        kept: set = set()
        closing = {(a.release if keep and g.shape is not None else a.close).remote(): (g, r)
                   for g in hosts for r, a in enumerate(g.actors) if r not in g.killed}
        _, stuck = ray.wait(list(closing), num_returns=len(closing), timeout=CLOSE_TIMEOUT_S) if closing else ([], [])
        for ref, (group, rank) in closing.items():
            name = group.name(rank)
            if ref in stuck:
                log.warning("worker %s did not close within %.0f s; killing it (an engine server it owns dies "
                            "with it)", name, CLOSE_TIMEOUT_S)
                continue
            try:
                # release answers whether the worker may host another run; close answers None
                if ray.get(ref) is True and worker_pool.give_back((group.shape, rank), group.actors[rank]):
                    kept.add((id(group), rank))
            except ray.exceptions.RayActorError:
                log.info("worker %s was already gone at shutdown", name)
            except Exception as exc:  # noqa: BLE001 - a failing close must not keep the others alive
                log.warning("closing worker %s: %s", name, actor_error_line(exc))
        for group in hosts:
            for rank, actor in enumerate(group.actors):
                if (id(group), rank) not in kept:
                    ray.kill(actor)
            if group.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(group.placement_group)

    def group_size(self, role: str) -> int:
        return self.groups[role].size if role in self.groups else 1

    def host(self, role: str) -> str:
        """The role whose workers run ``role``'s stages: itself, or the role it is colocated with."""
        return self.groups[role].host if role in self.groups else role

    def hosted_roles(self, role: str) -> tuple[str, ...]:
        """Every role the workers of ``role`` host (just ``role`` unless colocated)."""
        return self.groups[role].hosted if role in self.groups else (role,)

    def model_dirs(self, role: str) -> list[dict[str, str]]:
        """Per worker of ``role``: driver path → the node-local copy it loaded (empty: it read the driver's paths)."""
        return ray.get([a.model_dirs.remote() for a in self.groups[role].actors])

    def group_nodes(self, role: str) -> list[str]:
        """Ray node ids of the role's workers (one per rank; lineage records them)."""
        return self.groups[role].nodes if role in self.groups else []

    def run_task(self, kind: str, impl: str, params: dict, table: pa.Table, ctx: StageContext,
                 timeout_s: float | None = None) -> StageResult:
        ref = run_task_stage.remote(kind, impl, params, ray.put(contiguous(table)), ctx)
        self.workers.while_waiting()
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)  # kills the task's worker process
            raise StageTimeout(timeout_s, f"a Ray task (task id {ref.task_id().hex()}, cancelled)") from None

    def run_task_chain(self, stages: list[ChainedStage], table: pa.Table, ctxs: list[StageContext],
                       timeout_s: float | None = None) -> list[ChainStep]:
        """``stages`` as one task (see :func:`run_task_chain`); :class:`StageTimeout` after ``timeout_s``."""
        ref = run_task_chain.remote(stages, ray.put(contiguous(table)), ctxs)
        self.workers.while_waiting()
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            names = ", ".join(f"{s.kind}/{s.impl}" for s in stages)
            raise StageTimeout(timeout_s, f"a Ray task running {names} (task id {ref.task_id().hex()}, cancelled)") from None

    def run_worker_chain(self, role: str, stages: list[ChainedStage], table: pa.Table, ctxs: list[StageContext],
                         timeout_s: float | None = None) -> list[ChainStep]:
        """``stages`` as one call of the role's only worker (:meth:`start_worker_chain`), waited for."""
        return self.finish_worker_chain(self.start_worker_chain(role, stages, table, ctxs), timeout_s)

    def start_worker_chain(self, role: str, stages: list[ChainedStage], table: "pa.Table | ChainCall",
                           ctxs: list[StageContext], hand_on: bool = False) -> "ChainCall":
        """Submit ``stages`` (the stages of ``role`` and task and driver stages next to them) as one call of the
        role's only worker: one round trip and no Ray task for the task stages. ``table``: the input, or a
        started chain that hands its last table on (``hand_on``): Ray moves it from that worker to this one
        when it is made, without a stop at the driver (which rebuilds it from the chain's results)."""
        group = self.groups[role]
        if group.size != 1:
            raise ValueError(f"a chain runs on a role with one worker; {role} has {group.size}")
        batch = table.table_ref if isinstance(table, ChainCall) else contiguous(table)
        actor = group.actors[0]
        if hand_on:
            ref, table_ref = actor.run_chain_handing_on.remote(stages, batch, ctxs)
        else:
            ref, table_ref = actor.run_chain.remote(stages, batch, ctxs), None
        return ChainCall(role, stages, ctxs[0].step, ref, table_ref)

    def finish_worker_chain(self, call: "ChainCall", timeout_s: float | None = None) -> list[ChainStep]:
        """The steps of a started chain. Each stage's ``timeout_s`` is enforced inside the call; when one of the
        worker's own stages ran past it, the worker is killed (as :meth:`run_on_workers` does: the abandoned
        thread still holds its state). ``timeout_s`` bounds the wait for the whole call from now."""
        group, stages = self.groups[call.role], call.stages
        names = ", ".join(f"{s.kind}/{s.impl}" for s in stages)
        self.workers.while_waiting()
        ready, _ = ray.wait([call.ref], timeout=timeout_s)
        if not ready:
            group.kill(0)
            raise StageTimeout(timeout_s, f"worker {group.name(0)} running {names} (killed)")
        try:
            steps = ray.get(call.ref)
        except ray.exceptions.RayActorError as exc:
            raise WorkerDied(f"worker {group.name(0)} died while running stages {names} at step {call.step}: "
                             f"{actor_error_line(exc)}") from None
        last = steps[-1] if steps else None
        if last is not None and isinstance(last.error, StageTimeout) and stages[len(steps) - 1].role is not None:
            group.kill(0)
            last.error = StageTimeout(last.error.timeout_s, f"worker {group.name(0)} (killed)")
        return steps

    def run_on_workers(self, role: str, kind: str, impl: str, params: dict, tables: list[pa.Table],
                       ctxs: list[StageContext], timeout_s: float | None = None) -> list[StageResult]:
        group = self.groups[role]
        refs = [a.run_stage.remote(kind, impl, params, contiguous(t), c) for a, t, c in zip(group.actors, tables, ctxs)]
        self.workers.while_waiting()
        _, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if late:
            ranks = [refs.index(ref) for ref in late]
            for rank in ranks:
                group.kill(rank)
            raise StageTimeout(timeout_s, "worker " + ", ".join(group.name(r) for r in ranks) + " (killed)")
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as exc:
            rank = next((i for i, ref in enumerate(refs) if actor_died(ref)), None)
            who = group.name(rank) if rank is not None else f"a {role} worker"
            raise WorkerDied(f"worker {who} died while running stage {kind}/{impl} at step {ctxs[0].step}: "
                             f"{actor_error_line(exc)}") from None

    def shards(self, role: str, table: pa.Table, dp_rank_column: str) -> list[np.ndarray]:
        group = self.groups[role]
        return shard_rows(table, group.size, group.sharded, dp_rank_column)
