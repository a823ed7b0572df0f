"""common/http_limits.py on P's real bootstrap server (uvicorn, real sockets):
a connection without a complete request's headers is closed at the deadline, at
most max_connections are open, and a request whose headers arrived is served."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext import vllm_compat
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.http_limits import (
    LimitedH11Protocol,
)

DEADLINE_S = 0.5


@pytest.fixture
def server(monkeypatch):
    """P's bootstrap server with a short header deadline and room for 4 connections."""
    monkeypatch.setattr(LimitedH11Protocol, "header_deadline_s", DEADLINE_S)
    monkeypatch.setattr(LimitedH11Protocol, "max_connections", 4)
    srv = vllm_compat.bootstrap_server(None, "127.0.0.1", 0)
    srv.start(timeout=10)
    yield srv
    srv.shutdown()


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.settimeout(5)
    return s


def closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``s`` (EOF or reset), None if it did not."""
    t0 = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def query(port: int) -> bytes:
    with connect(port) as s:
        s.sendall(b"GET /query HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n")
        out = b""
        while chunk := s.recv(4096):
            out += chunk
        return out


def test_a_connection_that_never_completes_its_headers_is_closed(server):
    idle = connect(server.port)
    slow = connect(server.port)
    slow.sendall(b"GET /query HTTP/1.1\r\nHost: p\r\n")  # and never the end
    for s in (idle, slow):
        took = closed_within(s, DEADLINE_S + 3)
        assert took is not None, "a connection without a request stayed open"
        s.close()
    assert query(server.port).startswith(b"HTTP/1.1 200")


def test_after_a_response_the_next_requests_headers_have_the_same_deadline(server):
    with connect(server.port) as s:
        s.sendall(b"GET /query HTTP/1.1\r\nHost: p\r\n\r\n")  # kept alive
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /query HTTP/1.1\r\n")  # then a trickle
        assert closed_within(s, DEADLINE_S + 7) is not None


def test_connections_beyond_the_cap_are_closed_and_served_again_later(server):
    held = [connect(server.port) for _ in range(4)]
    try:
        time.sleep(0.1)
        extra = connect(server.port)
        took = closed_within(extra, 2)
        assert took is not None and took < 1, "a connection beyond the cap was kept"
        extra.close()
    finally:
        for s in held:
            with contextlib.suppress(OSError):
                s.close()
    time.sleep(0.2)
    assert query(server.port).startswith(b"HTTP/1.1 200")
