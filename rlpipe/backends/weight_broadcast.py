"""Broadcast weight transport: buckets go from trainer rank 0 to every rollout replica in one
torch.distributed broadcast each (NCCL between GPUs, gloo between CPU processes).

The weight group is separate from the trainer's data-parallel group: rank 0 is trainer rank
0, rank ``r + 1`` is rollout replica ``r``. It is a standalone process group over its own
``TCPStore`` (torch's ``ProcessGroupNCCL`` / ``ProcessGroupGloo`` objects, not the default
group), so a trainer already in its DP group and replicas in none can join it, as verl,
OpenRLHF and vLLM's weight-transfer engines do. It is formed at the first push and kept;
every wait is bounded (store connection, group rendezvous, each broadcast).

A push: (1) rank 0 packs its buckets (``rlpipe.backends.weights``) and sends only their
metadata (names, shapes, dtypes, offsets, checksums: a few KB) through Ray; (2) rank 0
broadcasts each bucket's bytes, every replica receives into a buffer of that size on its
device; (3) each replica checks every bucket's checksum on the host before its engine loads
anything. NCCL refuses two ranks on one GPU, so an NCCL group needs the trainer and each
replica on distinct devices; gloo also moves CUDA tensors (through host memory).

Left out: broadcasting straight into the engine's parameters (one bucket buffer per replica is
allocated per bucket), overlapping buckets (double buffering), re-forming the group after a
member died (the push fails naming the boundary; restart the run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from rlpipe.backends.weights import TensorMeta, WeightBucket, WeightPush, WeightTransportError, checksum


@dataclass(frozen=True)
class BucketHeader:
    """A bucket without its bytes: what a receiver needs to allocate, check and load it."""

    nbytes: int
    tensors: tuple[TensorMeta, ...]
    checksum: str


@dataclass(frozen=True)
class BroadcastPlan:
    """What the replicas are told (through Ray) before the bytes are broadcast."""

    host: str
    port: int
    group: str
    """Name of the weight group (a store prefix): replicas keep their membership while it stays the same."""
    world_size: int
    backend: str
    """``nccl`` or ``gloo``."""
    timeout_s: float
    headers: tuple[BucketHeader, ...]
    version: int
    export_s: float
    exported_at: float
    sender_pid: int
    """The trainer's process: a receiver in the same process (inline executor) refuses instead of waiting."""

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.headers)


def _options(root: int = 0) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


