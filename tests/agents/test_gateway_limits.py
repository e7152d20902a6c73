"""The gateway's HTTP bounds over real loopback sockets: the key before the body, strict Content-Length, the body
cap, read deadlines, the bounded handler pool, OpenAI-style checks of sampling fields, and a load test in which
well-behaved agents are all served while hostile clients hammer the gateway."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent_fixtures import TURN1, TURN2, chat_model, serve_gateway, tok  # noqa: F401 (fixtures)
from rlpipe.agents.http_guard import GatewayLimits
from rlpipe.agents.programs import calculator_client, chat_completion

KEY = "limits-key"
READ_S, IDLE_S = 1.0, 0.5
LIMITS = GatewayLimits(max_body_bytes=4096, read_timeout_s=READ_S, keepalive_timeout_s=IDLE_S, max_handlers=8)
OK = {"model": "rlpipe-policy", "messages": [{"role": "user", "content": "12*3="}]}
PATH = "/v1/chat/completions"


@pytest.fixture
def gw(serve_gateway):
    return serve_gateway(api_key=KEY, default_max_tokens=12, limits=LIMITS)


def head(*lines: str, key: str | None = KEY) -> bytes:
    """A request head: the request line and header lines given, the key (unless None), the blank line."""
    auth = [f"Authorization: Bearer {key}"] if key else []
    return "\r\n".join([f"POST {PATH} HTTP/1.1", "Host: 127.0.0.1", *auth, *lines, "", ""]).encode()


def exchange(gateway, data: bytes, trickle: bytes = b"", trickle_s: float = 0.02, limit_s: float = 10.0):
    """Send ``data`` on a fresh loopback connection, then ``trickle`` a byte per ``trickle_s`` until the gateway
    answers, and read the answer: ``(status or None if the connection was closed unanswered, headers, JSON body
    or None, seconds)``. Every step is bounded by ``limit_s``."""
    host, port = gateway._server.server_address[:2]
    start = time.monotonic()
    sock = socket.create_connection((host, port), timeout=limit_s)
    try:
        try:
            sock.sendall(data)
            for i in range(len(trickle)):
                if select.select([sock], [], [], 0)[0] or time.monotonic() - start > limit_s:
                    break  # the gateway answered (or closed): stop sending, read it
                sock.sendall(trickle[i:i + 1])
                time.sleep(trickle_s)
        except OSError:
            pass  # the gateway closed its side while we sent: its answer (if any) is still readable
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
            raw = response.read()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return None, {}, None, time.monotonic() - start
        body = json.loads(raw) if raw else None
        return response.status, dict(response.getheaders()), body, time.monotonic() - start
    finally:
        sock.close()


def post(gateway, payload: dict, key: str | None = KEY) -> tuple[int, dict]:
    data = json.dumps(payload).encode()
    status, _, body, _ = exchange(gateway, head(f"Content-Length: {len(data)}", "Connection: close", key=key) + data)
    return status, body


# -- status codes ----------------------------------------------------------------------------------------------


def test_the_key_is_checked_before_the_body_is_read(gw):
    for key in (None, "wrong"):  # a 10 GB body announced without the key: refused at once, nothing read
        status, headers, body, seconds = exchange(gw, head("Content-Length: 10000000000", key=key) + b"{")
        assert status == 401 and seconds < 1.0 and headers["Connection"] == "close"
        assert body["error"]["type"] == "authentication_error" and "API key" in body["error"]["message"]
    assert post(gw, OK)[0] == 200


@pytest.mark.parametrize("value", ["abc", "-1", "+5", "1e3", " ", "5, 5", "99999999999999999999999"])
def test_a_malformed_content_length_is_400(gw, value):
    status, headers, body, seconds = exchange(gw, head(f"Content-Length: {value}") + b"{}")
    assert status == 400 and seconds < 1.0 and headers["Connection"] == "close"
    assert "Content-Length must be one non-negative decimal integer" in body["error"]["message"]


def test_conflicting_content_lengths_are_400_a_missing_one_411(gw):
    assert exchange(gw, head("Content-Length: 2", "Content-Length: 3") + b"{}")[0] == 400
    status, _, body, _ = exchange(gw, head() + b"{}")
    assert status == 411 and "Content-Length" in body["error"]["message"]
    assert exchange(gw, head("Transfer-Encoding: chunked") + b"2\r\n{}\r\n0\r\n\r\n")[0] == 411
    # ending a session takes no body: no Content-Length is fine there
    data = f"POST /v1/sessions/x/end HTTP/1.1\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n"
    assert exchange(gw, data.encode())[:1] == (200,)


def test_a_body_over_the_cap_is_413_unread(gw):
    status, headers, body, seconds = exchange(gw, head("Content-Length: 4097", "Expect: 100-continue"))
    assert status == 413 and seconds < 1.0 and headers["Connection"] == "close"  # no 100 Continue, no body waited for
    assert "limits.max_body_bytes" in body["error"]["message"]
    padded = json.dumps({**OK, "pad": "x" * (4096 - len(json.dumps(OK)) - 11)}).encode()
    assert len(padded) <= 4096 and post(gw, json.loads(padded))[0] == 200  # at the cap: served


def test_a_slow_client_gets_408_and_an_idle_one_is_closed(gw):
    # headers trickled a byte per 50 ms: the deadline runs from the first byte, trickling does not extend it
    status, _, body, seconds = exchange(gw, b"", head("X-Pad: " + "a" * 200), trickle_s=0.05)
    assert status == 408 and READ_S <= seconds < READ_S + 1.0 and "limits.read_timeout_s" in body["error"]["message"]
    # the body trickled the same way
    data = json.dumps(OK).encode()
    status, _, _, seconds = exchange(gw, head(f"Content-Length: {len(data)}"), data, trickle_s=0.05)
    assert status == 408 and READ_S <= seconds < READ_S + 1.0
    # a connection that never sends is closed quietly after the keep-alive timeout
    status, _, _, seconds = exchange(gw, b"")
    assert status is None and IDLE_S <= seconds < IDLE_S + 1.0
    assert post(gw, OK)[0] == 200  # every handler was freed


def test_the_handler_pool_is_bounded_and_waiting_connections_are_served(serve_gateway):
    limits = GatewayLimits(read_timeout_s=READ_S, keepalive_timeout_s=IDLE_S, max_handlers=2)
    gateway = serve_gateway(api_key=KEY, default_max_tokens=12, limits=limits)
    host, port = gateway._server.server_address[:2]
    idle = [socket.create_connection((host, port), timeout=5) for _ in range(2)]  # both handlers taken
    try:
        start = time.monotonic()
        reply = chat_completion(gateway.base_url, KEY, OK["messages"], timeout=10)  # waits, is not refused
        assert reply["choices"][0]["message"]["content"] == TURN1
        assert IDLE_S * 0.8 <= time.monotonic() - start < IDLE_S + 2.0  # served once an idle handler timed out
        assert gateway.peak_handlers == 2
    finally:
        for s in idle:
            s.close()


def test_unknown_routes_are_404_before_the_body(gw):
    status, headers, body, _ = exchange(gw, head("Content-Length: 10000000").replace(PATH.encode(), b"/v1/nope"))
    assert status == 404 and headers["Connection"] == "close" and body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 1.5), ("max_tokens", True), ("max_completion_tokens", 0),
    ("temperature", -3), ("temperature", 2.5), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5),
    ("n", 0), ("n", 2), ("stop", 3), ("stop", ["a", "b", "c", "d", "e"]), ("stop", ["a", 1]), ("seed", 2**64),
])
def test_sampling_fields_are_refused_as_openai_refuses_them(gw, field, value):
    status, body = post(gw, {**OK, field: value})
    assert status == 400
    assert body["error"]["param"] == field and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] is None and f"`{field}`" in body["error"]["message"]


def test_edge_values_of_the_sampling_fields_are_served(gw):
    for fields in ({"temperature": 0, "top_p": 1, "n": 1, "stop": "x"}, {"temperature": 2, "stop": ["a"] * 4},
                   {"max_tokens": 1, "top_p": 0.5, "seed": -1}, {"max_tokens": None, "stop": None}):
        status, body = post(gw, {**OK, **fields})
        assert status == 200, (fields, body)
    status, body = post(gw, {**OK, "max_tokens": 1})
    assert body["usage"]["completion_tokens"] == 1  # max_tokens is honoured, never replaced by the default


def test_deeply_nested_or_huge_json_is_400(serve_gateway):
    gateway = serve_gateway(api_key=KEY, limits=GatewayLimits(max_body_bytes=1 << 16))
    for raw in (b"[" * 30000 + b"]" * 30000, b'{"messages": ' + b"9" * 5000 + b"}"):
        status, _, body, _ = exchange(gateway, head(f"Content-Length: {len(raw)}") + raw)
        assert status == 400 and "not valid JSON" in body["error"]["message"]


# -- load: hostile clients hammering while well-behaved agents work -----------------------------------------------

HOSTILE = [  # (name, bytes sent at once, bytes trickled 1 per 20 ms, the statuses it may get: None = closed unanswered)
    ("oversized", head("Content-Length: 10000000000") + b"{", b"", {413}),
    ("no key, oversized", head("Content-Length: 10000000000", key=None) + b"{", b"", {401}),
    ("wrong key", head("Content-Length: 2", key="wrong") + b"{}", b"", {401}),
    ("junk length", head("Content-Length: abc") + b"{}", b"", {400}),
    ("negative length", head("Content-Length: -1") + b"{}", b"", {400}),
    ("no length", head() + b"{}", b"", {411}),
    ("slow headers", b"", head("X-Pad: " + "a" * 400), {408, None}),
    ("slow body", head("Content-Length: 400"), b"{" * 400, {408, None}),
    ("silent", b"", b"", {None}),
]


def test_well_behaved_sessions_are_all_served_while_hostile_clients_hammer(tok, serve_gateway):
    limits = GatewayLimits(max_body_bytes=4096, read_timeout_s=READ_S, keepalive_timeout_s=IDLE_S, max_handlers=32)
    gateway = serve_gateway(api_key=KEY, default_max_tokens=12, limits=limits)
    done = threading.Event()
    outcomes: list[tuple[str, int | None, float]] = []

    def hostile(k: int) -> None:
        name, data, trickle, _ = HOSTILE[k % len(HOSTILE)]
        for _ in range(40):  # bounded: at most 40 attacks each, and only while the agents work
            status, _, _, seconds = exchange(gateway, data, trickle)
            outcomes.append((name, status, seconds))
            if done.is_set():
                return

    def agent(i: int):
        calculator_client(gateway.session_url(f"agent-{i}"), KEY, "12*3=", max_turns=3)
        return gateway.end_session(f"agent-{i}")

    start = time.monotonic()
    with ThreadPoolExecutor(20) as attackers, ThreadPoolExecutor(50) as agents:
        attacks = [attackers.submit(hostile, k) for k in range(20)]
        time.sleep(0.2)  # the attack is under way before the agents start
        sessions = [f.result(timeout=15) for f in [agents.submit(agent, i) for i in range(50)]]
        done.set()
        for f in attacks:
            f.result(timeout=10)
    elapsed = time.monotonic() - start

    eos = tok.eos_token_id
    expected = tok.encode(TURN1) + [eos] + tok.encode("\nT:36\nA:") + tok.encode(TURN2) + [eos]
    for session in sessions:  # every agent's whole episode, token for token, in its own session
        assert session.turns == 2 and session.current.ids == expected
    allowed = {name: statuses for name, _, _, statuses in HOSTILE}
    for name, status, seconds in outcomes:  # each answered rightly, within its deadline plus a wait for a handler
        assert status in allowed[name], (name, status)
        assert seconds < (READ_S + IDLE_S + 2.5 if allowed[name] & {408, None} else 2.5), (name, status, seconds)
    assert {name for name, _, _ in outcomes} == set(allowed)  # every kind of attack ran
    assert gateway.peak_handlers <= 32 and elapsed < 15, (gateway.peak_handlers, elapsed)


def test_a_handler_pool_smaller_than_the_program_pool_is_refused_before_anything_runs():
    from pydantic import ValidationError

    from rlpipe.agents.config import GatewayAgentParams

    with pytest.raises(ValidationError, match="gateway.limits.max_handlers=8 is below gateway.workers=16"):
        GatewayAgentParams(limits={"max_handlers": 8})
    assert GatewayAgentParams(workers=8, limits={"max_handlers": 8}).limits.max_handlers == 8
