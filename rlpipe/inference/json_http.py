"""JSON over HTTP with the standard library only: a threaded server of routes, and one client call.

The server side serves a dict ``path -> (methods, handler)``; a handler takes the
JSON body (a dict; ``{}`` when empty) and returns what to send: a dict/list
(JSON), a str (text) or None (empty body). It raises :class:`HTTPError` for any
other status; errors go out as ``{"error": {"message": ...}}`` (the shape
SGLang's and FastAPI servers answer with) unless the error carries its own body.

The client side, :func:`call`, turns every failure into an
:class:`~rlpipe.inference.contract.EngineError` naming the URL, the endpoint and
the server's message (or why there was no answer).
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.error
import urllib.request
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

from rlpipe.inference.contract import EngineError

log = logging.getLogger(__name__)

Routes = Mapping[str, tuple[tuple[str, ...], Callable[[dict], Any]]]


class HTTPError(Exception):
    """An answer other than 200: its status, message and (optionally) the exact body to send."""

    def __init__(self, status: int, message: str, body: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.body = status, message, body


def serve(routes: Routes, host: str, port: int, name: str) -> ThreadingHTTPServer:
    """A bound (not yet serving) threaded server of ``routes``; run ``serve_forever()`` in a thread."""
    handler = type("_Handler", (_Handler,), {"routes": routes, "name": name})
    httpd = _Server((host, port), handler)
    httpd.daemon_threads = True
    return httpd


class _Server(ThreadingHTTPServer):
    # The stdlib's listen backlog is 5: a client opening dozens of connections at once (every in-flight
    # request of a rollout step) gets some of them reset. Room for every request a client keeps open.
    request_queue_size = 1024


class _Handler(BaseHTTPRequestHandler):
    routes: Routes = {}
    name = "server"
    server_version = "rlpipe-json-http"

    def log_message(self, fmt: str, *args) -> None:  # one debug line per request, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def _serve(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path not in self.routes:
                raise HTTPError(HTTPStatus.NOT_FOUND, f"no endpoint {path} on {self.name}", {"detail": "Not Found"})
            methods, handler = self.routes[path]
            if method not in methods:
                raise HTTPError(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {'/'.join(methods)}",
                                {"detail": "Method Not Allowed"})
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw.strip() else {}
            except ValueError as exc:
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise HTTPError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
            out, status = handler(body), HTTPStatus.OK
        except HTTPError as exc:
            status, out = exc.status, exc.body or {"error": {"message": exc.message}}
        except Exception as exc:  # noqa: BLE001 - a bug in a handler must still answer the client
            log.exception("%s: %s failed", self.name, path)
            status, out = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
        if isinstance(out, str):
            payload, kind = out.encode(), "text/plain; charset=utf-8"
        else:
            payload, kind = (b"" if out is None else json.dumps(out).encode()), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        try:
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass


def call(url: str, endpoint: str, body: dict | None, timeout: float, method: str = "POST",
         who: str = "server", hint: str = "") -> Any:
    """One request; its JSON answer (text if not JSON, None if empty). Failures raise EngineError
    ("{who} {url}{endpoint} answered 400: <message>" / "... did not answer (...): is it running?{hint}")."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + endpoint, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise EngineError(f"{who} {url}{endpoint} answered {exc.code}: {error_message(exc.read())}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise EngineError(f"{who} {url}{endpoint} did not answer ({type(exc).__name__}: {reason}; timeout "
                          f"{timeout:g} s): is it running?{hint}") from None
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        return raw.decode(errors="replace")


def error_message(raw: bytes) -> str:
    """The message of an error body: ``{"error": {"message"}}``, ``{"message"}``, ``{"detail"}`` or text."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip() or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)
