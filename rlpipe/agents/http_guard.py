"""The gateway's HTTP face, hardened: who may send a body, how big, how slowly, and how many at once.

The stdlib ``ThreadingHTTPServer`` alone reads whatever body a client announces, waits for it
without end and starts a thread for every connection. :class:`GuardedHandler` and
:class:`BoundedServer` bound each of those (settings: :class:`GatewayLimits`):

- **who**: the handler checks the API key (:meth:`GuardedHandler.authorized`) before it reads a
  byte of the body; a refused request's unread body is drained a little and its connection closed,
  so those bytes are never parsed as a next request.
- **how big**: ``Content-Length`` is parsed strictly (ASCII digits only: 400 on junk, a sign or
  conflicting copies; 411 when it is missing where a body is required, or chunked encoding is
  used); a length over ``max_body_bytes`` is refused with 413 before anything is read.
- **how slowly**: every read from a client's socket runs against a deadline
  (:class:`DeadlineReader`): a request's line, headers and body must arrive within
  ``read_timeout_s`` of its first byte (else 408 and the connection is closed), and a connection
  waiting for its (next) request is closed after ``keepalive_timeout_s``. The socket's timeout is
  set to what is left before each ``recv``, so trickling a byte at a time (slow loris) gains
  nothing. A response the client does not take within ``read_timeout_s`` is dropped.
- **how many**: at most ``max_handlers`` connections are served at once; further ones wait,
  unaccepted, in the listen backlog (:class:`BoundedServer`).

Left out: TLS, chunked request bodies, and a flood of connections past the listen backlog (512),
which the kernel handles (dropped SYNs, retried by the client); the gateway binds loopback by default.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pydantic import Field

from rlpipe.schemas.config import Strict

log = logging.getLogger(__name__)

LINGER_S = 1.0
"""How long a refused request's unread body is drained before its connection closes: closing a socket
with unread bytes sends a reset, which can destroy the refusal before the client reads it."""
LINGER_BYTES = 1 << 20
"""The most bytes drained that way (a client that keeps sending past them is reset)."""


class GatewayLimits(Strict):
    """Bounds of the gateway's HTTP server: body size, read deadlines and concurrent handlers."""

    max_body_bytes: int = Field(4 << 20, ge=1024)
    """Largest request body taken (bytes, default 4 MiB); a larger `Content-Length` is refused with 413 before
    any of it is read. It also bounds the tokenizing a single request can cost."""
    read_timeout_s: float = Field(30.0, gt=0)
    """A request's line, headers and body must arrive within this many seconds of its first byte, else 408 and
    the connection is closed (a slow or stalled client frees its handler); a response the client does not
    take within it is dropped."""
    keepalive_timeout_s: float = Field(15.0, gt=0)
    """A connection waiting this long for its first or next request is closed. Longer than the 5 s after which
    the OpenAI client (httpx) drops idle connections itself, so the client, not the gateway, ends idle ones."""
    max_handlers: int = Field(128, ge=1)
    """Most connections served at once (one thread each); further connections wait, unaccepted, until one
    closes. Each is bounded by the two timeouts above plus the generation it asked for."""


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """An OpenAI-shaped error object (what OpenAI clients parse into their exceptions)."""
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    code = "invalid_api_key" if status == 401 else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class DeadlineReader(io.RawIOBase):
    """A client socket's reads against a deadline: :meth:`await_request` arms the idle deadline; the first
    byte of a request replaces it with ``read_timeout_s`` from then. Past the deadline a read raises
    :class:`TimeoutError` (and :attr:`expired` says so)."""

    def __init__(self, sock: socket.socket, read_timeout_s: float):
        super().__init__()
        self.sock = sock
        self.read_timeout_s = read_timeout_s
        self.deadline = time.monotonic() + read_timeout_s
        self.started = False
        self.expired = False

    def readable(self) -> bool:
        return True

    def await_request(self, idle_s: float) -> None:
        self.deadline, self.started, self.expired = time.monotonic() + idle_s, False, False

    def readinto(self, buffer) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self.expired = True
            raise TimeoutError("the client did not send its request in time")
        self.sock.settimeout(remaining)  # what is left, not a fresh timeout per recv: trickling gains nothing
        try:
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            self.expired = True
            raise
        if n and not self.started:
            self.started = True
            self.deadline = time.monotonic() + self.read_timeout_s
        return n


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server with at most ``limits.max_handlers`` connection handlers at once.

    Past the bound the accept loop waits for a handler to finish, so further connections wait in the
    listen backlog rather than get 503: a well-behaved agent then costs only latency, never a failed turn
    (agent programs rarely retry, and a failed turn loses the trajectory), and the wait is bounded because
    every handler ends within the read/keep-alive deadlines plus the generation it runs. A hostile client
    holds a handler for at most ``keepalive_timeout_s + read_timeout_s`` (plus LINGER_S)."""

    daemon_threads = True
    block_on_close = False  # close() must not wait on a handler still generating; handlers are daemon threads
    request_queue_size = 512  # the default backlog of 5 resets concurrent agents' connections

    def __init__(self, address, handler, limits: GatewayLimits):
        self.limits = limits
        self.active = 0
        self.peak = 0  # the most handlers ever running at once (tests and diagnostics read it)
        self._cond = threading.Condition()
        self._closing = False
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        with self._cond:
            # bounded: every handler ends within its deadlines (see the class docstring), or close() wakes us
            while self.active >= self.limits.max_handlers and not self._closing:
                self._cond.wait(self.limits.read_timeout_s)
            if self._closing:
                self.shutdown_request(request)
                return
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._cond:
            self.active -= 1
            self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        super().shutdown()

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client reset, stalled or went away: nothing to fix on this side
            log.debug("gateway: connection from %s ended: %r", client_address, exc)
        else:
            log.exception("gateway: a connection handler failed")


class GuardedHandler(BaseHTTPRequestHandler):
    """A request handler reading through a :class:`DeadlineReader`, with strict bodies and JSON errors.

    Subclasses set :attr:`limits` and :attr:`api_key` and answer with :meth:`send_json` / :meth:`reject`."""

    protocol_version = "HTTP/1.1"
    limits: GatewayLimits = GatewayLimits()
    api_key: str | None = None

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced: the stdlib's reader has no deadline
        self.reader = DeadlineReader(self.connection, self.limits.read_timeout_s)
        self.rfile = io.BufferedReader(self.reader)
        self._unread_body = False
        self._answered = False

    def handle_one_request(self) -> None:
        self.reader.await_request(self.limits.keepalive_timeout_s)
        self._answered = False
        # what a 408 before the request line is parsed needs (parse_request sets them otherwise)
        self.requestline, self.request_version, self.command = "", "HTTP/1.1", None
        super().handle_one_request()  # a TimeoutError inside it closes the connection quietly
        if self.reader.expired and self.reader.started and not self._answered:
            self._unread_body = True  # whatever the client still sends is drained a little, then reset
            try:
                self.reject(408, f"the request did not arrive within {self.limits.read_timeout_s:g} s of its "
                                 "first byte (limits.read_timeout_s)")
            except OSError:
                pass  # the client is gone or not reading: nothing more to tell it

    def finish(self) -> None:
        try:
            if self._unread_body:
                self._linger()
        finally:
            super().finish()

    def _linger(self) -> None:
        """Half-close, then drain what the client still sends (at most LINGER_BYTES, LINGER_S)."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            end, drained = time.monotonic() + LINGER_S, 0
            while drained < LINGER_BYTES and (left := end - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass  # reset or timed out: the connection closes either way

    def log_message(self, fmt, *args) -> None:  # the access log goes to logging, not stderr
        log.debug("gateway: " + fmt, *args)

    # -- answers -------------------------------------------------------------------------

    def send_bytes(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.connection.settimeout(self.limits.read_timeout_s)  # a client that does not read is dropped
        self._answered = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def send_json(self, status: int, payload: dict) -> None:
        self.send_bytes(status, json.dumps(payload).encode(), "application/json")

    def reject(self, status: int, message: str, param: str | None = None) -> None:
        """An OpenAI-shaped error; the connection closes after it when the body was left unread."""
        if self._unread_body:
            self.close_connection = True
        self.send_json(status, error_body(status, message, param))

    def send_error(self, code, message=None, explain=None) -> None:
        """The stdlib's own refusals (bad request line, too many headers, unknown method) as JSON."""
        self.close_connection = True
        self._unread_body = True
        self.reject(code, message or self.responses.get(code, ("error",))[0])

    def handle_expect_100(self) -> bool:
        return True  # "100 Continue" is sent only once the key and length are accepted (read_body)

    # -- the request ---------------------------------------------------------------------

    def authorized(self) -> bool:
        """Whether the request carries the key; else a 401 is sent. Reads no body."""
        sent = self.headers.get("Authorization") or ""
        if self.api_key is None or hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode()):
            return True
        self._unread_body = self._has_body()
        self.reject(401, "missing or wrong API key: send `Authorization: Bearer <key>` with the run's key")
        return False

    def _has_body(self) -> bool:
        return bool(self.headers.get("Transfer-Encoding")) or self.headers.get("Content-Length", "0").strip() != "0"

    def skip_body(self) -> None:
        """A request whose body is not used (a GET with one): the connection closes after the answer, so the
        body's bytes are never parsed as a next request."""
        if self._has_body():
            self._unread_body = self.close_connection = True

    def refuse_unread(self, status: int, message: str) -> None:
        """Refuse the request without reading its body (it is drained a little, then the connection closes)."""
        self._unread_body = self._has_body()
        self.reject(status, message)

    def read_body(self, required: bool) -> bytes | None:
        """The request's body, or None once the request was refused (411/400/413) or the client left.

        ``required``: a request without ``Content-Length`` is refused with 411 (else its body is empty)."""
        if self.headers.get("Transfer-Encoding"):
            self.refuse_unread(411, "send the body with a Content-Length header (chunked transfer encoding "
                                    "is not accepted)")
            return None
        values = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        if not values:
            if required:
                self.refuse_unread(411, "this request needs a body: send it with a Content-Length header")
                return None
            return b""
        text = values.pop()
        if values or not re.fullmatch(r"[0-9]{1,20}", text):
            self._unread_body, self.close_connection = True, True  # its length is unknown: nothing after it counts
            self.reject(400, "Content-Length must be one non-negative decimal integer "
                             f"(got {', '.join(sorted({text, *values}))[:100]!r})")
            return None
        length = int(text)
        if length > self.limits.max_body_bytes:
            self.refuse_unread(413, f"the request body is {length} bytes; the gateway takes at most "
                                    f"{self.limits.max_body_bytes} (limits.max_body_bytes)")
            return None
        if self.headers.get("Expect", "").lower() == "100-continue":
            self.connection.settimeout(self.limits.read_timeout_s)
            self.send_response_only(100)
            self.end_headers()
        self._unread_body = True  # until all of it is in: a timeout mid-body leaves the rest unread
        data = self.rfile.read(length) if length else b""
        if len(data) < length:  # the client closed mid-body: nobody to answer
            self.close_connection = True
            return None
        self._unread_body = False
        return data
