"""How rlpipe's processes use the host's CPUs and memory: torch's thread budget and the allocator.

**Threads** (``trainer.torch_threads``). Decided once, in the driver, before any worker starts
(:func:`plan_torch_threads`); every process that holds a model applies it (:func:`configure_process`).
``None`` (the default) gives each worker process its share of the CPUs: the CPUs this process may
use divided by the worker processes that compute at the same time — ``1`` inline (every stage in
the driver), the largest worker group in a mode whose roles take turns (sync: the trainer's DP ranks
compute together, the rollout replicas together, never both), the trainer's and the rollout's
groups together in a mode that generates while it trains (the async modes). Colocated roles share
one process. A model narrower than :data:`MIN_HIDDEN_FOR_THREADS` gets one thread: on the 2-core
benchmark machine a second intra-op thread made the vs-TRL model's step (hidden 64) slower, 80 ->
105 ms, because each parallel region of its small ops wakes the other core, and made a 22.6M-parameter
one (hidden 512) faster, 2.85 -> 2.0 s (benchmarks/vs_trl.py; docs/benchmarks.md). On a multi-node
Ray cluster the count is of all workers, so set the number yourself there.

**Memory** (``resources.keep_freed_memory``). glibc's malloc returns freed memory to the kernel when
the top of its heap grows past a threshold that follows the largest freed block; torch's CPU
tensors are freed and allocated again every step, so the kernel zero-fills the same pages again at
each touch (~2,300 page faults per fwd+bwd of the benchmark model). The settings here keep freed
memory in the process for reuse (a process holds its peak heap, as torch's CUDA caching allocator
does): the fwd+bwd+AdamW of the benchmark model 47 -> 42 ms at one thread, 33 -> 30 at two.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from rlpipe.schemas.config import PipelineConfig

log = logging.getLogger(__name__)

MIN_HIDDEN_FOR_THREADS = 256
"""Models with a smaller hidden size run one intra-op thread per process (see the module docstring)."""

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameter numbers
_KEEP_FREED = ((_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20), (_M_MMAP_THRESHOLD, 32 << 20))
"""Trim the heap only past 1 GiB free at its top, grow it 64 MiB at a time, and serve blocks up to
32 MiB (glibc's largest mmap threshold) from the heap instead of a fresh mmap each."""

_configured: tuple[int, bool] | None = None


@dataclass(frozen=True)
class ThreadBudget:
    """The torch intra-op threads of every worker process, and why."""

    threads: int
    """Threads per process."""
    reason: str
    """How the number was chosen (shown by ``rlpipe validate`` and logged as the run's param)."""


def cpus_available() -> int:
    """CPUs this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def hidden_size(config: PipelineConfig) -> int | None:
    """The policy's hidden size from its architecture or its folder's config.json; None when unknown."""
    if config.model.architecture is not None:
        return config.model.architecture.hidden_size
    try:
        meta = json.loads((Path(config.model.path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    value = meta.get("hidden_size") or meta.get("text_config", {}).get("hidden_size")
    return int(value) if isinstance(value, int) else None


def concurrent_workers(config: PipelineConfig, roles: set[str], generates_while_training: bool,
                       inline: bool) -> int:
    """Worker processes that compute at the same time (see the module docstring)."""
    if inline:
        return 1
    from rlpipe.engine.state.roles import WORKER_ROLES, worker_processes

    processes = worker_processes(config, roles)
    sizes: dict[str, int] = {}
    for hosted in processes.values():
        specs = [WORKER_ROLES.get(r) for r in hosted if r in WORKER_ROLES.names()]
        if any(s.holds_model for s in specs):
            sizes.update(dict.fromkeys(hosted, specs[0].size(config)))
    if not sizes:
        return 1
    trainer, rollout = sizes.get("actor", 1), sizes.get("rollout", 1)
    colocated = any("actor" in hosted and "rollout" in hosted for hosted in processes.values())
    together = trainer + rollout if generates_while_training and not colocated else max(trainer, rollout)
    return max([together, *sizes.values()])


def plan_torch_threads(config: PipelineConfig, roles: set[str], generates_while_training: bool,
                       inline: bool) -> ThreadBudget:
    """The thread budget of this run's worker processes (``trainer.torch_threads``; None: see above)."""
    if config.trainer.torch_threads is not None:
        return ThreadBudget(config.trainer.torch_threads, "trainer.torch_threads")
    cpus = cpus_available()
    width = hidden_size(config)
    if width is not None and width < MIN_HIDDEN_FOR_THREADS:
        return ThreadBudget(1, f"auto: hidden size {width} < {MIN_HIDDEN_FOR_THREADS}, where more intra-op threads "
                               "only wait on each other")
    workers = concurrent_workers(config, roles, generates_while_training, inline)
    threads = max(1, cpus // workers)
    return ThreadBudget(threads, f"auto: {cpus} CPUs / {workers} worker process(es) computing at once")


def run_thread_budget(config: PipelineConfig, plan, inline: bool) -> tuple[set[str], ThreadBudget]:
    """The worker roles of a run of ``plan`` (those its nodes and mode need, and the trainer and the
    rollout, which every run has) and their thread budget."""
    from rlpipe.engine.state.roles import ALWAYS_ROLES
    from rlpipe.registry import registry

    mode_cls = registry("mode").get(config.mode)
    roles = set(ALWAYS_ROLES) | plan.roles() | mode_cls.roles(config)
    return roles, plan_torch_threads(config, roles, mode_cls.generates_while_training, inline)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse (see the module docstring); False where it is
    not glibc (musl, macOS) or refused a setting."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return False
    return mallopt is not None and all(mallopt(param, value) == 1 for param, value in _KEEP_FREED)


def configure_process(config: PipelineConfig) -> None:
    """Apply the run's thread budget and allocator settings in this process (idempotent; once the
    driver resolved ``trainer.torch_threads``, it is a number here)."""
    import torch

    global _configured
    threads = config.trainer.torch_threads or 1
    keep = config.resources.keep_freed_memory
    if _configured == (threads, keep):
        return
    torch.set_num_threads(threads)
    if keep and not keep_freed_memory():
        log.debug("resources.keep_freed_memory: this C library has no glibc mallopt; left as it is")
    _configured = (threads, keep)
