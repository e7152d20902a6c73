"""Weight sync: push the trainer's weights to the rollout engine under a new policy version.

The five boundaries of the seed (6.0–6.6); a failure names its boundary:
(1) export — trainer layout → inference layout buckets on trainer rank 0;
(2) transport — the buckets travel through Ray's object store straight from the
trainer to the rollout replicas (never through this process); on each replica
(``RolloutState.push_weights``): (0) state switch — abort everything in flight
(the engine refuses a load while requests are active), (3) engine load —
checksum-verified copy into the engine's parameters, (4) recovery — KV caches
dropped on the version change and the aborted requests resumed on the new
weights (partial rollout; async modes). Every push bumps the policy version by one.
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
    buckets = _boundary("1 (export)", lambda: workers.call_async("actor", "export_weights", rank=0)[0])
    version = _boundary("1 (version bump)", lambda: workers.call("actor", "bump_version"))[0]
    aborted = _boundary(
        "0/2-4 (quiesce rollout, transport, engine load, cache reset, resume)",
        lambda: workers.call("rollout", "push_weights", buckets, version),
    )
    return StageResult(metrics={
        "weight_sync/version": float(version),
        "weight_sync/aborted_requests": float(sum(aborted)),
        "weight_sync/push_s": time.time() - t0,
    })
