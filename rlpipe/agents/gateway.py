"""An OpenAI-compatible gateway in front of rollout engines, recording every session's tokens (seed 5.3).

A black-box agent (anything that speaks the OpenAI chat API) is pointed at the
gateway's base URL; each of its requests is rendered with the chat template
(:mod:`rlpipe.agents.chat`), sent to a rollout engine as token ids, and the
session's token-level trajectory — prompt, model tokens (mask 1, logprobs,
policy versions), tokens of the messages the client added (mask 0), per-turn
spans — is recorded. Sessions end explicitly (``POST /v1/sessions/<id>/end`` or
:meth:`Gateway.end_session`) and are then handed out as trajectories.

Endpoints (stdlib :class:`~http.server.ThreadingHTTPServer`, JSON only)::

    GET  /v1/models                    the one served model
    POST /v1/chat/completions          messages, tools, max_tokens | max_completion_tokens, temperature, top_p,
                                       seed, stream, user | session (the session id); n = 1
    POST /v1/sessions/<id>/end         end a session; returns its summary
    GET  /health

The session id comes from the path prefix ``/s/<id>/v1/…`` (so a base URL can
carry it to an agent that cannot set headers), else the ``X-Session-Id``
header, else the body's ``session`` or ``user`` field, else a fresh id per
request. Engine request id = ``<session id>#<turn>``, and a session sticks to
one engine (a stable hash of its id): its prefix stays on one replica (seed 5.3.2).

Binds 127.0.0.1 by default; with ``api_key`` set, requests need
``Authorization: Bearer <api_key>`` (else 401, before any of the body is read).
Body size, read deadlines and concurrent handlers are bounded by ``limits``
(:mod:`rlpipe.agents.http_guard`: 413, 400/411 on a bad ``Content-Length``, 408).
Malformed requests get 4xx OpenAI-shaped JSON errors (sampling fields are checked as
OpenAI checks them, ``param`` naming the field); a session over its token cap is cut
(``finish_reason: length`` and an empty reply), its trajectory kept. With ``idle_timeout_s`` a session idle that
long is ended as if the client had ended it (``on_session`` gets it). Temperature
0 is sent as 1e-5 (the engines sample; there is no greedy path). Tool calls in
OpenAI form (``tools`` in, ``tool_calls`` out, ``tool`` messages back) and
``stream: true``: :mod:`rlpipe.agents.openai_format`. Left out: ``n > 1``,
token-by-token streaming, other APIs (completions, responses, Anthropic messages).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable, Protocol, Sequence

from rlpipe.agents.chat import ChatSession, cut_at_stop
from rlpipe.agents.http_guard import BoundedServer, GatewayLimits, GuardedHandler
from rlpipe.agents.openai_format import (FormatError, completion, parse_messages, sampling_fields, split_calls,
                                         stream_events, tool_names)
from rlpipe.agents.parsers import build_parser
from rlpipe.errors import RlpipeError
from rlpipe.inference.contract import EngineError, GenerationRequest, GenerationResult, RolloutEngine, SamplingParams

log = logging.getLogger(__name__)

MODEL_NAME = "rlpipe-policy"


class GatewayError(RlpipeError):
    """A request the gateway refuses; ``status`` is the HTTP status it answers with, ``param`` the request
    field at fault (OpenAI's error ``param``), if one is."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


class Backend(Protocol):
    def complete(self, session_id: str, request: GenerationRequest) -> GenerationResult:
        """Generate ``request`` (blocking) on the engine this session sticks to."""


def sticky_index(session_id: str, replicas: int) -> int:
    """The replica a session sticks to: a stable hash of its id."""
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "little") % replicas


class EngineDriver:
    """A :class:`Backend` over engines nobody else drives: one thread per engine steps it while work is queued."""

    def __init__(self, engines: Sequence[RolloutEngine]):
        self.engines = list(engines)
        self._queues: list[list[tuple[GenerationRequest, Future]]] = [[] for _ in self.engines]
        self._cond = threading.Condition()
        self._stop = False
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"gateway-engine-{i}")
                         for i in range(len(self.engines))]
        for t in self._threads:
            t.start()

    def complete(self, session_id: str, request: GenerationRequest) -> GenerationResult:
        future: Future = Future()
        with self._cond:
            self._queues[sticky_index(session_id, len(self.engines))].append((request, future))
            self._cond.notify_all()
        return future.result()

    def _loop(self, i: int) -> None:
        engine, waiting = self.engines[i], {}
        while True:
            with self._cond:
                while not self._stop and not self._queues[i] and not waiting:
                    self._cond.wait()
                if self._stop:
                    break
                queued, self._queues[i] = self._queues[i], []
            for request, future in queued:
                try:
                    engine.submit([request])
                    waiting[request.request_id] = future
                except EngineError as exc:
                    future.set_exception(exc)
            if waiting:
                try:
                    results = engine.step()
                except Exception as exc:  # noqa: BLE001 - every waiting caller learns of it
                    for future in waiting.values():
                        future.set_exception(exc)
                    waiting = {}
                    continue
                for result in results:
                    waiting.pop(result.request_id).set_result(result)
        for future in waiting.values():
            future.set_exception(EngineError("the gateway was closed while this request ran"))

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(5)


