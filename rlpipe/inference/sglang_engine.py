"""A client of SGLang's native HTTP API behind rlpipe's engine contract.

:class:`SGLangEngine` is a :class:`~rlpipe.inference.contract.RolloutEngine`
talking to one server: real SGLang (``python -m sglang.launch_server``, checked
against sglang 0.5.23) or rlpipe's embedded engine behind the same protocol
(:mod:`rlpipe.inference.sglang_server`), launched here as a child process or
reached at ``url``.

- ``submit`` posts each request to ``/generate`` from a small thread pool
  (``input_ids``, ``rid`` = request id, ``sampling_params``, ``return_logprob``);
  a request with ``ready_at`` in the future is held here until then. ``step``
  waits on a condition (``step_wait_s``) for results instead of spinning, so
  the rollout service's loop can call it back to back.
- A resumed request sends prompt + partial response as ``input_ids`` and the
  remaining budget as ``max_new_tokens``; per-token versions come from
  ``meta_info.weight_versions`` spans (else ``meta_info.weight_version``),
  parsed as the integer policy versions this client labels every push with.
- ``abort_all`` posts ``/abort_request {abort_all: true}`` (repeated until every
  in-flight call has answered, so a request still on the wire is caught too) and
  returns each SGLang partial as ``finish_reason="abort"``; it never raises.
- ``load_weights``: ``/update_weights_from_tensor`` (``load_format="rlpipe_buckets"``,
  embedded server only; inside the ``/begin_weight_update`` .. ``/end_weight_update``
  session sglang 0.5.23 requires, skipped on servers without those routes) or
  ``/update_weights_from_disk`` (a safetensors checkpoint; works with real SGLang),
  then ``/flush_cache``; ``weight_version`` = the pushed policy version. A push of
  no buckets only relabels (``/update_weight_version``).
- ``sleep`` / ``wake``: ``/release_memory_occupation`` / ``/resume_memory_occupation``.

Left out: SGLang's pickled-tensor weight path (CUDA IPC handles; no GPU here),
NCCL weight groups (``/init_weights_update_group``), streaming, and routing
across several servers (one client per server).
"""

from __future__ import annotations

import logging
import math
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlpipe.inference import json_http, sglang_launch, sglang_wire
from rlpipe.inference.contract import (
    EngineError, GenerationRequest, GenerationResult, RolloutEngine, check_new_requests, validate_request,
)

log = logging.getLogger(__name__)


