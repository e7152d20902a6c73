"""Worker processes kept between runs of one driver process and Ray session (a sweep, a notebook, a test suite).

Starting a model-holding worker costs its process seconds of CPU before it does any work: the Python worker,
then torch and transformers' model classes imported (~4 CPU-s on a laptop-class core), most of it imports. A
driver that runs several pipelines one after another in one Ray session can keep its workers' processes instead
of killing them at each run's end: :func:`keep_idle_workers` turns that on for this process. A finished run's
workers then release what the run built (states closed, models and optimizers dropped, a process group left)
and wait idle; the next run's worker groups take them (:func:`take`) and build their own states in them, as a
new worker would (same start-up code, same seeds, same thread budget; the run's own config). A kept worker
serves only the same roles at the same rank, so its name in ``ray list actors`` (``rlpipe:<roles>:<rank>:<tag>``)
stays true; the tag is its first run's.

Never kept: the workers of a run that did not finish (a stage failed, timed out, or the run was interrupted:
an abandoned stage thread may still run in them), workers that imported a plugin file (its parts stay
registered in the process), workers in a placement group (data-parallel ranks packed for their rendezvous) or
holding GPUs. A kept worker that died while idle is noticed when taken and replaced by a new one.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Hashable

log = logging.getLogger(__name__)

MAX_IDLE = 6
"""Idle workers kept at most (each holds its imports: a few hundred MB); more are killed."""
ALIVE_TIMEOUT_S = 10.0
"""How long taking a kept worker waits for it to answer before starting a new one instead."""

_enabled = False
_idle: dict[Hashable, collections.deque] = collections.defaultdict(collections.deque)
_lock = threading.Lock()


def keep_idle_workers(enabled: bool = True) -> None:
    """Keep finished runs' worker processes for the next run in this process's Ray session (off by default:
    ``rlpipe run`` runs one pipeline per process). Turning it off kills the kept ones."""
    global _enabled
    _enabled = enabled
    if not enabled:
        drain()


def enabled() -> bool:
    """Whether finished runs' workers are kept (:func:`keep_idle_workers`)."""
    return _enabled


def _session() -> str:
    """This driver's Ray job: kept workers belong to the Ray session they were started in."""
    import ray

    return ray.get_runtime_context().get_job_id()


def take(shape: Hashable) -> Any | None:
    """A kept worker of ``shape`` (its actor options) that still answers, or None."""
    import ray

    shape = (_session(), shape)
    while True:
        with _lock:
            kept = _idle.get(shape)
            actor = kept.popleft() if kept else None
        if actor is None:
            return None
        if _answer(actor, "ready") is not None:
            return actor
        log.info("a kept worker no longer answers; starting a new one")
        ray.kill(actor)


def give_back(shape: Hashable, actor: Any) -> bool:
    """Keep ``actor`` (released by its run) for the next run of ``shape``; False (the caller kills it) when
    keeping is off or MAX_IDLE are kept already."""
    shape = (_session(), shape)
    with _lock:
        for other in [s for s in _idle if s[0] != shape[0]]:  # a Ray session that ended took its workers along
            del _idle[other]
        if not _enabled or sum(len(q) for q in _idle.values()) >= MAX_IDLE:
            return False
        _idle[shape].append(actor)
        return True


def kept() -> list[str]:
    """The names of the idle workers kept now (``ray.get_actor(name)`` finds one), sorted."""
    with _lock:
        actors = [a for q in _idle.values() for a in q]
    return sorted(name for a in actors if (name := _answer(a, "name")))  # one that died: taking it replaces it


def _answer(actor: Any, method: str) -> Any | None:
    """What ``actor.method()`` answers within ALIVE_TIMEOUT_S; None when it died, raised or did not answer."""
    import ray

    try:
        return ray.get(getattr(actor, method).remote(), timeout=ALIVE_TIMEOUT_S)
    except ray.exceptions.RayError:  # GetTimeoutError is one too
        return None


def drain() -> None:
    """Kill every kept worker (Ray's shutdown does too)."""
    with _lock:
        actors = [a for q in _idle.values() for a in q]
        _idle.clear()
    if actors:
        import ray

        if ray.is_initialized():
            for actor in actors:
                ray.kill(actor)
