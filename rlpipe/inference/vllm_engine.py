"""The vLLM rollout engine: rlpipe's engine contract over a vLLM server that rlpipe starts and owns,
or one that already runs (``server.urls``).

:func:`~rlpipe.inference.vllm_build.build_vllm_engine` writes the policy to a directory,
starts one vLLM 0.32 server on it (:class:`~rlpipe.inference.vllm_server.VLLMServer`) and
returns a :class:`VLLMEngine`, a client that keeps the contract of
:class:`~rlpipe.inference.contract.RolloutEngine` (the same as the embedded engine's).
With ``urls`` it attaches instead: the server's model (its ``config.json``, read from the
folder ``/v1/models`` names) must have the policy's shapes and its context must be long
enough; the policy's weights are pushed as version 0 before the first request, and
``close()`` leaves the server running.

Tokens in, tokens out: every request goes to ``POST /inference/v1/generate``
(vLLM's "scale-out" tokens-in/tokens-out route, ``--enable-scale-out``;
vllm/entrypoints/scale_out/token_in_token_out/{api_router,protocol,serving}.py) with
``token_ids`` = prompt (+ partial response of a resumed request) and
``sampling_params`` {max_tokens, temperature, top_p, top_k, seed, ignore_eos,
stop_token_ids, logprobs=0, detokenize=false}; the answer's
``choices[0].token_ids``, ``logprobs.content[i].logprob`` (the processed
distribution's: ``--logprobs-mode processed_logprobs``) and ``weight_versions``
(spans of output tokens per weight version, vllm/outputs.py ``WeightVersionSpan``)
become the result. Nothing is re-tokenized. Each request is one blocking HTTP
call on a small thread pool; ``step()`` waits on a condition (at most
``_STEP_WAIT_S``) for calls that complete, so the rollout service's loop does not spin.

Seeds: vLLM seeds a per-request generator from ``sampling_params.seed``; we pass
``stream_key(seed, request_id/partial length)``, so a request's tokens depend on
its seed, id and the weights (and, as in any batched engine, float rounding of
the batch it shares). Two differences from the embedded engine: its streams and
vLLM's differ (the same seed gives different tokens), and a resumed request draws
from a fresh stream (vLLM's generator cannot be rewound to a position), so an abort
and resume without a push does not redraw the tokens an uninterrupted run would.

Abort: ``POST /abort_requests`` with an empty body aborts everything the server
tracks without pausing it (vllm/entrypoints/rl/online/api_router.py); vLLM then
finishes each open generate call with ``finish_reason="abort"`` and the tokens
sampled so far (the output processor's final abort output,
vllm/v1/engine/output_processor.py ``abort_requests``), so no streaming is
needed. Calls still in transit when the abort arrives are aborted again until
none is open.

Weights (``load_weights``): buckets are checked (checksum, names, shapes,
dtypes, full coverage) before anything is sent; each bucket's bytes go to one
file in ``/dev/shm`` (``transport_s``); ``/pause?mode=keep`` (unless asleep),
``/start_weight_update``, one
``/update_weights`` per bucket through rlpipe's ``rlpipe_shm`` weight-transfer
backend (:mod:`rlpipe.inference.vllm_weight_transfer`; vLLM's own ``ipc`` backend
is CUDA IPC only), ``/finish_weight_update`` and ``/update_weight_version``
and ``/resume`` (``load_s``); ``/reset_prefix_cache`` (``cache_reset_s``). The server stamps tokens
with the version string it holds; those stamps become ``versions``.

Sleep: ``/sleep`` (level 1, or 2 with ``discard_weights``) and ``/wake_up``. vLLM's
CPU worker releases no memory on sleep (vllm/v1/worker/cpu_worker.py ``sleep`` only
logs "not supported on CPU"), so on CPU sleep pauses the server and frees nothing;
with ``discard_weights`` the engine still refuses to generate until the next push,
as the contract says.

Failures: an error of any call (an HTTP error, a dead server) is raised by the
next ``step()`` / ``abort_all()`` and the engine stays failed (build a new one);
``step()`` and ``health()`` check the server process on every call, and their
errors name the replica and the server's log file.

Checked against the real server (tests/inference/test_vllm.py): returned logprobs
equal a transformers forward of the trainer's weights to 1e-4 before and after a
push; aborted requests return partial tokens and resume across a push with both
versions; a push resets the prefix cache (vLLM's ``vllm:prefix_cache_hits_total``);
the rollout service drives the engine; a killed server is reported and leaves no
process behind.

LoRA (``trainer.lora``, :mod:`rlpipe.inference.vllm_lora`): the base goes to the server once; an adapter push is
written as a peft folder and loaded under a name per version, a request runs on the newest adapter and keeps it
(and its version stamp) until it ends or is aborted, so an adapter push is taken with requests in flight; a
whole-model push still needs the server quiet.

Left out: tensor/data parallel servers (one process, one worker), stop
strings, multimodal inputs, streaming (not needed: aborted calls return their
partial tokens), and vLLM's pause/resume routes (a whole-model ``load_weights`` is
refused while requests are in flight, so nothing runs during such a push). An idle server's
worker still polls its queue (about a fifth of a core).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from rlpipe.backends.lora import is_adapter
from rlpipe.backends.weights import WeightBucket, WeightTransportError, _check as check_bucket
from rlpipe.inference import sampling
from rlpipe.inference.contract import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    check_new_requests,
    make_result,
    validate_request,
)
from rlpipe.inference.vllm_lora import VLLMAdapters
from rlpipe.inference.vllm_server import AttachedVLLMServer, VLLMParams, VLLMServer

__all__ = ["VLLMEngine", "VLLMParams"]

_STEP_WAIT_S = 0.02  # step() waits at most this long for a completion
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _ParamSpec:
    """Shape and dtype of one parameter of the served model (what weights._check reads)."""

    def __init__(self, shape: Sequence[int], dtype: Any):
        self.shape, self.dtype = tuple(shape), dtype


class VLLMEngine(RolloutEngine):
    """Client of one vLLM server: one it owns (``close()`` stops it) or one it attached to (left running)."""

    def __init__(self, server: VLLMServer, params: Mapping[str, _ParamSpec], eos_id: int, max_model_len: int,
                 version: int = 0, max_concurrency: int = 64, adapters: VLLMAdapters | None = None):
        self.server = server
        self.adapters = adapters
        """With trainer.lora: the adapters on the server (pushes carry only them; see the module docstring)."""
        self.name = server.name
        self.version = version
        self.eos_id = int(eos_id)
        self.max_model_len = int(max_model_len)
        self._params = dict(params)
        self._cond = threading.Condition()
        self._waiting: list[GenerationRequest] = []  # ready_at not reached; not sent yet
        self._inflight: dict[str, tuple[GenerationRequest, Future]] = {}
        self._done: list[GenerationResult] = []
        self._error: EngineError | None = None
        self._asleep = False
        self._discarded = False
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix=f"{self.name}-http")
        self._closed = False
        self.server.request("POST", "/init_weight_transfer_engine", {"init_info": {}})
        self.server.request("POST", "/update_weight_version", {"new_version": str(version)})

    # -- requests -------------------------------------------------------------------

    def submit(self, requests: Iterable[GenerationRequest]) -> None:
        """Queue requests; ready ones go to the server at once, the others at their ``ready_at``."""
        self._check_ready()
        requests = list(requests)
        with self._cond:
            self._raise_error()
            check_new_requests(requests, set(self._inflight) | {r.request_id for r in self._waiting}, self._validate)
            for request in requests:
                if len(request.response_ids) >= request.max_tokens:
                    self._done.append(make_result(request, (), (), self.version, "length"))
                elif len(request.response_ids) and int(request.response_ids[-1]) in (self.eos_id, *request.sampling.stop_token_ids) \
                        and not request.sampling.ignore_eos:
                    self._done.append(make_result(request, (), (), self.version, "stop"))
                elif request.ready_at > time.monotonic():
                    self._waiting.append(request)
                else:
                    self._send(request)

    def step(self) -> list[GenerationResult]:
        """Send requests whose ``ready_at`` came; return those that finished (waiting briefly for one)."""
        with self._cond:
            self._release_ready()
            if not self._done and (self._inflight or self._waiting):
                self._cond.wait(min(_STEP_WAIT_S, max(self.next_ready_in(), 0.001)))
                self._release_ready()
            self._raise_error()
            self.server.check_alive()  # a dead server is reported even with nothing in flight
            done, self._done = self._done, []
            return done

    def _keep_for_next_step(self, results: list[GenerationResult]) -> None:
        with self._cond:
            self._done.extend(results)

    def abort_all(self) -> list[GenerationResult]:
        """Abort everything on the server; open calls come back with their partial tokens and "abort"."""
        with self._cond:
            aborted = [make_result(r, (), (), self.version, "abort") for r in self._waiting]
            self._waiting = []
            deadline = time.monotonic() + self.server.params.request_timeout_s
            while self._inflight:
                self._cond.release()
                try:  # an empty body aborts every request the server tracks (api_router.py)
                    self.server.request("POST", "/abort_requests", {})
                finally:
                    self._cond.acquire()
                self._cond.wait_for(lambda: not self._inflight, timeout=0.25)
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.name}: {len(self._inflight)} request(s) did not end after abort; "
                                      f"see the vLLM server's log {self.server.log_path}")
            self._raise_error()
            done, self._done = self._done, []
            return done + aborted

    def num_running(self) -> int:
        with self._cond:
            return len(self._inflight) + len(self._waiting)

    def has_active(self) -> bool:
        with self._cond:
            return bool(self._inflight or self._waiting or self._done)

    def num_waiting(self) -> int:
        now = time.monotonic()
        with self._cond:
            return sum(r.ready_at > now for r in self._waiting)

    def next_ready_in(self) -> float:
        with self._cond:
            if self._inflight or self._done or self._error is not None:
                return 0.0
            if not self._waiting:
                return math.inf
            return max(0.0, min(r.ready_at for r in self._waiting) - time.monotonic())

    def _release_ready(self) -> None:
        now = time.monotonic()
        ready = [r for r in self._waiting if r.ready_at <= now]
        if ready:
            self._waiting = [r for r in self._waiting if r.ready_at > now]
            for request in ready:
                self._send(request)

    def _send(self, request: GenerationRequest) -> None:
        """Start the HTTP call of ``request`` (lock held), on the newest adapter when there are adapters: the call
        keeps that adapter, and its tokens that version, to its end."""
        adapter = self.adapters.acquire() if self.adapters is not None else None
        version = self.adapters.newest if adapter is not None else None
        self._inflight[request.request_id] = (request, self._pool.submit(self._call, request, adapter, version))

    def _call(self, request: GenerationRequest, adapter: str | None = None, version: int | None = None) -> None:
        """One generate call on a pool thread; files the result (or the error) under the lock."""
        result = error = None
        try:
            answer = self.server.request("POST", "/inference/v1/generate", self._body(request, adapter))
            result = self._result(request, answer, version)
        except EngineError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - a malformed answer: surface it to the caller of step()
            error = EngineError(f"{self.name}: request {request.request_id!r}: unexpected answer from vLLM: {exc!r}")
        if adapter is not None:
            with self._cond:
                stale = self.adapters.release(version)
            # before the result is filed: once step() returned a version's last request, that version is unloaded
            self._unload(stale)
        with self._cond:
            self._inflight.pop(request.request_id, None)
            if error is None:
                self._done.append(result)
            else:
                self._error = self._error or error
            self._cond.notify_all()

    def _unload(self, stale) -> None:
        """Unload adapters no request uses any more (no lock held: HTTP); a failure fails the next step()."""
        if not stale:
            return
        try:
            self.adapters.unload(stale)
        except EngineError as exc:
            with self._cond:
                self._error = self._error or exc
                self._cond.notify_all()

    def _body(self, r: GenerationRequest, adapter: str | None = None) -> dict[str, Any]:
        s = r.sampling
        sampling_params = {
            "max_tokens": int(r.max_tokens - len(r.response_ids)),
            "temperature": float(s.temperature), "top_p": float(s.top_p), "top_k": int(s.top_k),
            "seed": sampling.stream_key(s.seed, f"{r.request_id}/{len(r.response_ids)}"),
            "ignore_eos": bool(s.ignore_eos), "logprobs": 0, "detokenize": False,
        }
        if not s.ignore_eos:
            sampling_params["stop_token_ids"] = [self.eos_id, *(int(t) for t in s.stop_token_ids)]
        token_ids = [int(t) for t in r.prompt_ids] + [int(t) for t in r.response_ids]
        body = {"request_id": f"{r.request_id}-{uuid.uuid4().hex[:8]}", "token_ids": token_ids,
                "sampling_params": sampling_params}
        if adapter is not None:  # vLLM picks the LoRA adapter by the request's model name
            body["model"] = adapter
        return body

    def _result(self, request: GenerationRequest, answer: dict[str, Any],
                adapter_version: int | None = None) -> GenerationResult:
        choice = answer["choices"][0]
        ids = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            raise EngineError(f"{self.name}: request {request.request_id!r}: vLLM returned {len(ids)} tokens "
                              f"but {len(content)} logprobs")
        versions = np.full(len(ids), self.version if adapter_version is None else adapter_version, np.int32)
        # the server's spans label its base weights; a call on an adapter ran on that adapter's version throughout
        for span in (choice.get("weight_versions") or []) if adapter_version is None else []:
            versions[span["start"]:span["end"]] = _version_number(span["version"], self.version)
        reason = choice.get("finish_reason") or "stop"
        if reason not in ("stop", "length", "abort"):
            raise EngineError(f"{self.name}: request {request.request_id!r}: unknown finish_reason {reason!r}")
        result = make_result(request, ids, [c["logprob"] for c in content], self.version, reason)
        result.versions[len(request.response_ids):] = versions
        return result

    # -- weights and memory ---------------------------------------------------------

    def load_weights(self, buckets: Sequence[WeightBucket], version: int) -> dict[str, float]:
        """Push buckets into the server (checked first), adopt ``version``, reset its prefix cache. With adapters
        (trainer.lora) a push of adapters only is loaded as a new adapter (:meth:`_load_adapter`)."""
        buckets = list(buckets)
        if self.adapters is not None and buckets and all(is_adapter(m.name) for b in buckets for m in b.tensors):
            return self._load_adapter(buckets, version)
        self._check_push(version)
        self._check_buckets(buckets)
        start = time.perf_counter()
        files = [self._write(bucket, i) for i, bucket in enumerate(buckets)]
        written = time.perf_counter()
        # The scheduler is paused around the reload (vLLM's /pause, mode keep): between start and finish the
        # model is half old, half new, and a request that reached the server after the caller's abort (another
        # client of an attached server, a call still in transit) must not be decoded on it. Asleep, it is
        # paused already, and a /resume would wake its scheduler.
        paused = not self._asleep
        try:
            if paused:
                self.server.request("POST", "/pause?mode=keep&clear_cache=false")
            self.server.request("POST", "/start_weight_update")
            for path, bucket in zip(files, buckets):
                self.server.request("POST", "/update_weights", {"update_info": _update_info(path, bucket)})
            self.server.request("POST", "/finish_weight_update", {"weight_version": str(version)})
            self.server.request("POST", "/update_weight_version", {"new_version": str(version)})
        except BaseException:
            if paused:
                with contextlib.suppress(EngineError):  # a dead server: the original error says so
                    self.server.request("POST", "/resume")
            raise
        else:
            if paused:
                self.server.request("POST", "/resume")
        finally:
            for path in files:
                path.unlink(missing_ok=True)
        loaded = time.perf_counter()
        self.version = version
        self._discarded = False
        if self.adapters is not None:  # new base weights: the adapters were trained on the old ones
            with self._cond:
                stale = self.adapters.forget()
            self.adapters.unload(stale)
        self.reset_prefix_cache()
        return {"transport_s": written - start, "load_s": loaded - written,
                "cache_reset_s": time.perf_counter() - loaded, "bytes": float(sum(b.nbytes for b in buckets))}

    def _load_adapter(self, buckets: list[WeightBucket], version: int) -> dict[str, float]:
        """An adapter push: write it as a peft folder, load it under its version's name, send new requests to it.
        Requests in flight keep their adapter (so it is not refused while they run, unlike a whole-model push);
        the prefix cache needs no reset (vLLM's block hashes include the adapter's name)."""
        if version < self.version:
            raise EngineError(f"weight version {version} is older than the engine's {self.version}; versions only grow")
        with self._cond:
            self.adapters.check_room(version)
        start = time.perf_counter()
        folder = self.adapters.write(buckets, version)
        written = time.perf_counter()
        self.adapters.load(version, folder)
        with self._cond:
            self.version = version
            self._discarded = False
            stale = self.adapters.adopt(version, folder)
        self.adapters.unload(stale)
        return {"transport_s": written - start, "load_s": time.perf_counter() - written, "cache_reset_s": 0.0,
                "bytes": float(sum(b.nbytes for b in buckets))}

    def _check_buckets(self, buckets: list[WeightBucket]) -> None:
        try:
            for bucket in buckets:
                check_bucket(bucket, self._params)
        except WeightTransportError as exc:
            raise EngineError(f"{self.name}: {exc}") from exc
        names = [m.name for b in buckets for m in b.tensors]
        if len(set(names)) != len(names):
            raise EngineError("a weight push holds some tensor twice; export each parameter once")
        missing = sorted(set(self._params) - set(names))
        if missing:
            raise EngineError(f"a weight push to vLLM must hold every parameter; it misses {len(missing)}, "
                              f"e.g. {missing[:3]}")

    def _write(self, bucket: WeightBucket, index: int) -> Path:
        path = Path(_SHM_DIR) / f"rlpipe-{self.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{index}.bin"
        np.ascontiguousarray(bucket.data, dtype=np.uint8).tofile(path)
        return path

    def reset_prefix_cache(self) -> None:
        """``/reset_prefix_cache``; vLLM refuses while blocks are held, so retry briefly."""
        for _ in range(50):
            if (self.server.request("POST", "/reset_prefix_cache") or {}).get("success"):
                return
            time.sleep(0.1)
        raise EngineError(f"{self.name}: vLLM did not reset its prefix cache (blocks still held); "
                          f"see {self.server.log_path}")

    def sleep(self, discard_weights: bool = False) -> None:
        """``/sleep``: pauses the server; on CPU vLLM frees no memory (see the module docstring). With adapters the
        base is kept (level 1): an adapter push could not bring discarded base weights back."""
        if self.num_running():
            raise EngineError("abort or finish in-flight requests before sleep()")
        level = 2 if discard_weights and self.adapters is None else 1
        self.server.request("POST", f"/sleep?level={level}")
        self._asleep = True
        self._discarded = self._discarded or discard_weights

    def wake(self) -> None:
        """``/wake_up``; discarded weights stay unusable until ``load_weights``."""
        self.server.request("POST", "/wake_up")
        self._asleep = False

    @property
    def asleep(self) -> bool:
        return self._asleep

    def health(self) -> dict[str, Any]:
        """The server process is alive and answers /health; else EngineError naming its log."""
        self.server.check_alive()
        self.server.request("GET", "/health", timeout=10)
        return {"version": self.version, "running": self.num_running(), "pid": self.server.pid,
                "url": self.server.url, "log": str(self.server.log_path)}

    def close(self) -> None:
        """Stop the HTTP pool and kill the server (its whole process group); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.adapters is not None:  # a server we started dies with its adapters; an attached one outlives us
            self.adapters.close(unload=isinstance(self.server, AttachedVLLMServer))
        self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_ready(self) -> None:
        if self._closed:
            raise EngineError(f"{self.name}: the vLLM engine was closed")
        if self._asleep:
            raise EngineError("the rollout engine is asleep; call wake() before generating")
        if self._discarded:
            raise EngineError("the engine's weights were discarded by sleep(); push weights (load_weights) first")

    def _raise_error(self) -> None:
        if self._error is not None:
            error = self._error
            try:
                self.server.check_alive()
            except EngineError as dead:
                error = dead
            raise error

    def _validate(self, r: GenerationRequest) -> None:
        validate_request(r, self.max_model_len, "the vLLM server's max_model_len")


def _version_number(label: str, default: int) -> int:
    try:
        return int(label)
    except ValueError:  # "default": no version was set on the server
        return default


def _update_info(path: Path, bucket: WeightBucket) -> dict[str, Any]:
    """The ``rlpipe_shm`` backend's update info (vllm_weight_transfer.ShmUpdateInfo) for one bucket."""
    return {"path": str(path), "names": [m.name for m in bucket.tensors],
            "dtype_names": [m.dtype for m in bucket.tensors], "shapes": [list(m.shape) for m in bucket.tensors],
            "offsets": [m.offset for m in bucket.tensors], "nbytes": [m.nbytes for m in bucket.tensors]}