class Gateway:
    """The HTTP gateway: ``start()`` it, point clients at :attr:`base_url`, ``end_session`` to collect."""

    def __init__(self, backend: Backend, tokenizer: Any, api_key: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, max_session_tokens: int | None = None, default_max_tokens: int = 256,
                 on_session: Callable[[ChatSession], None] | None = None, tool_parser: str = "hermes",
                 idle_timeout_s: float | None = None, limits: GatewayLimits | None = None):
        self.backend = backend
        self.tool_parser = tool_parser
        build_parser(tool_parser)  # an unknown name fails here, listing the known ones
        self.idle_timeout_s = idle_timeout_s
        self._reaper_stop = threading.Event()
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.max_session_tokens = max_session_tokens
        self.default_max_tokens = default_max_tokens
        self.on_session = on_session
        self._sessions: dict[str, ChatSession] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._ended: dict[str, None] = {}  # ids of ended sessions, oldest first
        self._lock = threading.Lock()
        self.limits = limits or GatewayLimits()
        self._server = BoundedServer((host, port), _handler(self), self.limits)
        self._thread: threading.Thread | None = None

    @property
    def peak_handlers(self) -> int:
        """The most connections the HTTP server has served at once (at most ``limits.max_handlers``)."""
        return self._server.peak

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def session_url(self, session_id: str) -> str:
        """A base URL that carries the session id (for agents that cannot set headers)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/s/{session_id}/v1"

    def start(self) -> "Gateway":
        # polls for close() every 0.1 s (the stdlib's 0.5 s made every close wait that long)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), daemon=True,
                                        name="rlpipe-gateway")
        self._thread.start()
        if self.idle_timeout_s is not None:
            threading.Thread(target=self._reap, daemon=True, name="rlpipe-gateway-reaper").start()
        return self

    def _reap(self) -> None:
        """End sessions idle for ``idle_timeout_s`` (no request in flight, none for that long): their trajectories
        go to ``on_session`` like explicitly ended ones, so an agent that never says goodbye is not lost."""
        period = min(1.0, self.idle_timeout_s / 4)
        while not self._reaper_stop.wait(period):
            now = time.monotonic()
            with self._lock:
                idle = [sid for sid, s in self._sessions.items()
                        if now - s.last_active > self.idle_timeout_s and not self._locks[sid].locked()]
            for sid in idle:
                log.info("gateway: session %s idle for %.1f s; ending it", sid, self.idle_timeout_s)
                self.end_session(sid)

    def close(self) -> None:
        self._reaper_stop.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.server_close()

    # -- sessions -----------------------------------------------------------------------

    def _session(self, session_id: str) -> tuple[ChatSession, threading.Lock]:
        with self._lock:
            if session_id in self._ended:
                raise GatewayError(f"session {session_id!r} has ended; use a new session id", 409)
            if session_id not in self._sessions:
                self._sessions[session_id] = ChatSession(session_id, self.tokenizer, self.max_session_tokens)
                self._locks[session_id] = threading.Lock()
            return self._sessions[session_id], self._locks[session_id]

    def end_session(self, session_id: str, wait: bool = True) -> ChatSession | None:
        """End a session (later requests in it get 409) and return its record (None if it never spoke).

        With ``wait`` a turn in flight finishes recording first; the agent loop passes False (it ends a
        session only between turns, and must not block the thread that completes turns)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            lock = self._locks.pop(session_id, None)
            self._ended[session_id] = None
            while len(self._ended) > 100_000:  # remember recent ids only
                self._ended.pop(next(iter(self._ended)))
        if lock is not None and wait:
            with lock:
                pass
        if session is not None and self.on_session is not None:
            self.on_session(session)
        return session

    def reopen(self, session_id: str) -> None:
        """Allow an ended session id to start again (a new session)."""
        with self._lock:
            self._ended.pop(session_id, None)

    def sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._sessions)

    # -- one chat completion -------------------------------------------------------------

    def chat(self, body: Any, session_id: str | None) -> dict:
        try:
            messages = parse_messages(body)
            names = tool_names(body)
            max_tokens, temperature, top_p, seed, stops = sampling_fields(body, self.default_max_tokens)
        except FormatError as exc:
            raise GatewayError(str(exc), param=exc.param) from None
        session_id = session_id or body.get("session") or body.get("user") or f"anon-{uuid.uuid4().hex}"
        if not isinstance(session_id, str) or not re.fullmatch(r"[\w.:@-]{1,128}", session_id):
            raise GatewayError("a session id is 1-128 characters of letters, digits and _.:@-",
                               param="session" if body.get("session") else "user")
        session, lock = self._session(session_id)
        with lock:
            session.last_active = time.monotonic()
            prompt = session.prompt_for(session.canonical(messages))
            budget = session.budget()
            if budget is not None and budget <= 0:
                session.cut = True
                return self._reply(session, "", [], "length", 0, len(prompt), [])
            request = GenerationRequest(
                f"{session_id}#{session.turns}", prompt, min(max_tokens, budget or max_tokens),
                SamplingParams(temperature=max(temperature, 1e-5), top_p=top_p, seed=seed))
            try:
                result = self.backend.complete(session_id, request)
            except EngineError as exc:
                raise GatewayError(f"the rollout engine refused the request: {exc}", 400) from exc
            finally:
                session.last_active = time.monotonic()
            result, before_stop = cut_at_stop(result, stops, session.tokenizer)
            text = session.record(result, before_stop)
            if budget is not None and len(result.response_ids) >= budget:
                session.cut = True
            content, calls = text, []
            if names and result.finish_reason != "length":
                first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
                content, calls = split_calls(text, self.parser(names[0]), names, first_user,
                                             f"call_{session_id}_{session.turns}")
                session.remember_calls(calls, text)
            reason = "length" if result.finish_reason == "length" else "tool_calls" if calls else "stop"
            return self._reply(session, content, calls, reason, len(result.response_ids), len(prompt),
                               result.versions.tolist())

    def parser(self, default_tool: str):
        return build_parser(self.tool_parser, default_tool)

    def _reply(self, session: ChatSession, content: str, calls: list, reason: str, completion_tokens: int,
               prompt_tokens: int, versions: list) -> dict:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        extra = {"rlpipe": {"session": session.id, "turn": session.turns, "versions": sorted(set(versions))}}
        return completion(MODEL_NAME, f"chatcmpl-{session.id}-{session.turns}", content, calls, reason, usage, extra)


