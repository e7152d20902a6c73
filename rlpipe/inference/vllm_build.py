"""Building a :class:`~rlpipe.inference.vllm_engine.VLLMEngine` for a rollout replica: on a vLLM server
it starts and owns, or attached to one that already runs (``server.urls``).

Kept apart from :mod:`rlpipe.inference.vllm_engine`, the client of a running server: everything here
happens once, before the first request (writing the policy out, the context length, the checks that an
attached server serves a model of the policy's shapes and a long enough context, the first push).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from rlpipe.inference import vllm_lora
from rlpipe.inference.contract import EngineError
from rlpipe.inference.vllm_engine import VLLMEngine, _ParamSpec
from rlpipe.inference.vllm_server import AttachedVLLMServer, VLLMParams, VLLMServer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["build_vllm_engine", "with_context_length"]


def build_vllm_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                      params: VLLMParams | Mapping[str, Any] | None, rank: int, workdir: str | Path,
                      version: int = 0, lora: Any = None, mode_params: Any = None) -> VLLMEngine:
    """Start a vLLM server for replica ``rank`` serving ``model`` and return the engine that owns it.

    ``model`` and ``tokenizer`` are written to ``<workdir>/vllm-<rank>/model`` (``save_pretrained``);
    the server's log is ``<workdir>/vllm-<rank>/vllm-<rank>-server.log``. ``params`` is a
    :class:`VLLMParams` (or its dict). The caller owns the engine: ``close()`` stops the server.
    ``lora`` (``trainer.lora``): the server serves adapters (``--enable-lora``, as many slots as ``params.max_loras``
    or the mode of ``mode_params`` needs) and pushes carry adapters only, written under
    ``<workdir>/vllm-<rank>/adapters`` (:mod:`rlpipe.inference.vllm_lora`).
    """
    from rlpipe.backends.model import save_hf_model  # transformers: lazy, like the embedded engine

    params = params if isinstance(params, VLLMParams) else VLLMParams(**dict(params or {}))
    name = f"vllm-{rank}"
    specs = {n: _ParamSpec(p.shape, p.dtype) for n, p in model.named_parameters()}
    root = Path(workdir) / name
    server_lora = vllm_lora.server_lora(lora, params.max_loras, mode_params) if lora is not None else None
    if params.urls:
        return _attach(model, tokenizer, params, rank, name, specs, version, root, lora, server_lora)
    model_dir = save_hf_model(model, tokenizer, root / "model")
    params = with_context_length(params, model)
    max_len = params.max_model_len
    server = VLLMServer(model_dir, root, params, name=name, lora=server_lora)
    try:
        return VLLMEngine(server, specs, tokenizer.eos_token_id, max_len, version=version,
                          max_concurrency=params.max_concurrency,
                          adapters=_adapters(server, model, lora, server_lora, root))
    except BaseException:
        server.close()
        raise


def _adapters(server: VLLMServer, model: PreTrainedModel, lora: Any, server_lora: vllm_lora.ServerLoRA | None,
              root: Path) -> vllm_lora.VLLMAdapters | None:
    """The engine's adapter bookkeeping with ``trainer.lora`` (None without)."""
    if lora is None:
        return None
    from rlpipe.backends.lora import adapter_holder, targets

    holder = adapter_holder(model, targets(model, lora.target_modules), lora.rank)
    return vllm_lora.VLLMAdapters(server, holder, lora, root / "adapters", server_lora.slots,
                                  getattr(model.config, "_name_or_path", None) or None)


def with_context_length(params: VLLMParams, model: PreTrainedModel) -> VLLMParams:
    """``params`` with ``max_model_len`` set: as given, else the model's ``max_position_embeddings``."""
    if params.max_model_len is not None:
        return params
    return params.model_copy(update={"max_model_len": int(model.config.max_position_embeddings)})


def _attach(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, params: VLLMParams, rank: int, name: str,
            specs: Mapping[str, _ParamSpec], version: int, root: Path, lora: Any = None,
            server_lora: vllm_lora.ServerLoRA | None = None) -> VLLMEngine:
    """An engine on the running server ``params.urls[rank]``, holding ``model``'s weights as ``version``.

    The server's context length is read from ``/v1/models``; a shorter one than ``params.max_model_len`` (or the
    model's positions) is refused, and so is a model of other shapes (its ``config.json``, before any push; where
    that file cannot be read, the push fails, naming the server)."""
    from rlpipe.backends.weights import export_buckets

    if rank >= len(params.urls):
        raise EngineError(f"rollout replica {rank} has no server: generate.params.server.urls names "
                          f"{len(params.urls)}; give one address per replica")
    server = AttachedVLLMServer(params.urls[rank], params, name=name)
    served = ((server.request("GET", "/v1/models", timeout=30) or {}).get("data") or [{}])[0]
    served_len = int(served.get("max_model_len") or 0)
    _check_served_shapes(name, server.url, served.get("root"), model.config.to_dict())
    wanted = with_context_length(params, model).max_model_len
    if served_len and served_len < wanted:
        raise EngineError(f"{name}: the vLLM server at {server.url} serves {served_len} tokens of context, "
                          f"the pipeline needs {wanted}; start it with a longer --max-model-len or lower "
                          "generate.params.server.max_model_len")
    engine = VLLMEngine(server, specs, tokenizer.eos_token_id, min(wanted, served_len or wanted), version=version,
                        max_concurrency=params.max_concurrency,
                        adapters=_adapters(server, model, lora, server_lora, root))
    try:
        engine.load_weights(export_buckets(model), version)
    except EngineError as exc:
        engine.close()
        raise EngineError(f"{name}: the vLLM server at {server.url} did not take this pipeline's weights; does it "
                          f"serve a model of the same shapes? ({exc})") from exc
    return engine


_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def _check_served_shapes(name: str, url: str, root: str | None, ours: Mapping[str, Any]) -> None:
    """Refuse a server whose model (its ``config.json``, read from the folder it serves) has other shapes than
    ``ours``, before any push: a push of wrong shapes would fail half-way inside the server."""
    try:
        theirs = json.loads((Path(str(root)) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return  # not readable from here (another file system): the push's own checks are left
    for key in _SHAPE_KEYS:
        if key in ours and key in theirs and ours[key] != theirs[key]:
            raise EngineError(f"{name}: the vLLM server at {url} serves a model with {key}={theirs[key]!r}, the "
                              f"pipeline's has {ours[key]!r}; start it for this pipeline (rlpipe vllm-serve)")
