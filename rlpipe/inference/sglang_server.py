"""rlpipe's embedded engine behind SGLang's native HTTP protocol (a subset of sglang 0.5.23).

The server owns one :class:`~rlpipe.inference.embedded.EmbeddedEngine` and a
decode-loop thread that steps it while requests are active and sleeps on a
condition otherwise (like the async modes' rollout service). Each HTTP request
is served on its own thread (stdlib ``ThreadingHTTPServer``; no new
dependency); a ``/generate`` handler submits its request and blocks until the
loop files its result. So :class:`~rlpipe.inference.sglang_engine.SGLangEngine`
runs for real — real HTTP, a real torch model — on a machine where SGLang
itself cannot.

Endpoints and fields (request and response shapes as in SGLang's
``http_server.py`` / ``io_struct.py``): ``/generate`` (``input_ids``, ``rid``,
``sampling_params`` {max_new_tokens, temperature, top_p, top_k, ignore_eos, stop_token_ids,
sampling_seed, custom_params}, ``return_logprob``; ``meta_info`` with
``output_token_logprobs`` as [logprob, token_id, text], ``finish_reason``,
``weight_version``, ``weight_versions`` spans), ``/abort_request``,
``/pause_generation`` (mode abort | retract | in_place), ``/continue_generation``,
``/begin_weight_update``, ``/end_weight_update``, ``/update_weights_from_tensor``
(``load_format="rlpipe_buckets"`` only: see :mod:`rlpipe.inference.sglang_wire`),
``/update_weights_from_disk``, ``/update_weight_version``, ``/get_weight_version`` (earlier
SGLang releases; 0.5.23 reports the version in ``/model_info``),
``/flush_cache``, ``/release_memory_occupation``, ``/resume_memory_occupation``
(tags ``weights`` / ``kv_cache``), ``/health``, ``/health_generate``,
``/get_model_info`` and ``/model_info``.

Where it differs from SGLang: no ``text`` input, batches, streaming, greedy
decoding (temperature 0), stop strings or prompt logprobs (each is refused with
a 400 naming the field); a weight update while requests run is refused (SGLang
waits for them) — abort first, as rlpipe's engines do; aborting one ``rid``
aborts all and resubmits the others as resumed requests (the counter-based RNG
makes that invisible); ``sampling_params.custom_params.rlpipe_resume_len = k``
marks the last ``k`` input ids as a partial response, so a resume redraws
exactly the tokens the embedded engine would (real SGLang ignores it);
``retract`` and ``in_place`` pauses both keep requests in the engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Callable

import numpy as np

from rlpipe.inference import sglang_wire
from rlpipe.inference.json_http import HTTPError, serve
from rlpipe.inference.contract import EngineError, GenerationRequest, GenerationResult, SamplingParams
from rlpipe.inference.embedded import EmbeddedEngine

log = logging.getLogger(__name__)

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k (-1 means the same)
_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos", "sampling_seed", "custom_params",
                  "stop_token_ids"}
_SAMPLING_DEFAULTS = {  # accepted only at SGLang's default value: the embedded engine has no such knob
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
    "n": 1, "stop": None, "stop_token_ids": None, "stop_regex": None, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "logit_bias": None, "json_schema": None,
    "regex": None, "ebnf": None, "stream_interval": None,
}
_GENERATE_DEFAULTS = {"stream": False, "text": None, "input_embeds": None, "top_logprobs_num": 0,
                      "token_ids_logprob": None, "return_hidden_states": False, "lora_path": None}
RESUME_KEY = sglang_wire.RESUME_KEY


@dataclass
class _Waiter:
    request: GenerationRequest
    resume_len: int
    prompt_len: int
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: str | None = None


class SGLangFace:
    """The embedded engine served over SGLang's protocol; ``start()`` in a thread, ``close()`` to stop."""

    def __init__(self, engine: EmbeddedEngine, model_path: str = "", host: str = "127.0.0.1", port: int = 0,
                 weight_version: str | None = None):
        self.engine = engine
        self.model_path = model_path
        self.weight_version = str(engine.version) if weight_version is None else weight_version
        self._cond = threading.Condition()
        self._waiters: dict[str, _Waiter] = {}
        self._paused = False
        self._session = False
        self._released: set[str] = set()
        self._closing = False
        self._hold = 0  # handlers waiting for the lock; the decode loop lets them in between steps
        self._hold_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.routes: dict[str, tuple[tuple[str, ...], Callable[[dict], Any]]] = {
            "/generate": (("POST", "PUT"), self.generate),
            "/abort_request": (("POST",), self.abort_request),
            "/pause_generation": (("POST",), self.pause_generation),
            "/continue_generation": (("POST",), self.continue_generation),
            "/begin_weight_update": (("POST",), self.begin_weight_update),
            "/end_weight_update": (("POST",), self.end_weight_update),
            "/update_weights_from_tensor": (("POST",), self.update_weights_from_tensor),
            "/update_weights_from_disk": (("POST",), self.update_weights_from_disk),
            "/update_weight_version": (("POST",), self.update_weight_version),
            "/get_weight_version": (("GET",), lambda body: {"weight_version": self.weight_version}),
            "/flush_cache": (("GET", "POST"), self.flush_cache),
            "/release_memory_occupation": (("GET", "POST"), self.release_memory_occupation),
            "/resume_memory_occupation": (("GET", "POST"), self.resume_memory_occupation),
            "/health": (("GET",), lambda body: None),
            "/health_generate": (("GET",), self.health_generate),
            "/get_model_info": (("GET",), self.model_info),
            "/model_info": (("GET",), self.model_info),
        }
        self.httpd = serve(self.routes, host, port, name="rlpipe's embedded SGLang server")
        self.url = f"http://{host}:{self.httpd.server_address[1]}"

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "SGLangFace":
        """Serve in background threads (the decode loop and the HTTP server)."""
        for target, name in ((self._loop, "sglang-face-decode"), (self.httpd.serve_forever, "sglang-face-http")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        """Stop serving: waiting /generate calls answer 503; idempotent."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            for waiter in self._waiters.values():
                waiter.error = "the server is shutting down"
                waiter.done.set()
            self._waiters.clear()
            self._cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> "SGLangFace":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the decode loop -------------------------------------------------------------

    def _loop(self) -> None:
        with self._cond:
            while not self._closing:
                if self._hold:
                    self._cond.wait(0.01)
                    continue
                if self._paused or not self.engine.has_active():
                    self._cond.wait()
                    continue
                if (wait := self.engine.next_ready_in()) > 0:
                    self._cond.wait(wait)
                    continue
                try:
                    results = self.engine.step()  # under the lock: handlers submit/abort between steps
                except Exception as exc:  # noqa: BLE001 - every waiter hears it; the loop goes on
                    log.exception("embedded SGLang face: engine step failed")
                    self.engine.abort_all()
                    for waiter in self._waiters.values():
                        waiter.error = f"engine step failed: {exc}"
                        waiter.done.set()
                    self._waiters.clear()
                    continue
                self._deliver(results)

    @contextmanager
    def _access(self):
        """The engine lock for a handler: the decode loop yields it between steps while someone waits."""
        with self._hold_lock:
            self._hold += 1
        try:
            self._cond.acquire()
        finally:
            with self._hold_lock:
                self._hold -= 1
        try:
            yield
        finally:
            self._cond.notify_all()
            self._cond.release()

    def _deliver(self, results: list[GenerationResult]) -> None:
        for result in results:
            if (waiter := self._waiters.pop(result.request_id, None)) is not None:
                waiter.result = result
                waiter.done.set()

    # -- generation ------------------------------------------------------------------

    def generate(self, body: dict) -> dict:
        waiter = self._parse_generate(body)
        rid = waiter.request.request_id
        with self._access():
            if self._closing:
                raise HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
            if rid in self._waiters:
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"request id {rid!r} is already in flight; ids must be unique")
            try:
                self.engine.submit([waiter.request])
            except EngineError as exc:
                raise HTTPError(HTTPStatus.BAD_REQUEST, str(exc)) from exc
            self._waiters[rid] = waiter
            self._cond.notify_all()
        waiter.done.wait()
        if waiter.error is not None:
            raise HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, waiter.error)
        return self._response(waiter, body.get("return_logprob"), body.get("return_text_in_logprobs"))

    def _parse_generate(self, body: dict) -> _Waiter:
        for key, default in _GENERATE_DEFAULTS.items():
            if body.get(key, default) not in (default, None):
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"/generate field {key!r} is not supported by rlpipe's "
                                f"embedded SGLang server (send token ids in input_ids, non-streaming)")
        if body.get("logprob_start_len") not in (None, -1):
            raise HTTPError(HTTPStatus.BAD_REQUEST, "prompt logprobs (logprob_start_len >= 0) are not supported")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise HTTPError(HTTPStatus.BAD_REQUEST, "input_ids must be one non-empty list of token ids "
                            "(batches are not supported by rlpipe's embedded SGLang server)")
        sp = dict(body.get("sampling_params") or {})
        for key, value in sp.items():
            if key not in _SAMPLING_KEYS and (key not in _SAMPLING_DEFAULTS or value != _SAMPLING_DEFAULTS[key]):
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"sampling_params.{key}={value!r} is not supported by the "
                                f"embedded engine; it reads {sorted(_SAMPLING_KEYS)}")
        temperature = float(sp.get("temperature", 1.0))
        if temperature <= 0:
            raise HTTPError(HTTPStatus.BAD_REQUEST, "greedy decoding (temperature 0) is not supported by the "
                            "embedded engine; use temperature > 0")
        top_k = int(sp.get("top_k", TOP_K_ALL))
        resume = int((sp.get("custom_params") or {}).get(RESUME_KEY, 0))
        if not 0 <= resume < len(ids):
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"custom_params.{RESUME_KEY}={resume} must be >= 0 and leave "
                            f"a non-empty prompt of the {len(ids)} input ids")
        sampling = SamplingParams(
            temperature=temperature, top_p=float(sp.get("top_p", 1.0)),
            top_k=0 if top_k == -1 or top_k >= TOP_K_ALL else top_k,
            seed=int(sp.get("sampling_seed") or 0), ignore_eos=bool(sp.get("ignore_eos", False)),
            stop_token_ids=tuple(int(t) for t in sp.get("stop_token_ids") or ()))
        prompt, partial = ids[: len(ids) - resume], ids[len(ids) - resume:]
        request = GenerationRequest(
            request_id=str(body.get("rid") or uuid.uuid4().hex), prompt_ids=np.asarray(prompt, np.int64),
            max_tokens=resume + int(sp.get("max_new_tokens", 128)), sampling=sampling,
            response_ids=np.asarray(partial, np.int32), logprobs=np.zeros(resume, np.float32),
            versions=np.zeros(resume, np.int32))
        return _Waiter(request, resume, len(ids))

    def _response(self, waiter: _Waiter, with_logprobs: bool, with_text: bool) -> dict:
        result, k = waiter.result, waiter.resume_len
        ids = [int(t) for t in result.response_ids[k:]]
        n = len(ids)
        if result.finish_reason == "stop":
            reason = {"type": "stop", "matched": ids[-1] if ids else None}
        elif result.finish_reason == "length":
            reason = {"type": "length", "length": n}
        else:
            reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        meta = {"id": result.request_id, "finish_reason": reason, "prompt_tokens": waiter.prompt_len,
                "completion_tokens": n, "cached_tokens": 0, "weight_version": self.weight_version,
                "weight_versions": [{"version": self.weight_version, "start": 0, "end": n}]}
        if with_logprobs:
            tok = self.engine.tokenizer
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [float(lp), t, tok.decode([t]) if with_text else None]
                for lp, t in zip(result.logprobs[k:].tolist(), ids)]
        return {"text": self.engine.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta}

    def abort_request(self, body: dict) -> None:
        rid, everything = body.get("rid") or "", bool(body.get("abort_all", False))
        with self._access():
            self._abort(None if everything else rid)

    def _abort(self, rid: str | None) -> None:
        """Abort ``rid`` (None: all). The engine aborts all at once, so the others are resumed right away."""
        if rid is not None and rid not in self._waiters:
            return
        results = self.engine.abort_all()
        keep = [r for r in results if rid is not None and r.request_id != rid and r.finish_reason == "abort"]
        self._deliver([r for r in results if r not in keep])
        if keep:
            self.engine.submit([r.resume(self._waiters[r.request_id].request) for r in keep])
        self._cond.notify_all()

    def pause_generation(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"pause mode {mode!r}: use abort, retract or in_place")
        with self._access():
            self._paused = True
            if mode == "abort":
                self._abort(None)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> dict:
        with self._access():
            self._paused = False
            self._cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # -- weights ---------------------------------------------------------------------

    def begin_weight_update(self, body: dict) -> dict:
        with self._access():
            if self._session:
                raise _failed("a weight-update session is already open; call end_weight_update() first")
            self._session = True
        return {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict) -> dict:
        with self._access():
            if not self._session:
                raise _failed("no weight-update session is open; call begin_weight_update() first")
            self._session = False
        return {"success": True, "message": "Success"}

    def update_weights_from_tensor(self, body: dict) -> dict:
        if body.get("load_format") != sglang_wire.LOAD_FORMAT:
            raise _failed(f"load_format {body.get('load_format')!r} is not read here: rlpipe's embedded SGLang "
                          f"server takes load_format {sglang_wire.LOAD_FORMAT!r} (no pickled tensors)")
        with self._access():
            if not self._session:
                raise _failed("update_weights_from_tensor must run between begin_weight_update() and "
                              "end_weight_update()")
        try:
            buckets = sglang_wire.decode_buckets(body.get("serialized_named_tensors") or [])
        except (EngineError, KeyError) as exc:
            raise _failed(str(exc)) from exc
        return self._load(buckets, body)

    def update_weights_from_disk(self, body: dict) -> dict:
        from rlpipe.backends.model import build_model
        from rlpipe.backends.weights import export_buckets
        from rlpipe.schemas.config import ModelConfig

        try:
            dtype = str(next(self.engine.model.parameters()).dtype).removeprefix("torch.")
            model = build_model(ModelConfig(path=body["model_path"], dtype=dtype), self.engine.tokenizer, 0)
        except Exception as exc:  # noqa: BLE001 - reported to the caller like SGLang does
            raise _failed(f"cannot load weights from {body.get('model_path')!r}: {exc}",
                          num_paused_requests=0) from exc
        out = self._load(export_buckets(model), body)
        self.model_path = body["model_path"]
        return {**out, "num_paused_requests": 0}

    def _load(self, buckets: list, body: dict) -> dict:
        with self._access():
            if body.get("abort_all_requests"):
                self._abort(None)
            version = body.get("weight_version")
            start = time.perf_counter()
            try:
                self.engine.load_weights(buckets, max(self.engine.version, _as_int(version, self.engine.version)))
            except Exception as exc:  # noqa: BLE001 - EngineError, WeightTransportError: the caller's to fix
                raise _failed(f"{exc}; abort in-flight requests (abort_request abort_all) before a weight update"
                              if self.engine.num_running() else str(exc)) from exc
            loaded = time.perf_counter()
            if body.get("flush_cache", True):
                self.engine.reset_prefix_cache()
            if version is not None:
                self.weight_version = str(version)
            message = "Succeeded to update parameter online." + (
                f" Weight version updated to {version}." if version is not None else "")
            return {"success": True, "message": message, "load_s": loaded - start,
                    "cache_reset_s": time.perf_counter() - loaded}

    def update_weight_version(self, body: dict) -> dict:
        if "new_version" not in body:
            raise HTTPError(HTTPStatus.BAD_REQUEST, "update_weight_version needs new_version")
        with self._access():
            if body.get("abort_all_requests", True):
                self._abort(None)
            self.weight_version = str(body["new_version"])
        return {"success": True, "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"]}

    def flush_cache(self, body: dict) -> str:
        with self._access():
            if self.engine.num_running():
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"{self.engine.num_running()} request(s) running or waiting; "
                                "the cache is not flushed while requests run")
            self.engine.reset_prefix_cache()
        return ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n")

    # -- memory and health -----------------------------------------------------------

    def release_memory_occupation(self, body: dict) -> None:
        tags = set(body.get("tags") or ("weights", "kv_cache"))
        with self._access():
            try:
                self.engine.sleep(discard_weights="weights" in tags)
            except EngineError as exc:
                raise HTTPError(HTTPStatus.BAD_REQUEST, str(exc)) from exc
            self._released |= tags

    def resume_memory_occupation(self, body: dict) -> None:
        tags = set(body.get("tags") or ("weights", "kv_cache"))
        with self._access():
            self._released -= tags
            if not self._released:
                self.engine.wake()

    def health_generate(self, body: dict) -> None:
        with self._access():
            try:
                self.engine.health()
            except EngineError as exc:
                raise HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from exc

    def model_info(self, body: dict) -> dict:
        cfg = self.engine.model.config
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
                "max_position_embeddings": int(cfg.max_position_embeddings)}


def _failed(message: str, **extra) -> HTTPError:
    """SGLang's weight endpoints answer failures as ``{"success": false, "message": ...}`` with status 400."""
    return HTTPError(HTTPStatus.BAD_REQUEST, message, {"success": False, "message": message, **extra})


def _as_int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def main(argv: list[str] | None = None) -> None:
    """``python -m rlpipe.inference.sglang_server --model-dir DIR --port P``: serve until killed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="local Hugging Face model + tokenizer directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", default="0", help="initial weight version label (SGLang's flag)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not os.path.isdir(args.model_dir):
        parser.exit(2, f"--model-dir {args.model_dir!r} is not a directory; give a local Hugging Face model "
                       "directory (config, weights and tokenizer files)\n")

    from rlpipe.backends.model import build_model
    from rlpipe.backends.tokenizer import build_tokenizer
    from rlpipe.schemas.config import ModelConfig, TokenizerConfig

    tokenizer = build_tokenizer(TokenizerConfig(path=args.model_dir))
    model = build_model(ModelConfig(path=args.model_dir, dtype=args.dtype), tokenizer, 0)
    engine = EmbeddedEngine(model, tokenizer, version=_as_int(args.weight_version, 0))
    face = SGLangFace(engine, args.model_dir, args.host, args.port, weight_version=args.weight_version)
    log.info("rlpipe embedded SGLang server on %s (model %s)", face.url, args.model_dir)
    try:
        face._threads.append(threading.Thread(target=face._loop, name="sglang-face-decode", daemon=True))
        face._threads[-1].start()
        face.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        face.close()


if __name__ == "__main__":
    main()
