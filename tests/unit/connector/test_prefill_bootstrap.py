"""connector/prefill_bootstrap.py: P's bootstrap server starts, or fails within a
deadline naming its address, on every release (upstream's own start waits for ever
up to 0.18.1 when the port is taken), and admits request bodies up to the largest
one of its routes accepts."""

import json
import socket
import threading
import urllib.request

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext import vllm_compat
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.prefill_bootstrap import (
    PORT_ENV,
    BootstrapServerStartError,
    PrefillBootstrapServer,
)

# the longest a start may take here: the server is local and its port is known
BOUND_S = 10.0


@pytest.fixture
def held_port():
    """A port something else listens on."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


def start_in_thread(server, **kwargs) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run():
        try:
            server.start(**kwargs)
            outcome.append("started")
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, outcome


def test_a_taken_port_fails_the_start_at_once_naming_the_address(held_port):
    server = vllm_compat.bootstrap_server(None, "127.0.0.1", held_port)
    assert isinstance(server, PrefillBootstrapServer)
    t, outcome = start_in_thread(server)
    t.join(BOUND_S)
    assert not t.is_alive(), f"start() still waiting after {BOUND_S}s"
    [error] = outcome
    assert isinstance(error, BootstrapServerStartError), error
    assert f"127.0.0.1:{held_port}" in str(error) and PORT_ENV in str(error)
    server.shutdown()  # nothing started: a no-op, not an error


def test_a_free_port_serves_upstreams_routes_and_stops():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    server = vllm_compat.bootstrap_server(None, "127.0.0.1", port)
    t, outcome = start_in_thread(server)
    t.join(BOUND_S)
    assert outcome == ["started"]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/query", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read()) == {}
    finally:
        server.shutdown()
    with socket.create_server(("127.0.0.1", port)):  # the port is free again
        pass


def test_a_start_that_never_completes_ends_at_the_deadline(monkeypatch):
    """uvicorn hangs before it says it started: start() gives up at its deadline."""
    import uvicorn

    release = threading.Event()

    def hang(self, sockets=None):
        release.wait(30)

    monkeypatch.setattr(uvicorn.Server, "run", hang)
    server = vllm_compat.bootstrap_server(None, "127.0.0.1", 0)
    t, outcome = start_in_thread(server, timeout=0.5)
    t.join(BOUND_S)
    release.set()
    assert not t.is_alive()
    [error] = outcome
    assert isinstance(error, BootstrapServerStartError), error


def register_status(port: int, length: int) -> bytes:
    """The status line of a POST /register whose body (upstream's payload padded
    with spaces) is ``length`` bytes; b"" if the connection was closed without one."""
    payload = json.dumps(
        {"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "a"}
    ).encode()
    head = (
        b"POST /register HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % length
    )
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(head + payload.ljust(length))
            while chunk := s.recv(4096):
                out += chunk
        except OSError:  # refused: reset while sending or reading
            pass
    return out.split(b"\r\n", 1)[0]


def test_bodies_are_admitted_up_to_the_largest_a_route_accepts_and_no_larger(
    monkeypatch,
):
    """The server's body cap comes from the configuration: a push's largest
    body (push_max_body_bytes) is admitted, on upstream's /register too; one
    byte more is refused before any route reads it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext import (
        prefill_bootstrap,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
        ExtConfig,
    )

    config = ExtConfig(push_max_tokens=100)  # 64 KiB + 4,800 bytes
    monkeypatch.setattr(prefill_bootstrap, "load", lambda: config, raising=False)
    cap = config.push_max_body_bytes
    server = vllm_compat.bootstrap_server(None, "127.0.0.1", 0)
    server.start(timeout=BOUND_S)
    try:
        assert register_status(server.port, cap) == b"HTTP/1.1 200 OK"
        refused = register_status(server.port, cap + 1)
        assert refused in (b"HTTP/1.1 413 Request Entity Too Large", b""), refused
    finally:
        server.shutdown()


def test_the_body_cap_is_at_least_every_routes_own():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
        ExtConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.prefill_bootstrap import (
        UPSTREAM_MAX_BODY_BYTES,
        largest_body_bytes,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_server import (
        PROOF_MAX_BODY_BYTES,
    )

    for tokens in (1, 100, 131072, 1 << 20):
        config = ExtConfig(push_max_tokens=tokens)
        cap = largest_body_bytes(config)
        assert cap >= config.push_max_body_bytes, tokens
        assert cap >= max(PROOF_MAX_BODY_BYTES, UPSTREAM_MAX_BODY_BYTES), tokens
