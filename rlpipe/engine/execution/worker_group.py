"""The workers of one role on Ray: started (packed for data parallelism, pinned by resources.placement),
waited for with a bound, named in messages, killed when hung.
"""

from __future__ import annotations

import copy
import socket
import uuid
from typing import Any

import ray

from rlpipe.engine.execution import worker_pool
from rlpipe.engine.execution.ray_errors import actor_error_line, startup_error_line
from rlpipe.engine.execution.ray_worker import WorkerActor
from rlpipe.engine.execution.worker_calls import WorkerDied
from rlpipe.engine.execution.worker_start import wait_started
from rlpipe.engine.files.ship import ShippedDirs


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
        self.shape = (hosted, max_concurrency, node_resource) if self.placement_group is None and not gpus else None
        """What a kept worker must have been started as to serve here, with its rank (rlpipe.engine.execution.
        worker_pool): the same roles and rank keep its name (``rlpipe:<roles>:<rank>:<tag>``) true. None: these
        workers are never kept (packed in a placement group, or holding GPUs)."""
        self.actors: list = []
        self._started: dict[int, ray.ObjectRef] = {}
        """Per rank given a kept worker: its restart call, which answers as ``ready`` does."""
        for rank in range(size):
            kept = worker_pool.take((self.shape, rank)) if self.shape is not None and worker_pool.enabled() else None
            if kept is not None:
                self._started[rank] = kept.restart.remote(hosted, rank, size, config, address, shipped)
                self.actors.append(kept)
                continue
            self.actors.append(
                WorkerActor.options(max_concurrency=max_concurrency, name=f"rlpipe:{'+'.join(hosted)}:{rank}:{tag}",
                                    **options[rank])
                .remote(hosted, rank, size, config, address, shipped))
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
        refs = [self._started.pop(rank, None) or a.ready.remote() for rank, a in enumerate(self.actors)]

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
