"""A vLLM weight-transfer backend for CPU: weight buckets through shared-memory files.

vLLM 0.32 moves trainer weights into a running server through its weight-transfer
API (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``; vllm/entrypoints/rl/online/api_router.py), which calls a
``WeightTransferEngine`` in each worker (vllm/v1/worker/gpu_worker.py, inherited by
vllm/v1/worker/cpu_worker.py). Its built-in backends (vllm/distributed/weight_transfer/
factory.py) are CUDA only: ``ipc`` rebuilds CUDA IPC handles (ipc_engine.py), the
``nccl`` family needs NCCL, ``sharded_rdt`` needs Ray GPU objects. This module adds
the CPU equivalent of ``ipc``, registered under :data:`BACKEND` through vLLM's plugin
system (entry-point group ``vllm.general_plugins``, loaded in every vLLM process:
vllm/plugins/__init__.py):

- the trainer side (:class:`rlpipe.inference.vllm_engine.VLLMEngine`) writes each
  :class:`~rlpipe.backends.weights.WeightBucket`'s bytes to one file in ``/dev/shm``
  (RAM, no disk) and posts its tensor table (names, dtypes, shapes, byte offsets) to
  ``/update_weights``;
- the worker maps the file (``torch.from_file(shared=True)``, no copy), views each
  tensor in place and hands ``(name, tensor)`` pairs to the model's own
  ``load_weights`` (HF names, as from a checkpoint), between vLLM's layerwise-reload
  hooks exactly as the ``ipc`` backend does (vllm/model_executor/model_loader/reload/),
  so any post-load processing of a layer is redone (plus the CPU GEMM handle of a
  tied LM head, which vLLM's reload misses: ``_reprocess_embeddings``).

The call returns once the worker has loaded the bucket (the HTTP route awaits the
engine core's collective RPC), so the trainer side may then delete the file.

This module is imported only inside the vLLM server's processes (its venv,
``.venv-vllm``, holds rlpipe installed without dependencies); rlpipe's own process
never imports vLLM.

Left out: multi-rank workers (tensor parallel) — one worker reads every bucket —
and draft-model updates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "rlpipe_shm"  # the --weight-transfer-config backend name (repeated in vllm_server.py)


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the files are named per update."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: a file of packed tensor bytes and where each tensor lives in it."""

    path: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.dtype_names) == len(self.shapes) == len(self.offsets) == len(self.nbytes) == n):
            raise ValueError("names, dtype_names, shapes, offsets and nbytes must have the same length")
        if not os.path.isfile(self.path):
            raise ValueError(f"weight bucket file {self.path!r} does not exist (written by the trainer side?)")


class SharedMemoryWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Worker side of the ``rlpipe_shm`` backend (see the module docstring)."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        """No data-plane rendezvous is needed."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._reprocess_embeddings()

    def _reprocess_embeddings(self) -> None:
        """Redo the CPU GEMM dispatch of every (unquantized) embedding / LM head.

        vLLM's layerwise reload processes a tied parameter for one of its layers only
        (limitation 2 in vllm/model_executor/model_loader/reload/__init__.py). With tied
        embeddings the LM head is the other layer: its weight storage receives the new
        values, but on CPU its matmul runs through a oneDNN handle packed from the old
        weight at load time (vllm/model_executor/layers/utils.py
        ``dispatch_cpu_unquantized_gemm``), so logits would keep the old LM head. Embedding
        processing keeps the weight (``remove_weight=False``), so redoing it is safe.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        for module in self.model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod) and not module.weight.is_meta:
                method.process_weights_after_loading(module)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(); loading on CPU is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        size = os.path.getsize(update_info.path)
        flat = torch.from_file(update_info.path, shared=True, size=size, dtype=torch.uint8)
        weights = []
        for name, dtype_name, shape, offset, nbytes in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets, update_info.nbytes
        ):
            dtype = getattr(torch, dtype_name)
            weights.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
        self.model.load_weights(weights)

    def shutdown(self) -> None:
        """Nothing held between updates."""


def register() -> None:
    """vLLM plugin entry point (``vllm.general_plugins``); vLLM may call it several times per process.

    Besides registering the backend, it makes every vLLM process of a server rlpipe started
    (``RLPIPE_VLLM_DIE_WITH_PARENT=1``: API server, engine core, worker) die with its parent,
    so the chain rlpipe → API server → engine core → worker unwinds when rlpipe dies
    without closing the engine (vLLM's engine core outlives a killed API server otherwise).
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if os.environ.get("RLPIPE_VLLM_DIE_WITH_PARENT") == "1":
        from rlpipe.inference.vllm_server import die_with_parent

        die_with_parent()

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, SharedMemoryWeightTransferEngine)
