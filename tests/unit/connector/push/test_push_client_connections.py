"""D's kept connections to a source: one idle past KEEPALIVE_EXPIRY_S is not used
again. A source that closed an idle connection while the link was cut may never
have its close reach D (the kernel gave up on the orphaned connection first);
D's next call on it failed ("Server disconnected without sending a response")."""

from __future__ import annotations

import socket
import threading
import time

import httpcore
import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import (
    peer_client,
)

ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
)


class ForgetfulSource:
    """Answers the first request on each connection and keeps it open; a second
    request on the same connection is dropped unanswered, as a source whose close
    of that connection was lost would (its kernel answers with a reset)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn, conn.makefile("rb") as requests:
            for answered in (False, True):
                length = 0
                for line in iter(requests.readline, b"\r\n"):  # the request's head
                    if not line:
                        return
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                requests.read(length)
                if answered:
                    return  # the second request: dropped
                conn.sendall(ANSWER)


@pytest.fixture
def source():
    s = ForgetfulSource()
    yield s
    s.sock.close()


def post(client, port):
    return client.post(
        f"http://127.0.0.1:{port}/match_blocks",
        b"{}",
        {"content-type": "application/json"},
        time.monotonic() + 5,
    )


def test_a_connection_idle_past_the_expiry_is_not_used_again(source):
    client = peer_client._SourceClient(1, 1 << 20, tls=False)
    try:
        assert post(client, source.port).status == 200
        time.sleep(peer_client.KEEPALIVE_EXPIRY_S + 0.5)
        assert post(client, source.port).status == 200
        assert source.connections == 2
    finally:
        client.close()


def test_the_expiry_is_below_the_sources_idle_close():
    # uvicorn closes a kept connection after 5 s idle (timeout_keep_alive)
    assert 0 < peer_client.KEEPALIVE_EXPIRY_S < 5


def test_without_the_expiry_the_kept_connection_fails_the_next_call(
    source, monkeypatch
):
    """The hazard the expiry removes (httpcore keeps connections for ever)."""
    monkeypatch.setattr(peer_client, "KEEPALIVE_EXPIRY_S", None)
    client = peer_client._SourceClient(1, 1 << 20, tls=False)
    try:
        assert post(client, source.port).status == 200
        time.sleep(0.2)
        with pytest.raises(httpcore.RemoteProtocolError):
            post(client, source.port)
    finally:
        client.close()
