"""common/http_limits.py on P's real bootstrap server (upstream's app with its
/register and /query, uvicorn, real sockets): a connection without a complete
request's headers, or whose body trickles, is closed at its deadline; a body
above the cap is refused before it is read; at most max_connections are open,
and a flood from one address leaves room for the others; a whole request is
served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext import vllm_compat
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.http_limits import (
    LimitedH11Protocol,
)

DEADLINE_S = 0.5
FLOOD_ADDRESS = "127.0.0.2"  # loopback too, but another address than the peer's
REGISTER = json.dumps(
    {"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://a:1"}
).encode()


@pytest.fixture
def start_server():
    """Starts P's bootstrap server (attributes set on it first); stops them all."""
    started = []

    def start(**attrs):
        srv = vllm_compat.bootstrap_server(None, "127.0.0.1", 0)
        for name, value in attrs.items():
            setattr(srv, name, value)
        srv.start(timeout=10)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.shutdown()


@pytest.fixture
def server(monkeypatch, start_server):
    """P's bootstrap server with a short header deadline and room for 4 connections."""
    monkeypatch.setattr(LimitedH11Protocol, "header_deadline_s", DEADLINE_S)
    monkeypatch.setattr(LimitedH11Protocol, "max_connections", 4)
    return start_server()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(
        ("127.0.0.1", port), timeout=5, source_address=(source, 0)
    )
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


def closed_now(s: socket.socket) -> bool:
    """The server has closed ``s`` (EOF or reset; an answer waiting counts as open)."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def answer(s: socket.socket, seconds: float = 5) -> bytes:
    """What the server sends until it closes ``s`` or is silent for ``seconds``."""
    s.settimeout(seconds)
    out = b""
    with contextlib.suppress(OSError):  # a reset or a silence ends the answer
        while chunk := s.recv(4096):
            out += chunk
    return out


def query(port: int, source: str = "127.0.0.1") -> bytes:
    """GET /query's answer, b"" if the connection was closed or reset without one."""
    try:
        s = connect(port, source)
    except OSError:
        return b""
    with s:
        with contextlib.suppress(OSError):
            s.sendall(b"GET /query HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n")
        return answer(s)


def post_head(path: str, length: int | None, chunked: bool = False) -> bytes:
    framing = (
        b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % length
    )
    return (
        b"POST %s HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n%s\r\n\r\n"
        % (path.encode(), framing)
    )


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


def test_a_body_trickled_a_byte_at_a_time_is_cut_at_the_body_deadline(
    monkeypatch, start_server
):
    monkeypatch.setattr(LimitedH11Protocol, "header_deadline_s", DEADLINE_S)
    monkeypatch.setattr(LimitedH11Protocol, "body_deadline_s", 1.0)
    srv = start_server()
    with connect(srv.port) as s:
        s.sendall(post_head("/register", len(REGISTER)) + REGISTER[:1])
        t0 = time.monotonic()
        for byte in REGISTER[1:-1]:  # one byte every 0.2 s: never the last
            if closed_now(s):
                break
            with contextlib.suppress(OSError):
                s.sendall(bytes([byte]))
            time.sleep(0.2)
            if time.monotonic() - t0 > 6:
                break
        took = time.monotonic() - t0
        assert closed_now(s), f"a trickled body kept its connection {took:.1f} s"
        assert 0.8 < took < 3, f"closed after {took:.1f} s, not at the body deadline"


def test_a_whole_request_is_answered_however_long_the_answer_takes(
    monkeypatch, start_server
):
    monkeypatch.setattr(LimitedH11Protocol, "header_deadline_s", DEADLINE_S)
    monkeypatch.setattr(LimitedH11Protocol, "body_deadline_s", DEADLINE_S)
    srv = vllm_compat.bootstrap_server(None, "127.0.0.1", 0)

    @srv.app.post("/slow")
    async def slow() -> dict[str, bool]:
        await asyncio.sleep(4 * DEADLINE_S)
        return {"ok": True}

    srv.start(timeout=10)
    try:
        with connect(srv.port) as s:
            s.sendall(post_head("/slow", 2) + b"{}")
            assert answer(s, 10).startswith(b"HTTP/1.1 200")
    finally:
        srv.shutdown()