class WeightGroup:
    """One member of the weight group; rank 0 (the trainer) owns the store."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float, device):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        try:
            if backend == "nccl":
                if not hasattr(dist, "ProcessGroupNCCL") or self.device.type != "cuda":
                    raise WeightTransportError(
                        f"backend nccl needs a CUDA torch and a cuda device (this member has {self.device}); use "
                        "backend gloo on CPU")
                torch.cuda.set_device(self.device.index if self.device.index is not None else
                                      torch.cuda.current_device())
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            elif backend == "gloo":
                self.pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
            else:
                raise WeightTransportError(f"unknown weight group backend {backend!r}; known: gloo, nccl")
        except WeightTransportError:
            raise
        except Exception as exc:  # a rendezvous timeout names who did not come
            raise WeightTransportError(
                f"weight group rank {rank}/{world_size} ({backend}) could not form within {timeout_s:g}s: {exc}; "
                "every replica must reach the trainer's rank 0 (weight_sync params host) over TCP") from exc

    @classmethod
    def open_store(cls, host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's store on a free port (returns at once; members connect when they join)."""
        return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    @classmethod
    def join(cls, plan: BroadcastPlan, rank: int, device) -> "WeightGroup":
        """A replica's membership: connect to rank 0's store and rendezvous (bounded by ``plan.timeout_s``)."""
        try:
            store = dist.TCPStore(plan.host, plan.port, plan.world_size, is_master=False,
                                  timeout=timedelta(seconds=plan.timeout_s))
        except Exception as exc:
            raise WeightTransportError(f"cannot reach the trainer's weight group store at {plan.host}:{plan.port} "
                                       f"within {plan.timeout_s:g}s: {exc}") from exc
        return cls(dist.PrefixStore(plan.group, store), rank, plan.world_size, plan.backend, plan.timeout_s, device)

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        try:
            self.pg.broadcast([tensor], _options()).wait(self.timeout)
        except Exception as exc:
            raise WeightTransportError(f"broadcast of {what} did not complete within {self.timeout.total_seconds():g}s "
                                       f"on weight group rank {self.rank}: {exc}") from exc

    def send(self, buckets: list[WeightBucket]) -> float:
        """Rank 0: broadcast every bucket's bytes; returns the seconds it took."""
        start = time.perf_counter()
        for i, bucket in enumerate(buckets):
            data = torch.from_numpy(np.ascontiguousarray(bucket.data)).to(self.device)
            self._broadcast(data, f"bucket {i}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def receive(self, plan: BroadcastPlan) -> WeightPush:
        """A replica: every bucket of ``plan``, received and checksum-verified on the host."""
        buckets = []
        for i, header in enumerate(plan.headers):
            data = torch.empty(header.nbytes, dtype=torch.uint8, device=self.device)
            self._broadcast(data, f"bucket {i}")
            host = data.cpu().numpy()
            if checksum(host) != header.checksum:
                raise WeightTransportError(
                    f"bucket {i} of the push of version {plan.version} (holding {header.tensors[0].name}...) arrived "
                    "with another checksum than the trainer sent: the bytes changed in transit")
            buckets.append(WeightBucket(host, header.tensors, header.checksum))
        return WeightPush(tuple(buckets), export_s=plan.export_s, exported_at=plan.exported_at)


def headers(buckets: list[WeightBucket]) -> tuple[BucketHeader, ...]:
    return tuple(BucketHeader(b.nbytes, b.tensors, b.checksum) for b in buckets)


class BroadcastSender:
    """Trainer rank 0's side across pushes: the store and group (formed once) and the buckets of the push
    being sent."""

    def __init__(self, device, default_host: str | None):
        self.device = torch.device(device)
        self.default_host = default_host
        self._key: tuple | None = None
        self._store = None
        self._group: WeightGroup | None = None
        self._plan: BroadcastPlan | None = None
        self._buckets: list[WeightBucket] | None = None

    def plan(self, buckets: list[WeightBucket], version: int, replicas: int, backend: str, host: str | None,
             timeout_s: float, export_s: float) -> BroadcastPlan:
        """Keep ``buckets`` for :meth:`send`; open the store on the first push (or when the group changes)."""
        import os
        import socket
        import uuid

        backend = ("nccl" if self.device.type == "cuda" else "gloo") if backend == "auto" else backend
        key = (replicas + 1, backend, host)
        if key != self._key:
            host = host or self.default_host or socket.gethostbyname(socket.gethostname())
            self._store = WeightGroup.open_store(host, replicas + 1, timeout_s)
            self._key, self._group = key, None
            self._base = (host, self._store.port, f"rlpipe-weights-{uuid.uuid4().hex[:8]}")
        host_, port, group = self._base
        self._buckets = buckets
        self._plan = BroadcastPlan(host_, port, group, replicas + 1, backend, timeout_s, headers(buckets), version,
                                   export_s, time.time(), os.getpid())
        return self._plan

    def send(self) -> dict[str, float]:
        """Broadcast the planned buckets (joins the group on the first push); ``send_s`` and ``join_s`` (0 once
        the group has formed)."""
        if self._plan is None or self._buckets is None:
            raise WeightTransportError("broadcast_send without a planned push: call broadcast_export first")
        join_s = 0.0
        if self._group is None:
            start, plan = time.perf_counter(), self._plan
            self._group = WeightGroup(dist.PrefixStore(plan.group, self._store), 0, plan.world_size, plan.backend,
                                      plan.timeout_s, self.device)
            join_s = time.perf_counter() - start
        buckets, self._buckets = self._buckets, None
        # `aborted`: the sender aborts no request; a deferred push's settled results are summed by that key
        return {"join_s": join_s, "send_s": self._group.send(buckets), "aborted": 0.0}


class BroadcastReceiver:
    """A replica's side across pushes: its membership of the weight group."""

    def __init__(self, rank: int, device):
        self.rank = rank
        self.device = torch.device(device)
        self._group_name: str | None = None
        self._group: WeightGroup | None = None

    def receive(self, plan: BroadcastPlan) -> WeightPush:
        import os

        if plan.sender_pid == os.getpid():
            raise WeightTransportError(
                "weight_sync impl broadcast needs the trainer and the rollout replicas in separate processes (the Ray "
                "executor); this run hosts both in one process (inline): use weight_sync impl object_store")
        if plan.world_size < self.rank + 2:
            raise WeightTransportError(f"weight group of {plan.world_size} has no rank for rollout replica {self.rank}")
        if plan.group != self._group_name:
            self._group = WeightGroup.join(plan, self.rank + 1, self.device)
            self._group_name = plan.group
        return self._group.receive(plan)
