"""Weight sync: push the trainer's weights to the rollout engine under a new policy version.

The five boundaries of the seed (6.0–6.6), each a separate call so a failure
names its boundary: (0) state switch — wake the engine and abort anything in
flight (the engine refuses a load while requests are active); (1) export —
trainer layout → inference layout buckets on trainer rank 0; (2) transport —
the buckets travel through Ray's object store straight from the trainer to the
engine (never through this process); (3) engine load — checksum-verified copy
into the engine's parameters; (4) recovery — the engine drops its KV caches on
the version change. Every push bumps the trainer's policy version by one.
Other transports (shared memory, NCCL, delta sync) are later work.
"""

from __future__ import annotations

import time

from rlpipe.errors import RlpipeError
from rlpipe.stage import StageParams, StageResult, stage


class WeightSyncParams(StageParams):
    """Object-store weight push."""


def _boundary(name: str, fn):
    try:
        return fn()
    except Exception as exc:
        raise RlpipeError(f"weight sync failed at boundary {name}: {exc}") from exc


@stage("weight_sync", "object_store", placement="driver", params=WeightSyncParams, reads={}, writes={})
def push_weights(batch, params: WeightSyncParams, ctx) -> StageResult:
    workers = ctx.workers
    t0 = time.time()
    aborted = _boundary("0 (state switch)", lambda: (workers.call("rollout", "wake"), workers.call("rollout", "abort_all"))[1])
    t1 = time.time()
    buckets = _boundary("1 (export)", lambda: workers.call_async("actor", "export_weights", rank=0)[0])
    version = _boundary("1 (version bump)", lambda: workers.call("actor", "bump_version"))[0]
    t2 = time.time()
    _boundary("2-4 (transport, engine load, cache reset)", lambda: workers.call("rollout", "load_weights", buckets, version))
    t3 = time.time()
    return StageResult(metrics={
        "weight_sync/version": float(version),
        "weight_sync/aborted_requests": float(sum(len(a) for a in aborted)),
        "weight_sync/switch_s": t1 - t0,
        "weight_sync/export_s": t2 - t1,
        "weight_sync/load_s": t3 - t2,
    })