def _handler(gateway: Gateway) -> type[GuardedHandler]:
    class Handler(GuardedHandler):
        limits = gateway.limits
        api_key = gateway.api_key

        def _route(self) -> tuple[str | None, str]:
            m = re.fullmatch(r"/s/([^/]+)(/.*)", self.path.split("?")[0])
            return (m.group(1), m.group(2)) if m else (self.headers.get("X-Session-Id"), self.path.split("?")[0])

        def do_GET(self):
            _, path = self._route()
            self.skip_body()
            if path == "/health":
                return self.send_json(200, {"status": "ok"})
            if not self.authorized():
                return
            if path == "/v1/models":
                return self.send_json(200, {"object": "list", "data": [
                    {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "rlpipe"}]})
            self.reject(404, f"no route GET {path}; the gateway serves /v1/models and /v1/chat/completions")

        def do_POST(self):
            session_id, path = self._route()
            end = re.fullmatch(r"/v1/sessions/([^/]+)/end", path)
            if not self.authorized():  # the key first: an unauthenticated body is never read
                return
            if path != "/v1/chat/completions" and not end:
                return self.refuse_unread(404, f"no route POST {path}; the gateway serves /v1/chat/completions")
            raw = self.read_body(required=not end)  # strict Content-Length, the size cap, the read deadline
            if raw is None:
                return
            stream, reply = False, None
            try:
                if end:
                    session = gateway.end_session(end.group(1))
                    reply = session.summary() if session else {"session": end.group(1), "turns": 0}
                else:
                    try:
                        body = json.loads(raw or b"null")
                    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, huge ints, deep nesting
                        raise GatewayError(f"the request body is not valid JSON: {exc}"[:300]) from None
                    reply = gateway.chat(body, session_id)
                    stream = bool(body.get("stream"))
            except GatewayError as exc:
                return self.reject(exc.status, str(exc), exc.param)
            except Exception as exc:  # noqa: BLE001 - a bad request must never kill the server
                log.exception("gateway: request failed")
                return self.reject(500, f"internal error: {exc!r}")
            if stream:  # the reply is complete: sent whole, no chunked encoding needed
                return self.send_bytes(200, stream_events(reply), "text/event-stream", {"Cache-Control": "no-cache"})
            self.send_json(200, reply)

    return Handler
