"""Idle and slow connections cannot take the server offline: a connection cap that closes the connection idle
longest (so idle sockets never lock out /health), a refusal in the route's protocol shape when every
connection serves a request, a header timeout against clients that trickle their headers, and a log that
stays small. Each waits for what the server does (a socket closed, a response), never a guessed time."""

import asyncio
import json
import logging
import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from server.connections import guarded_protocol
from server.settings import Settings, SettingsError
from tests.server_thread import ServerThread, tiny_settings

CAP = 64
IDLE_SOCKETS = 160
DEADLINE_S = 60  # a generous bound on anything the server must do here


@pytest.fixture(scope="module")
def capped(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir, max_connections=CAP, header_timeout=600)) as s:
        yield s


@pytest.fixture(scope="module")
def impatient(tiny_model_dir):
    settings = tiny_settings(
        tiny_model_dir, max_connections=2, header_timeout=0.5, keepalive_timeout=0.5, body_timeout=0.5
    )
    with ServerThread(settings) as s:
        yield s


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed sock (a read gives EOF or a reset); does not wait."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def _wait_closed(socks: list[socket.socket], count: int) -> list[socket.socket]:
    """Poll until the server has closed `count` of socks; returns those still open."""
    open_, closed = list(socks), 0
    deadline = time.monotonic() + DEADLINE_S
    while closed < count:
        assert time.monotonic() < deadline, f"the server closed {closed} of {count} connections"
        still = [s for s in open_ if not _closed_by_server(s)]
        closed += len(open_) - len(still)
        open_ = still
        time.sleep(0.01)
    return open_


def test_idle_connections_past_the_cap_never_lock_out_health(capped, caplog):
    caplog.set_level(logging.INFO)
    socks = [_connect(capped) for _ in range(IDLE_SOCKETS)]
    try:
        still_open = _wait_closed(socks, IDLE_SOCKETS - CAP)  # each past the cap closed the one idle longest
        assert len(still_open) == CAP and len(capped.server.server_state.connections) <= CAP
        assert socks[-1] in still_open and socks[0] not in still_open  # the oldest went first
        start = time.monotonic()
        r = httpx.get(capped.url + "/health", timeout=DEADLINE_S)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert time.monotonic() - start < 5  # generous: the acceptance bound is 1 s on an idle machine
        assert len(capped.server.server_state.connections) <= CAP
    finally:
        for s in socks:
            s.close()
    records = [r for r in caplog.records if r.name.startswith(("server", "uvicorn", "asyncio"))]
    assert len(records) < 5 and not any(r.exc_info for r in records), [r.getMessage() for r in records]


def _request(path: str, body: bytes = b"", declared: int | None = None) -> bytes:
    length = len(body) if declared is None else declared
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {length}\r\n\r\n".encode() + body