def test_a_flood_from_one_address_leaves_room_for_another_and_ends_at_the_body_deadline(
    monkeypatch, start_server
):
    """MAX_CONNECTIONS connections from one address send a /register request's
    headers and trickle its body: a /query from another address is still
    answered, and every trickling connection is closed by the body deadline."""
    body_deadline_s = 2.0
    monkeypatch.setattr(LimitedH11Protocol, "header_deadline_s", 1.0)
    monkeypatch.setattr(LimitedH11Protocol, "body_deadline_s", body_deadline_s)
    srv = start_server()
    flood: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for _ in range(LimitedH11Protocol.max_connections):
            s = connect(srv.port, FLOOD_ADDRESS)
            with contextlib.suppress(OSError):
                s.sendall(post_head("/register", 1000) + b"{")
            flood.append(s)
        per_address = LimitedH11Protocol.max_connections_per_address
        kept = list(flood)
        # closed at once: within 10 s even on a loaded machine
        while len(kept) > per_address and time.monotonic() - t0 < 10.0:
            time.sleep(0.05)  # those beyond the address's room are closed at once
            kept = [s for s in kept if not closed_now(s)]
        got = query(srv.port)
        assert got.startswith(b"HTTP/1.1 200"), (
            f"{len(kept)} connections from {FLOOD_ADDRESS} kept /query from "
            f"127.0.0.1 out: {got[:60]!r}"
        )
        assert len(kept) <= per_address, f"{len(kept)} kept from {FLOOD_ADDRESS}"
        while kept and time.monotonic() - t0 < body_deadline_s + 15:
            for s in list(kept):  # a byte each, every 0.5 s
                with contextlib.suppress(OSError):
                    s.sendall(b" ")
                if closed_now(s):
                    kept.remove(s)
            time.sleep(0.5)
        took = time.monotonic() - t0
        assert not kept, f"{len(kept)} trickling connections open after {took:.1f} s"
    finally:
        for s in flood:
            s.close()
    assert query(srv.port, FLOOD_ADDRESS).startswith(b"HTTP/1.1 200")


def test_a_declared_body_above_the_cap_is_answered_413_before_it_is_read(
    start_server,
):
    cap = 100_000
    srv = start_server(max_body_bytes=cap)
    with connect(srv.port) as s:  # the body is never sent: 413 comes without it
        s.sendall(post_head("/register", cap + 1))
        got = answer(s, 3)
        assert got.startswith(b"HTTP/1.1 413"), got[:80]
        assert b"at most 100000" in got
    with connect(srv.port) as s:  # a body at the cap reaches upstream's route
        s.sendall(post_head("/register", cap) + REGISTER.ljust(cap))
        got = answer(s, 3)
        assert got.startswith(b"HTTP/1.1 200"), got[:200]


def test_a_chunked_body_growing_past_the_cap_is_cut(start_server):
    cap = 100_000
    srv = start_server(max_body_bytes=cap)
    chunk = b"%x\r\n%s\r\n" % (16384, b" " * 16384)
    with connect(srv.port) as s:
        s.sendall(post_head("/register", None, chunked=True) + b"4000\r\n")
        s.sendall(REGISTER.ljust(16384) + b"\r\n")
        with contextlib.suppress(OSError):  # the server may reset it meanwhile
            for _ in range(4 * cap // 16384):
                s.sendall(chunk)
            s.sendall(b"0\r\n\r\n")
        got = answer(s, 5)
        assert not got.startswith(b"HTTP/1.1 200") and not got.startswith(
            b"HTTP/1.1 4"
        ), f"a chunked body of {4 * cap} bytes was read whole: {got[:80]!r}"
        assert closed_now(s)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_300_mib_register_body_is_refused_and_the_server_does_not_grow(
    start_server,
):
    """Content-Length: 314572800, streamed from a 64 KiB buffer: the server (this
    process) answers 413 or closes, and its RSS grows by a few MiB at most."""
    srv = start_server()  # the cap from this process's configuration
    total, block = 300 << 20, b" " * (64 << 10)
    peak = [rss_kib()]
    before = peak[0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss_kib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    sent = 0
    try:
        with connect(srv.port) as s:
            s.settimeout(60)
            s.sendall(post_head("/register", total))
            with contextlib.suppress(OSError):  # refused: reset while sending
                while sent < total:
                    s.sendall(block)
                    sent += len(block)
            got = answer(s, 10)
    finally:
        done.set()
        sampler.join(5)
    grew_mib = (peak[0] - before) / 1024
    print(f"sent {sent >> 20} MiB, answer {got[:40]!r}, RSS grew {grew_mib:.1f} MiB")
    assert got.startswith(b"HTTP/1.1 413") or (got == b"" and sent < total), got[:80]
    assert grew_mib < 8, f"the server's RSS grew by {grew_mib:.0f} MiB"