class SGLangParams(BaseModel):
    """How to reach (or start) an SGLang-protocol server and how to talk to it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    server: Literal["sglang", "embedded"] = "embedded"
    """Which server to launch when ``url`` is not given: real SGLang (``python -m sglang.launch_server``;
    needs a GPU and its own environment) or rlpipe's embedded engine behind SGLang's protocol."""
    url: str | None = None
    """Base URL of an already running server (e.g. ``http://127.0.0.1:30000``); nothing is launched."""
    model_path: str | None = None
    """Local Hugging Face model directory the launched server loads (and the disk weight path copies
    its config and tokenizer files from). Required unless ``url`` is given."""
    python: str | None = None
    """Interpreter that launches the server; defaults to this one. Real SGLang cannot share rlpipe's CPU
    venv (it installs a CUDA torch), so point this at SGLang's environment."""
    launch_args: list[str] = []
    """Extra command-line flags for the launched server (e.g. ``["--mem-fraction-static", "0.5"]``; real SGLang
    needs ``--enable-memory-saver`` for sleep/wake)."""
    log_dir: str | None = None
    """Where the launched server's log goes; defaults to a fresh temporary directory."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long a launched server may take to answer ``/health``."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one ``/generate`` call (a whole response)."""
    control_timeout_s: float = Field(60.0, gt=0)
    """Timeout of every other call (abort, weights, memory, health, model info)."""
    max_concurrency: int = Field(64, ge=1)
    """Requests in flight at once (threads posting ``/generate``); more wait in the client."""
    step_wait_s: float = Field(0.02, gt=0, le=1.0)
    """How long ``step()`` waits for a result before returning an empty list."""
    weight_transport: Literal["shm", "inline", "disk"] = "shm"
    """How ``load_weights`` ships buckets: ``shm`` (files in /dev/shm, same host, embedded server),
    ``inline`` (bytes in the request, embedded server anywhere) or ``disk`` (a safetensors checkpoint
    through /update_weights_from_disk; the one real SGLang reads)."""
    version: int = Field(0, ge=0)
    """Policy version of the server's initial weights (a launched server is told it)."""

    @model_validator(mode="after")
    def _consistent(self) -> "SGLangParams":
        if self.server == "sglang" and self.weight_transport != "disk":
            raise ValueError("real SGLang reads weights from tensors only as pickled CUDA IPC handles; "
                             "use weight_transport: disk with server: sglang")
        return self


@dataclass
class _Flight:
    request: GenerationRequest
    cancelled: bool = False


class SGLangEngine(RolloutEngine):
    """Rollout engine client of one SGLang-protocol server (launched here unless ``params.url`` is given)."""

    def __init__(self, params: SGLangParams):
        if params.url is None and params.model_path is None:
            raise EngineError("SGLang engine: set `url` (a running SGLang-protocol server) or `model_path` (a local "
                              "HF model directory to launch one on)")
        if params.weight_transport == "disk" and params.model_path is None:
            raise EngineError("SGLang engine: weight_transport: disk copies the model's config from `model_path`; "
                              "set it")
        self.params = params
        self.version = params.version
        self._cond = threading.Condition()
        self._flights: dict[str, _Flight] = {}  # posted or queued in the pool
        self._held: list[GenerationRequest] = []  # waiting for ready_at
        self._done: list[GenerationResult] = []
        self._errors: list[EngineError] = []
        self._asleep = False
        self._released_tags: list[str] | None = None
        self._closed = False
        self._process: sglang_launch.ServerProcess | None = None
        if params.url is None:
            self._process = self._launch()
            self.url = self._process.url
        else:
            self.url = params.url.rstrip("/")
        self._pool = ThreadPoolExecutor(params.max_concurrency, thread_name_prefix="sglang-client")
        if params.url is not None:
            self.health()

    def _launch(self) -> sglang_launch.ServerProcess:
        p = self.params
        port = sglang_launch.free_port()
        build = sglang_launch.sglang_command if p.server == "sglang" else sglang_launch.embedded_command
        command = build(p.model_path, port, str(p.version), python=p.python, extra=p.launch_args)
        log_dir = Path(p.log_dir or tempfile.mkdtemp(prefix="rlpipe-sglang-"))
        return sglang_launch.launch(command, f"http://127.0.0.1:{port}", log_dir / f"{p.server}-{port}.log",
                                    p.startup_timeout_s)

    # -- HTTP ------------------------------------------------------------------------

    def _call(self, endpoint: str, body: dict | None = None, timeout: float | None = None,
              method: str = "POST") -> Any:
        """One call; its JSON answer (or text). Any failure is an EngineError naming URL, endpoint and message."""
        hint = f" (see its log {self._process.log_path})" if self._process is not None else ""
        return json_http.call(self.url, endpoint, body, timeout or self.params.control_timeout_s, method,
                              "SGLang server", hint)

    # -- requests --------------------------------------------------------------------

    def submit(self, requests: Iterable[GenerationRequest]) -> None:
        """Validate all, then post the ready ones and hold the others until their ``ready_at``."""
        self._check_usable()
        requests = list(requests)
        with self._cond:
            check_new_requests(requests, set(self._flights) | {r.request_id for r in self._held}, _validate)
            now = time.monotonic()
            for r in requests:
                if len(r.response_ids) >= r.max_tokens:
                    self._done.append(_result(r, [], [], [], "length"))
                elif r.ready_at > now:
                    self._held.append(r)
                else:
                    self._post(r)
            self._cond.notify_all()

    def _post(self, request: GenerationRequest) -> None:  # under self._cond
        self._flights[request.request_id] = flight = _Flight(request)
        self._pool.submit(self._generate, flight)

    def _generate(self, flight: _Flight) -> None:
        """Pool thread: one /generate call; files its result (or its error) for step()."""
        r = flight.request
        with self._cond:
            if flight.cancelled:  # aborted before it was posted
                self._flights.pop(r.request_id, None)
                self._done.append(_result(r, [], [], [], "abort"))
                self._cond.notify_all()
                return
        s, resumed = r.sampling, len(r.response_ids)
        sampling = {"max_new_tokens": r.max_tokens - resumed, "temperature": s.temperature, "top_p": s.top_p,
                    "top_k": s.top_k if s.top_k > 0 else -1, "ignore_eos": s.ignore_eos, "sampling_seed": s.seed}
        if s.stop_token_ids:
            sampling["stop_token_ids"] = [int(t) for t in s.stop_token_ids]
        if resumed:
            sampling["custom_params"] = {sglang_wire.RESUME_KEY: resumed}  # real SGLang ignores it (no custom logit processor)
        body = {"rid": r.request_id, "input_ids": [int(t) for t in (*r.prompt_ids, *r.response_ids)],
                "sampling_params": sampling, "return_logprob": True}
        try:
            out = self._call("/generate", body, timeout=self.params.request_timeout_s)
            result = self._parse(r, out)
        except EngineError as exc:
            result, error = None, exc
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            result, error = None, EngineError(f"SGLang server {self.url}/generate answered for {r.request_id!r} "
                                              f"without the expected meta_info ({type(exc).__name__}: {exc})")
        with self._cond:
            if self._flights.pop(r.request_id, None) is None:
                return  # given up on by abort_all
            if result is not None:
                self._done.append(result)
            elif flight.cancelled:
                self._done.append(_result(r, [], [], [], "abort"))
            else:
                self._errors.append(error)
            self._cond.notify_all()

    def _parse(self, request: GenerationRequest, out: dict) -> GenerationResult:
        meta = out["meta_info"]
        triples = meta["output_token_logprobs"]
        ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
        versions = np.full(len(ids), self._as_version(meta.get("weight_version")), np.int32)
        for span in meta.get("weight_versions") or ():
            versions[span["start"]: span["end"]] = self._as_version(span["version"])
        reason = meta["finish_reason"]["type"] if meta.get("finish_reason") else "abort"
        if reason not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish_reason type {reason!r}")
        return _result(request, ids, logprobs, versions, reason)

    def _as_version(self, label: Any) -> int:
        """This client labels every push with its integer policy version; anything else is the current one."""
        try:
            return int(label)
        except (TypeError, ValueError):
            return self.version

    def step(self) -> list[GenerationResult]:
        """Post held requests that became ready; wait up to ``step_wait_s`` for results; return them."""
        with self._cond:
            self._release_ready()
            if not self._done and not self._errors:
                wait = self.params.step_wait_s
                if self._held and not self._flights:
                    wait = min(wait, max(0.0, min(r.ready_at for r in self._held) - time.monotonic()))
                self._cond.wait(wait)
                self._release_ready()
            if self._errors:
                error, self._errors = self._errors[0], self._errors[1:]
                raise error
            done, self._done = self._done, []
            return done

    def _release_ready(self) -> None:  # under self._cond
        if self._held:
            now = time.monotonic()
            for r in [r for r in self._held if r.ready_at <= now]:
                self._held.remove(r)
                self._post(r)

    def _keep_for_next_step(self, results: list[GenerationResult]) -> None:
        with self._cond:
            self._done.extend(results)

    def abort_all(self) -> list[GenerationResult]:
        """Abort everything; partials come back with ``"abort"``. Never raises: a server that does not answer
        within ``control_timeout_s`` leaves its requests with no new tokens."""
        with self._cond:
            held, self._held = self._held, []
            for flight in self._flights.values():
                flight.cancelled = True
            pending = bool(self._flights)
        deadline = time.monotonic() + self.params.control_timeout_s
        while pending:
            try:
                self._call("/abort_request", {"abort_all": True, "rid": ""},
                           timeout=max(0.5, deadline - time.monotonic()))
            except EngineError as exc:
                log.warning("abort_all: %s", exc)
            with self._cond:
                self._cond.wait_for(lambda: not self._flights, timeout=min(0.05, max(0.0, deadline - time.monotonic())))
                pending = bool(self._flights)
                if pending and time.monotonic() > deadline:
                    log.warning("abort_all: %d request(s) did not come back from %s within %.0f s; returning them "
                                "without new tokens", len(self._flights), self.url, self.params.control_timeout_s)
                    self._done.extend(_result(f.request, [], [], [], "abort") for f in self._flights.values())
                    self._flights.clear()
                    pending = False
        with self._cond:
            done, self._done, self._errors = self._done, [], []
        return done + [_result(r, [], [], [], "abort") for r in held]

    def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "in_place") -> None:
        """``/pause_generation``: the server stops decoding (``abort`` also aborts what runs; its partials
        come back through ``step()``). Requests submitted meanwhile wait for ``continue_generation``."""
        self._call("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        """``/continue_generation``: undo ``pause_generation``."""
        self._call("/continue_generation", {})

    def num_running(self) -> int:
        with self._cond:
            return len(self._flights) + len(self._held)

    def has_active(self) -> bool:
        with self._cond:
            return bool(self._flights or self._held or self._done or self._errors)

    def num_waiting(self) -> int:
        now = time.monotonic()
        with self._cond:
            return sum(r.ready_at > now for r in self._held)

    def next_ready_in(self) -> float:
        with self._cond:
            if self._flights or self._done or self._errors:
                return 0.0
            if not self._held:
                return math.inf
            return max(0.0, min(r.ready_at for r in self._held) - time.monotonic())

    # -- weights and memory ----------------------------------------------------------

    def load_weights(self, buckets: Sequence[Any], version: int) -> dict[str, float]:
        """Ship ``buckets`` (see ``weight_transport``), label them ``version``, flush the server's cache."""
        self._check_push(version)
        buckets = list(buckets)
        timings = {"bytes": float(sum(b.nbytes for b in buckets))}
        if not buckets:
            self._call("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
            self.version = version
            return timings
        start = time.perf_counter()
        transport = self.params.weight_transport
        files: list[str] = []
        scratch = None
        try:
            if transport == "disk":
                scratch = tempfile.TemporaryDirectory(prefix="rlpipe-weights-")
                path = sglang_wire.write_checkpoint(buckets, self.params.model_path, scratch.name)
                staged = time.perf_counter()
                self._call("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version),
                                                         "flush_cache": False})
            else:
                serialized, files = sglang_wire.encode_buckets(buckets, transport)
                staged = time.perf_counter()
                session = self._begin_update()
                try:
                    self._call("/update_weights_from_tensor", {
                        "serialized_named_tensors": serialized, "load_format": sglang_wire.LOAD_FORMAT,
                        "flush_cache": False, "weight_version": str(version)})
                finally:
                    if session:
                        self._call("/end_weight_update", {})
            loaded = time.perf_counter()
        finally:
            sglang_wire.remove_files(files)
            if scratch is not None:
                scratch.cleanup()
        self.version = version
        self.reset_prefix_cache()
        timings.update(transport_s=staged - start, load_s=loaded - staged, cache_reset_s=time.perf_counter() - loaded)
        return timings

    def _begin_update(self) -> bool:
        """Open SGLang's weight-update session (0.5.23 requires one); False where the server predates it."""
        try:
            self._call("/begin_weight_update", {})
            return True
        except EngineError as exc:
            if " answered 404" in str(exc):
                return False
            raise

    def reset_prefix_cache(self) -> None:
        """``/flush_cache`` (SGLang refuses it while requests run)."""
        self._call("/flush_cache", None, method="POST")

    def sleep(self, discard_weights: bool = False) -> None:
        """``/release_memory_occupation`` of the KV cache, and of the weights with ``discard_weights``."""
        if self.num_running():
            raise EngineError("abort or finish in-flight requests before sleep()")
        tags = ["weights", "kv_cache"] if discard_weights else ["kv_cache"]
        self._call("/release_memory_occupation", {"tags": tags})
        self._released_tags, self._asleep = tags, True

    def wake(self) -> None:
        """``/resume_memory_occupation`` of what ``sleep()`` released."""
        if self._released_tags:
            self._call("/resume_memory_occupation", {"tags": self._released_tags})
        self._released_tags, self._asleep = None, False

    @property
    def asleep(self) -> bool:
        return self._asleep

    def health(self) -> dict[str, Any]:
        """Raise EngineError unless the server generates (``/health_generate``); its model info otherwise."""
        self._check_usable()
        self._call("/health_generate", None, method="GET")
        info = self.model_info()
        return {"version": self.version, "url": self.url, "weight_version": info.get("weight_version"),
                "model_path": info.get("model_path"), "running": self.num_running()}

    def model_info(self) -> dict[str, Any]:
        """``/model_info`` (sglang 0.5.23), or ``/get_model_info`` on servers that predate it."""
        try:
            return self._call("/model_info", None, method="GET")
        except EngineError as exc:
            if " answered 404" not in str(exc):
                raise
            return self._call("/get_model_info", None, method="GET")

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineError("the SGLang engine client is closed; build a new one")
        if self._asleep:
            raise EngineError("the rollout engine is asleep; call wake() before generating")

    def close(self) -> None:
        """Abort what runs, stop the client's threads and the server it launched; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.num_running():
            self.abort_all()
        with self._cond:
            for flight in self._flights.values():
                flight.cancelled = True
        if self._process is not None:
            self._process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def server_process(self) -> sglang_launch.ServerProcess | None:
        """The server this client launched (None when it connected to ``url``)."""
        return self._process


def _validate(r: GenerationRequest) -> None:
    validate_request(r, allow_greedy=True)  # no length bound here: the server holds the model's limit


def _result(r: GenerationRequest, ids, logprobs, versions, reason) -> GenerationResult:
    """``r``'s partial response (if resumed) followed by new tokens with their own per-token versions."""
    return GenerationResult(
        request_id=r.request_id,
        response_ids=np.concatenate([np.asarray(r.response_ids, np.int32), np.asarray(ids, np.int32)]),
        logprobs=np.concatenate([np.asarray(r.logprobs, np.float32), np.asarray(logprobs, np.float32)]),
        versions=np.concatenate([np.asarray(r.versions, np.int32), np.asarray(versions, np.int32)]),
        finish_reason=reason,
    )



__all__ = ["SGLangEngine", "SGLangParams"]


def build_sglang_engine(inputs) -> SGLangEngine:
    """A rollout replica's SGLang engine (``generate.impl: sglang``; settings in ``params.server``).

    Unless the settings name a ``url`` or a ``model_path``, the replica's initial policy is saved
    as a Hugging Face directory in its workdir and the server launched on it; the server's log
    goes to the workdir too."""
    from rlpipe.backends.model import save_hf_model

    params: SGLangParams = inputs.params.server
    updates: dict[str, Any] = {}
    if params.url is None and params.model_path is None:
        updates["model_path"] = str(save_hf_model(inputs.model, inputs.tokenizer, Path(inputs.workdir) / "model"))
    if params.log_dir is None:
        updates["log_dir"] = inputs.workdir
    return SGLangEngine(params.model_copy(update=updates))
