"""Ray plumbing: the generic worker actor, worker groups, stage tasks.

Every role runs in the same actor class, :class:`WorkerActor`, which builds the
role's state from the ``worker_role`` registry and runs worker stages against
it. Stateless stages run as Ray tasks. Arrow tables travel as Ray objects
(zero-copy out of the object store); torch tensors never cross process lines.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import socket
import threading
import uuid
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import ray

from rlpipe.engine import interrupt
from rlpipe.engine.execution import ray_watchdog
from rlpipe.deadline import StageTimeout
from rlpipe.engine.execution.deferred import DeferredCalls
from rlpipe.engine.execution.ray_errors import actor_error_line, startup_error_line
from rlpipe.engine.execution.wire import register_arrow_ipc
from rlpipe.engine.execution.worker_start import Demand, check_demand, wait_started
from rlpipe.engine.files.ship import ShippedDirs, localize
from rlpipe.jagged import contiguous
from rlpipe.plugin_files import import_plugin_files
from rlpipe.engine.stage_call import ChainedStage, ChainStep, run_chain, run_stage, shard_rows
from rlpipe.engine.state.roles import WORKER_ROLES, worker_processes
from rlpipe.errors import RlpipeError
from rlpipe.registry import load_plugins
from rlpipe.schemas.config import PipelineConfig
from rlpipe.stage import StageContext, StageResult, stage_registry

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


@ray.remote(num_cpus=1, max_retries=0)
def run_task_stage(kind: str, impl: str, params: dict, batch: pa.Table, ctx: StageContext) -> StageResult:
    """A stateless stage as a Ray task."""
    register_arrow_ipc()
    return run_stage(kind, impl, params, batch, ctx)


@ray.remote(num_cpus=1, max_retries=0)
def run_task_chain(stages: list[ChainedStage], batch: pa.Table, ctxs: list[StageContext]) -> list[ChainStep]:
    """Consecutive stateless stages as one Ray task (one round trip and one ``ray.put`` for all).

    Each stage's result is applied here to feed the next; the driver gets every stage's own result
    (and applies them again: one lineage record per node). The first failure ends the chain."""
    register_arrow_ipc()
    task = ray.get_runtime_context().get_task_id()
    return run_chain(stages, batch, ctxs, f"a Ray task (task id {task}; the stage's thread in it is abandoned)")[0]


@ray.remote(num_cpus=0, max_restarts=0)
class WorkerActor:
    """Hosts one worker of one role (or of several colocated roles, resources.colocate: one state per role, the
    first role's is the default); runs worker stages and role methods."""

    def __init__(self, roles: str | tuple[str, ...], rank: int, world_size: int, config: dict,
                 dist_address: str | None, shipped: ShippedDirs | None = None):
        roles = (roles,) if isinstance(roles, str) else tuple(roles)
        self.role = "+".join(roles)
        self.rank = rank
        self.local_dirs: dict[str, str] = {}
        """Model folders this worker reads from its node's cache instead of the driver's path (driver → local)."""
        self.peers: Peers | None = None
        """Every role's workers (:meth:`meet_peers`), for driver stages run in this worker's chain calls."""
        self.states: dict[str, Any] = {}
        """Per hosted role, its state (only the data-parallel role, listed first, joins the rendezvous); after a
        failed start, those built (close() releases them: an engine server one of them started)."""
        self.start_error: Exception | None = None
        """What the start-up raised; :meth:`ready` raises it. An ``__init__`` that raised would make Ray print the
        whole traceback on the driver's terminal above the run's own one-line error."""
        try:
            self._start(roles, rank, world_size, config, dist_address, shipped)
        except Exception as exc:  # noqa: BLE001 - every start-up failure is reported the same way, by ready()
            self.start_error = exc

    def _start(self, roles: tuple[str, ...], rank: int, world_size: int, config: dict, dist_address: str | None,
               shipped: ShippedDirs | None) -> None:
        load_plugins()
        register_arrow_ipc()
        logging.basicConfig(level=logging.INFO)
        if shipped is not None:  # resources.shared_filesystem false: the model folders came through the object store
            config, self.local_dirs = localize(config, shipped)
        parsed = PipelineConfig.model_validate(config)
        import_plugin_files(parsed.plugins)  # its stages (the rollout feeder's) and the parts they name
        for role in roles:
            self.states[role] = WORKER_ROLES.get(role).build(parsed, rank, world_size, dist_address)
        self.state = self.states[roles[0]]
        if len(self.states) > 1:  # colocated states may work with each other in memory
            for state in self.states.values():
                if callable(meet := getattr(state, "colocated_with", None)):
                    meet(self.states)

    def ready(self) -> str:
        """Where this worker runs (pid and host), for messages that name it; what its start-up raised, if it did."""
        if self.start_error is not None:
            raise self.start_error
        return f"pid {os.getpid()} on {socket.gethostname()}"

    def node(self) -> str:
        """The id of the Ray node this worker runs on."""
        return ray.get_runtime_context().get_node_id()

    def model_dirs(self) -> dict[str, str]:
        """Driver path → the node-local copy this worker loaded instead (empty: it read the driver's paths)."""
        return dict(self.local_dirs)

    def run_stage(self, kind: str, impl: str, params: dict, batch: pa.Table, ctx: StageContext) -> StageResult:
        role = stage_registry(kind).get(impl).role
        return run_stage(kind, impl, params, batch, ctx, self.states.get(role, self.state))

    def meet_peers(self, peers: Peers) -> None:
        """Every role's workers (once, after start), for the driver stages run in this worker's chain calls."""
        self.peers = peers

    def run_chain(self, stages: list[ChainedStage], batch: pa.Table | None, ctxs: list[StageContext]) -> list[ChainStep]:
        """This worker's stages and the task and driver stages next to them in one call (see
        :meth:`RayBackend.start_worker_chain`). ``batch`` None: the chain that was to make it failed; nothing runs."""
        return self._chain(stages, batch, ctxs)[0]

    @ray.method(num_returns=2)
    def run_chain_handing_on(self, stages: list[ChainedStage], batch: pa.Table | None,
                             ctxs: list[StageContext]) -> tuple[list[ChainStep], pa.Table | None]:
        """:meth:`run_chain`, and the chain's last table as a second object, which the next worker's chain takes
        as its input without a stop at the driver (None when a stage failed). ``batch`` None: the chain that
        was to make it failed; nothing runs."""
        return self._chain(stages, batch, ctxs)

    def _chain(self, stages: list[ChainedStage], batch: pa.Table | None,
               ctxs: list[StageContext]) -> tuple[list[ChainStep], pa.Table | None]:
        if batch is None:  # the chain that was to make it failed
            return [], None
        fused = self.peers is not None and any(s.driver for s in stages)
        workers = PeerCalls(self.states, self.peers) if fused else None
        return run_chain(stages, batch, ctxs, f"worker {self.role}[{self.rank}] (pid {os.getpid()}; the stage's "
                         "thread in it is abandoned)", self.states, workers)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A method of this worker's (first) role's state; what another worker calls through a handle."""
        return getattr(self.state, method)(*args, **kwargs)

    def call_role(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """A method of the state of ``role`` (one of the roles this worker hosts)."""
        return getattr(self.states[role], method)(*args, **kwargs)

    def close(self) -> None:
        for state in self.states.values():
            if callable(close := getattr(state, "close", None)):
                close()


@dataclasses.dataclass(frozen=True)
class Peers:
    """What a worker needs to run a driver stage in its own call: every role's workers."""

    roles: dict[str, tuple[str, list[Any], list[str]]]
    """Per role: the role whose workers host it (resources.colocate), its actors and how messages name them, by
    rank."""
    timeout_s: float | None
    """Bound on every wait for another worker's answer (resources.worker_call_timeout_s)."""


class PeerCalls(DeferredCalls):
    """``ctx.workers`` of a driver stage running inside a worker's chain call: the roles this worker hosts are
    called in its memory (their results are values), the others through their actors (results are references,
    resolved here; a deferred one goes back to the driver, which settles it)."""

    def __init__(self, states: dict[str, Any], peers: Peers):
        self.states = states
        self.peers = peers
        self._origin: dict[ray.ObjectRef, tuple[str, int, str]] = {}
        """Who answers each pending reference (role, rank, method): named when it dies."""
        super().__init__()

    def _local(self, role: str) -> bool:
        return role in self.states

    def call(self, role: str, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[Any]:
        return self.resolve(self.call_async(role, method, *args, rank=rank, **kwargs))

    def call_async(self, role: str, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[Any]:
        if self._local(role):  # this worker's only rank of the role (a chain runs on a role with one worker)
            return [getattr(self.states[role], method)(*args, **kwargs)]
        actors = self.peers.roles[role][1]
        ranks = range(len(actors)) if rank is None else [rank]
        if len(ranks) > 1:  # one copy in the object store for all of them (a weight push's buckets), not one each
            args = tuple(a if isinstance(a, ray.ObjectRef) else ray.put(a) for a in args)
        refs = [actors[r].call_role.remote(role, method, *args, **kwargs) for r in ranks]
        self._origin.update((ref, (role, r, method)) for ref, r in zip(refs, ranks))
        return refs

    def resolve(self, futures: list[Any]) -> list[Any]:
        """The values of ``call_async`` results; another worker that does not answer within the bound, or died, is
        named as the driver's facade names it (:func:`get_naming_workers`)."""
        refs = [f for f in futures if isinstance(f, ray.ObjectRef)]
        try:
            values = iter(get_naming_workers(refs, self.peers.timeout_s, self._name))
        finally:
            for ref in refs:
                self._origin.pop(ref, None)
        return [next(values) if isinstance(f, ray.ObjectRef) else f for f in futures]

    def _name(self, ref: ray.ObjectRef) -> tuple[str, str] | None:
        origin = self._origin.get(ref)
        return (self.peers.roles[origin[0]][2][origin[1]], origin[2]) if origin else None

    def take_deferred(self) -> list[tuple[list[Any], str, list[tuple[str, int, str] | None]]]:
        """The calls deferred so far, for the driver to settle, with who answers each (values computed here
        travel as objects)."""
        with self._deferred_lock:
            deferred, self._deferred = self._deferred, []
        return [([f if isinstance(f, ray.ObjectRef) else ray.put(f) for f in futures], failure,
                 [self._origin.pop(f, None) if isinstance(f, ray.ObjectRef) else None for f in futures])
                for futures, failure in deferred]

    def has_role(self, role: str) -> bool:
        return role in self.peers.roles

    def colocated(self, role: str, other: str) -> bool:
        """Whether the workers of ``role`` also host ``other`` (as :meth:`RayWorkerCalls.colocated`)."""
        roles = self.peers.roles
        return role in roles and other in roles and roles[role][0] == roles[other][0]

    def handle(self, role: str, rank: int = 0) -> Any:
        return self.peers.roles[role][1][rank]


def free_address() -> str:
    """A free TCP address on this host for a gloo rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@ray.remote(num_cpus=0, max_retries=0)
def _node_address() -> str:
    """A free TCP address on the node this task runs on (rank 0's node: the gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return f"{ray.util.get_node_ip_address()}:{sock.getsockname()[1]}"


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


class WorkerDied(RlpipeError):
    """A worker actor died (killed, out of memory, crashed) while the run needed it."""


class WorkerCallTimeout(RlpipeError):
    """Workers did not answer a call of the driver within resources.worker_call_timeout_s."""


PLACEMENT_SHARE = 0.001
"""How much of a node's placement resource (resources.placement) each worker asks for."""


class WorkerGroup:
    """The workers of one role; ``node_resource`` (resources.placement) pins them to the nodes holding it.
    ``hosted``: every role these workers host (resources.colocate; default just ``role``): the other roles
    reach the same workers through :meth:`view`."""

    def __init__(self, role: str, size: int, sharded: bool, config: dict, max_concurrency: int = 1,
                 node_resource: str | None = None, gpus: float = 0, shipped: ShippedDirs | None = None,
                 hosted: tuple[str, ...] = (), start_timeout_s: float | None = None):
        self.role = role
        self.sharded = sharded
        self.placement_group = None
        self.start_timeout_s = start_timeout_s
        """Bound on the workers' start (resources.worker_start_timeout_s; None: unbounded)."""
        options: list[dict] = [{} for _ in range(size)]
        address = None
        if sharded and size > 1:
            address, options = self._pack(size, node_resource, gpus, start_timeout_s, role)
        elif node_resource:
            options = [{"resources": {node_resource: PLACEMENT_SHARE}} for _ in range(size)]
        for option in options:  # Ray gives each such worker its own GPU (CUDA_VISIBLE_DEVICES)
            if gpus:
                option["num_gpus"] = gpus
        tag = uuid.uuid4().hex[:8]  # named (rlpipe:<role>:<rank>:<tag>) so `ray list actors` shows who is who
        hosted = hosted or (role,)
        self.hosted = hosted
        """Every role these workers host; the first is the role whose group started them."""
        self.actors = [
            WorkerActor.options(max_concurrency=max_concurrency, name=f"rlpipe:{'+'.join(hosted)}:{rank}:{tag}",
                                **options[rank])
            .remote(hosted, rank, size, config, address, shipped)
            for rank in range(size)
        ]
        self.nodes: list[str] = []
        """Ray node id of every rank (filled by :meth:`ready`)."""
        self.where = ["" for _ in self.actors]
        """Per rank: the worker's pid and host once it is ready."""
        self.killed: set[int] = set()
        """Ranks killed by a stage timeout (shutdown does not wait for them to close)."""

    def view(self, role: str, sharded: bool) -> "WorkerGroup":
        """The same workers as the group of another role they host (resources.colocate): its calls go to that
        role's state; ranks, readiness and kills are shared."""
        other = copy.copy(self)
        other.role, other.sharded = role, sharded
        return other

    def _pack(self, size: int, node_resource: str | None, gpus: float = 0, timeout_s: float | None = None,
              role: str = "sharded") -> tuple[str, list[dict]]:
        """A STRICT_PACK placement group for the DP ranks (one node, optionally the placement resource's; with
        ``gpus`` per rank) and the gloo rendezvous address on that node."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {node_resource: PLACEMENT_SHARE} if node_resource else {"CPU": PLACEMENT_SHARE}
        if gpus:
            bundle["GPU"] = gpus
        self.placement_group = placement_group([dict(bundle) for _ in range(size)], strategy="STRICT_PACK")
        wait_started([self.placement_group.ready()], [f"{role}[0..{size - 1}] (their placement group)"], timeout_s)
        strategies = [PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
                      for rank in range(size)]
        address = ray.get(_node_address.options(scheduling_strategy=strategies[0]).remote())
        return address, [{"scheduling_strategy": s} for s in strategies]

    @property
    def size(self) -> int:
        return len(self.actors)

    @property
    def host(self) -> str:
        """The role whose group started these workers (another role's when colocated with it)."""
        return self.hosted[0]

    def name(self, rank: int) -> str:
        """``role[rank] (pid N on host)``: how messages name one worker."""
        where = f" ({self.where[rank]})" if self.where[rank] else ""
        return f"{self.role}[{rank}]{where}"

    def ready(self) -> None:
        """Wait until every worker has started (built its model); one that failed to is a WorkerDied naming
        it and its own exception."""
        refs = [a.ready.remote() for a in self.actors]

        def started(rank: int, ref: ray.ObjectRef) -> None:  # as each answers: a failed rank fails the start now,
            try:  # not after its peers' rendezvous times out
                self.where[rank] = ray.get(ref)  # in place: views share the list
            except ray.exceptions.RayTaskError as exc:  # its start-up raised (WorkerActor.start_error)
                raise WorkerDied(f"worker {self.role}[{rank}] failed to start: {startup_error_line(exc)}") from None
            except ray.exceptions.RayActorError as exc:  # its process died (killed, out of memory)
                raise WorkerDied(f"worker {self.role}[{rank}] failed to start: {actor_error_line(exc)}") from None

        wait_started(refs, [self.name(rank) for rank in range(self.size)], self.start_timeout_s, started)
        self.nodes[:] = ray.get([a.node.remote() for a in self.actors])

    def kill(self, rank: int) -> None:
        """Kill one worker now (a hung one: it cannot run ``close``); its engine server dies with it."""
        self.killed.add(rank)
        ray.kill(self.actors[rank])

    def call_async(self, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[ray.ObjectRef]:
        actors = self.actors if rank is None else [self.actors[rank]]
        return [a.call_role.remote(self.role, method, *args, **kwargs) for a in actors]

    def call(self, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[Any]:
        return ray.get(self.call_async(method, *args, rank=rank, **kwargs))


class RayBackend:
    """How the executor runs stages on Ray: tasks, worker actors, and the driver-stage facade."""

    def __init__(self, groups: dict[str, WorkerGroup], shared_filesystem: bool = True,
                 task_stages_in_workers: bool = True, call_timeout_s: float | None = None):
        self.groups = groups
        self.shared_filesystem = shared_filesystem
        self.task_stages_in_workers = task_stages_in_workers
        """Task stages next to a single worker's stages run in that worker's call (resources.task_stages_in_workers)."""
        self.workers = RayWorkerCalls(groups, call_timeout_s)

    def overlap(self, work: Callable[[], None]) -> None:
        """Call ``work()`` each time the driver waits on a remote call (stage calls and the workers facade's
        ``resolve``): the executor's lineage records of the nodes before are written while this one runs."""
        self.workers.while_waiting = work

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

    def shutdown(self) -> None:
        """Close every worker's state (a rollout replica stops the engine server it owns), then kill the actors."""
        hosts = [g for role, g in self.groups.items() if g.host == role]  # colocated roles: their host's workers
        closing = {a.close.remote(): g.name(r) for g in hosts for r, a in enumerate(g.actors) if r not in g.killed}
        _, stuck = ray.wait(list(closing), num_returns=len(closing), timeout=CLOSE_TIMEOUT_S) if closing else ([], [])
        for ref, name in closing.items():
            if ref in stuck:
                log.warning("worker %s did not close within %.0f s; killing it (an engine server it owns dies "
                            "with it)", name, CLOSE_TIMEOUT_S)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                log.info("worker %s was already gone at shutdown", name)
            except Exception as exc:  # noqa: BLE001 - a failing close must not keep the others alive
                log.warning("closing worker %s: %s", name, actor_error_line(exc))
        for group in hosts:
            for actor in group.actors:
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
            rank = next((i for i, ref in enumerate(refs) if _died(ref)), None)
            who = group.name(rank) if rank is not None else f"a {role} worker"
            raise WorkerDied(f"worker {who} died while running stage {kind}/{impl} at step {ctxs[0].step}: "
                             f"{actor_error_line(exc)}") from None

    def shards(self, role: str, table: pa.Table, dp_rank_column: str) -> list[np.ndarray]:
        group = self.groups[role]
        return shard_rows(table, group.size, group.sharded, dp_rank_column)


def get_naming_workers(refs: list[ray.ObjectRef], timeout_s: float | None,
                       name: Callable[[ray.ObjectRef], tuple[str, str] | None]) -> list[Any]:
    """``ray.get(refs)`` within ``timeout_s`` (None: no bound); workers that do not answer are a
    :class:`WorkerCallTimeout`, a dead one a :class:`WorkerDied`, each named by ``name(ref)``: (worker, method)."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        _, late = ray.wait(refs, num_returns=len(refs), timeout=0)
        who = ", ".join(f"{n[0]}.{n[1]}" if (n := name(ref)) else "a worker" for ref in late)
        raise WorkerCallTimeout(
            f"no answer after resources.worker_call_timeout_s={timeout_s:g} s from {who}; if that call is only "
            "slow, raise it (-o resources.worker_call_timeout_s=SECONDS), otherwise look for what hangs in that "
            "worker (its log is in Ray's session folder, /tmp/ray/session_latest/logs, by pid)") from None
    except ray.exceptions.RayActorError as exc:
        dead = next((ref for ref in refs if _died(ref)), None)
        named = name(dead) if dead is not None else None
        who = f"worker {named[0]}" if named else "a worker"
        raise WorkerDied(f"{who} died: {actor_error_line(exc)} (its log is in Ray's session folder, "
                         "/tmp/ray/session_latest/logs, by pid)") from None


def _died(ref: ray.ObjectRef) -> bool:
    """Whether ``ref`` is ready and failed because its actor died."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 - not ready, or another error: not this one
        return False
    return False


ORIGINS_KEPT = 4096
"""How many recent worker-call futures remember which worker they went to (to name a dead one)."""


class RayWorkerCalls(DeferredCalls):
    """The ``ctx.workers`` facade of driver stages, backed by the run's worker groups."""

    def __init__(self, groups: dict[str, WorkerGroup], timeout_s: float | None = None):
        self.groups = groups
        self.timeout_s = timeout_s
        """Bound on every :meth:`resolve` (resources.worker_call_timeout_s); None: wait forever."""
        self._origin: dict[ray.ObjectRef, tuple[str, int, str]] = {}
        self._origin_lock = threading.Lock()  # the async modes' helper threads call too
        self.while_waiting: Callable[[], None] = lambda: None
        """Driver work done before blocking in :meth:`resolve` (set by :meth:`RayBackend.overlap`)."""
        super().__init__()

    def call(self, role: str, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[Any]:
        return self.resolve(self.call_async(role, method, *args, rank=rank, **kwargs))

    def call_async(self, role: str, method: str, *args: Any, rank: int | None = None, **kwargs: Any) -> list[Any]:
        """Like call, but returns futures that can be passed as arguments to later calls."""
        refs = self.groups[role].call_async(method, *args, rank=rank, **kwargs)
        with self._origin_lock:
            for r, ref in zip(range(self.groups[role].size) if rank is None else [rank], refs):
                self._origin[ref] = (role, r, method)
            while len(self._origin) > ORIGINS_KEPT:
                del self._origin[next(iter(self._origin))]
        return refs

    def resolve(self, futures: list[Any]) -> list[Any]:
        """The values of ``call_async`` results (blocks until they are ready); a dead worker is a
        :class:`WorkerDied` naming it (role, rank, pid)."""
        futures = list(futures)
        self.while_waiting()
        try:
            return get_naming_workers(futures, self.timeout_s, self._name)
        finally:
            with self._origin_lock:
                for ref in futures:
                    self._origin.pop(ref, None)

    def _name(self, ref: ray.ObjectRef) -> tuple[str, str] | None:
        with self._origin_lock:
            origin = self._origin.get(ref)
        return (self.groups[origin[0]].name(origin[1]), origin[2]) if origin else None

    def defer(self, futures: list[Any], failure: str, origins: list[tuple[str, int, str] | None] | None = None) -> None:
        """As :meth:`DeferredCalls.defer`; ``origins``: who answers each future (role, rank, method), when another
        worker made the call (a driver stage in its chain), so that a dead one is named."""
        with self._origin_lock:
            for ref, origin in zip(futures, origins or []):
                if origin is not None:
                    self._origin[ref] = origin
        super().defer(futures, failure)

    def has_role(self, role: str) -> bool:
        return role in self.groups

    def colocated(self, role: str, other: str) -> bool:
        """Whether the workers of ``role`` also host ``other`` (resources.colocate), rank for rank."""
        return role in self.groups and other in self.groups and self.groups[role].host == self.groups[other].host

    def handle(self, role: str, rank: int = 0) -> Any:
        """The actor of one worker, to pass to another worker (which calls it through ``call.remote``)."""
        return self.groups[role].actors[rank]