def _response(sock: socket.socket) -> tuple[int, dict, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode().lower()
    return next(int(line.split(": ")[1]) for line in head.split("\r\n") if line.startswith("content-length"))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_when_every_connection_serves_a_request_a_new_one_gets_a_protocol_shaped_503(
    impatient, path, monkeypatch
):
    released, step = threading.Event(), impatient.engine.step
    monkeypatch.setattr(impatient.engine, "step", lambda: released.wait(DEADLINE_S) and step())
    body = {"model": "tiny", "max_tokens": 2}
    body.update(
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    busy = [_connect(impatient) for _ in range(2)]
    try:
        for s in busy:  # whole requests the held engine is working on: being served, not waiting
            s.sendall(_request(path, json.dumps(body).encode()))
        _wait_for(lambda: len(impatient.server.server_state.connections) == 2 and not _waiting(impatient))
        with _connect(impatient) as extra:
            extra.sendall(_request(path, b"{}"))
            status, headers, answer = _response(extra)
        assert status == 503 and headers["retry-after"] == "1"
        if path == "/v1/messages":
            assert answer["type"] == "error" and answer["error"]["type"] == "overloaded_error"
            assert "MINIVLLM_MAX_CONNECTIONS" in answer["error"]["message"]
        else:
            assert (
                answer["error"]["type"] == "server_error"
                and "MINIVLLM_MAX_CONNECTIONS" in answer["error"]["message"]
            )
    finally:
        released.set()
        for s in busy:
            s.close()
    _wait_for(lambda: not impatient.server.server_state.connections)
    assert httpx.get(impatient.url + "/health", timeout=DEADLINE_S).status_code == 200


def _waiting(server) -> int:
    """Connections in the guard's book of those waiting (for headers, a body, or a next request)."""
    connections = list(server.server.server_state.connections)
    return len(type(connections[0]).waiting) if connections else 0


def test_stalled_bodies_past_the_cap_never_lock_out_health(capped):
    """Requests whose bodies stop half-way are not being served: past the cap the one stalled longest is
    closed, as an idle one would be (they once held the cap, and /health got 503 until they went)."""
    socks = [_connect(capped) for _ in range(IDLE_SOCKETS)]
    try:
        for s in socks:
            s.sendall(_request("/v1/chat/completions", b'{"model": ', declared=1000))
        still_open = _wait_closed(socks, IDLE_SOCKETS - CAP)
        assert len(still_open) == CAP and socks[0] not in still_open
        r = httpx.get(capped.url + "/health", timeout=DEADLINE_S)
        assert r.status_code == 200 and len(capped.server.server_state.connections) <= CAP
    finally:
        for s in socks:
            s.close()


def test_a_burst_of_connections_stays_within_the_cap():
    """Connections accepted in one go (the event loop calls their connection_made back to back, before any
    closed one is gone): each past the cap closes a different waiting one. They once all picked the same
    one, still closing, and a burst of thousands grew far past the cap."""

    async def burst() -> int:
        loop = asyncio.get_running_loop()
        config = uvicorn.Config(app=_never_called)
        config.load()
        state, guarded = ServerState(), guarded_protocol(max_connections=4, header_timeout=60)
        pairs = [socket.socketpair() for _ in range(20)]
        new = lambda: guarded(config=config, server_state=state, app_state={})  # noqa: E731
        await asyncio.gather(*(loop.connect_accepted_socket(new, ours) for ours, _ in pairs))
        while any(c.transport.is_closing() for c in state.connections):  # closed, connection_lost to come
            await asyncio.sleep(0)
        open_now = len(state.connections)
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
        return open_now

    assert asyncio.run(burst()) == 4


async def _never_called(scope, receive, send):
    raise AssertionError("no request was sent")


def test_a_body_that_stops_coming_is_answered_408_and_closed(impatient):
    with _connect(impatient) as s:
        s.sendall(_request("/v1/completions", b'{"model": ', declared=100))
        status, headers, body = _response(s)
        assert status == 408 and "MINIVLLM_BODY_TIMEOUT" in body["error"]["message"]
        assert headers["connection"] == "close"
        _wait_closed([s], 1)


def _wait_for(condition) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there"
        time.sleep(0.01)


def test_headers_that_never_finish_are_timed_out(impatient):
    """A client that connects and says nothing, and one that trickles its headers a byte at a time: both
    closed (the timer runs from the request's first wait, more bytes do not restart it)."""
    silent, slow = _connect(impatient), _connect(impatient)
    try:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        deadline = time.monotonic() + DEADLINE_S
        while not _closed_by_server(slow):
            assert time.monotonic() < deadline, "a trickled request was never timed out"
            if not select.select([slow], [], [], 0.05)[0]:
                slow.sendall(b"x")
        _wait_closed([silent], 1)
    finally:
        silent.close()
        slow.close()


def test_an_idle_keep_alive_connection_is_closed(impatient):
    with _connect(impatient) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, _, body = _response(s)
        assert status == 200 and body["status"] == "ok"
        _wait_closed([s], 1)


def test_connection_settings_are_checked():
    with pytest.raises(SettingsError, match="MINIVLLM_MAX_CONNECTIONS"):
        Settings.from_env({"MINIVLLM_MAX_CONNECTIONS": "0"})
    with pytest.raises(SettingsError, match="MINIVLLM_HEADER_TIMEOUT"):
        Settings.from_env({"MINIVLLM_HEADER_TIMEOUT": "0"})
    with pytest.raises(SettingsError, match="MINIVLLM_BODY_TIMEOUT"):
        Settings.from_env({"MINIVLLM_BODY_TIMEOUT": "0"})
    s = Settings.from_env({"MINIVLLM_MAX_CONNECTIONS": "64", "MINIVLLM_KEEPALIVE_TIMEOUT": "2.5"})
    assert (s.max_connections, s.keepalive_timeout) == (64, 2.5)
