"""The worker side of Ray: the generic worker actor and the stage tasks.

Every role runs in the same actor class, :class:`WorkerActor`, which builds the role's state from the
``worker_role`` registry and runs worker stages against it (and, in one call, the task and driver stages
next to them: :meth:`WorkerActor.run_chain`). Stateless stages run as Ray tasks. Arrow tables travel as
Ray objects (zero-copy out of the object store); torch tensors never cross process lines.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import sys
from typing import Any

import pyarrow as pa
import ray

from rlpipe.engine.execution.deferred import DeferredCalls
from rlpipe.engine.execution.wire import register_arrow_ipc
from rlpipe.engine.execution.worker_calls import get_naming_workers
from rlpipe.engine.files.ship import ShippedDirs, localize
from rlpipe.engine.stage_call import ChainedStage, ChainStep, run_chain, run_stage
from rlpipe.engine.state.roles import WORKER_ROLES
from rlpipe.plugin_files import import_plugin_files
from rlpipe.registry import load_plugins
from rlpipe.schemas.config import PipelineConfig
from rlpipe.stage import StageContext, StageResult, stage_registry


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
        self.imported_plugins = False
        """Whether a run hosted here imported plugin files (their parts stay registered: never kept for another
        run, rlpipe.engine.execution.worker_pool)."""
        self._host(roles, rank, world_size, config, dist_address, shipped)

    def restart(self, roles: str | tuple[str, ...], rank: int, world_size: int, config: dict,
                dist_address: str | None, shipped: ShippedDirs | None = None) -> str:
        """Host another run's roles in this kept process (rlpipe.engine.execution.worker_pool): the start-up a new
        worker runs, then :meth:`ready`'s answer (one call: a threaded actor may run two calls in either order)."""
        self._host(roles, rank, world_size, config, dist_address, shipped)
        return self.ready()

    def release(self) -> bool:
        """Close and drop this run's states (models, optimizers, engine servers, a process group), keeping the
        process and its imports; whether it may host another run."""
        self.close()
        self.states.clear()
        self.state = self.peers = None
        dist = sys.modules.get("torch.distributed")  # imported by a state that joined a process group, if any
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        return not self.imported_plugins

    def _host(self, roles: str | tuple[str, ...], rank: int, world_size: int, config: dict,
              dist_address: str | None, shipped: ShippedDirs | None) -> None:
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
        self.imported_plugins = self.imported_plugins or bool(parsed.plugins)
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

    def name(self) -> str:
        """The name this worker was started with (``rlpipe:<roles>:<rank>:<tag>``)."""
        return ray.get_runtime_context().get_actor_name() or ""

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
