"""Starting the workers: what they ask Ray for fits the cluster, and waiting for them is bounded.

An actor that asks for a GPU the cluster does not have, or for the custom resource of a node that is
not there (``resources.placement``), stays pending in Ray forever with only a warning on the terminal.
:func:`check_demand` refuses such a start before any worker is created, naming the field; a worker
that does not start for another reason (a model that takes too long to load, a hung engine server, an
autoscaler that never adds the node) is bounded by ``resources.worker_start_timeout_s``
(:func:`wait_started`). Left out: resources that are free now versus in the cluster at all (a busy
cluster's workers wait for others to finish, within the bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rlpipe.errors import ConfigError, RlpipeError

_BUILT_IN = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray defines itself (with ``node:<ip>`` and ``accelerator_type:<name>``): not a placement's."""


class WorkerStartTimeout(RlpipeError):
    """Workers did not start within resources.worker_start_timeout_s."""


@dataclass(frozen=True)
class Demand:
    """What one worker group asks Ray for."""

    roles: tuple[str, ...]
    """The roles its workers host (the first started them)."""
    size: int
    """Its workers (ranks)."""
    gpus: float
    """GPUs per worker."""
    placement: tuple[str, str] | None
    """(role, resource) of the resources.placement entry it follows, if any."""


def check_demand(demands: Sequence[Demand], cluster: dict[str, float], gpus_per_worker: float) -> None:
    """Every placement resource exists in ``cluster`` (ray.cluster_resources()) and the GPUs asked for in all fit."""
    for demand in demands:
        if demand.placement is not None and demand.placement[1] not in cluster:
            role, resource = demand.placement
            custom = sorted(k for k in cluster if k not in _BUILT_IN and not k.startswith(("node:", "accelerator_type")))
            raise ConfigError(
                f"resources.placement.{role}: no node of this Ray cluster has the resource {resource!r} (start that "
                f"node with `ray start --resources '{{\"{resource}\": 1}}'`); its custom resources: "
                f"{', '.join(custom) or 'none'}")
    asked = sum(d.size * d.gpus for d in demands)
    have = cluster.get("GPU", 0.0)
    if asked > have + 1e-9:
        who = ", ".join(f"{'+'.join(d.roles)}×{d.size}" for d in demands if d.gpus)
        raise ConfigError(
            f"resources.gpus_per_worker={gpus_per_worker:g}: the model-holding workers ({who}) ask Ray for "
            f"{asked:g} GPU in all and this Ray cluster has {have:g}; lower resources.gpus_per_worker (0 with "
            "resources.device: cpu runs on CPUs), or start Ray on machines with enough GPUs")


def wait_started(refs: list, names: Sequence[str], timeout_s: float | None,
                 on_answer: Callable[[int, Any], None] | None = None) -> None:
    """Wait until every one of ``refs`` (one call per worker) has an answer, handing each to ``on_answer(index,
    ref)`` as it comes (which may raise: a failed worker ends the wait at once); past ``timeout_s`` (None: no
    bound) a WorkerStartTimeout names the workers still starting."""
    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            raise WorkerStartTimeout(
                f"worker(s) {', '.join(names[index[ref]] for ref in pending)} did not start within "
                f"resources.worker_start_timeout_s={timeout_s:g} s (building the model or starting its engine server "
                "takes longer, or hangs; `ray status` shows whether Ray could place them); raise it with "
                "-o resources.worker_start_timeout_s=SECONDS")
        if on_answer is not None:
            for ref in done:
                on_answer(index[ref], ref)
