"""connector/prefill_bootstrap.py: P's bootstrap server starts, or fails within a
deadline naming its address, on every release (upstream's own start waits for ever
up to 0.18.1 when the port is taken)."""

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
