"""C checks a signed request's header before it reads a byte of its body.

The signature covers the body's SHA-256, which the header names (``b=``): a
caller without the secret is refused as soon as its headers are in, however
large a body it announces, so it cannot make the worker that holds the model
and the KV cache read and keep megabytes. A signed body must then arrive whole
within BODY_READ_DEADLINE_S and hash to the signed value. C is routes.py over
HTTP on 127.0.0.1 (helpers.CServer); the callers here speak raw HTTP."""

from __future__ import annotations

import socket
import time

from helpers import TOKEN, TOKENS
from test_push_credentials import C_CONFIG

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext import routes
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import auth
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)

ANNOUNCED = 6_000_000  # bytes a caller says it will send


def raw_post(port: int, authorization: str, announced: int, sent: bytes):
    """A POST /push_blocks whose body is announced at ``announced`` bytes but only
    ``sent`` goes out; the open socket (the caller keeps it open)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        (
            "POST /push_blocks HTTP/1.1\r\nhost: c\r\n"
            "content-type: application/json\r\n"
            f"authorization: {authorization}\r\ncontent-length: {announced}\r\n\r\n"
        ).encode()
        + sent
    )
    return s


def status_within(s: socket.socket, seconds: float) -> int | None:
    s.settimeout(seconds)
    try:
        head = s.recv(64)
    except TimeoutError:
        return None
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else None


def test_a_forged_signature_is_refused_before_the_body_is_read(c_server):
    # the default body cap (6.3 MB): the announced body is within it
    c = c_server(ExtConfig(bootstrap_host="127.0.0.1", bootstrap_token=TOKEN))
    assert c.config.push_max_body_bytes > ANNOUNCED
    forged = auth.sign("not-the-token", "POST", "/push_blocks", b"{}")
    s = raw_post(c.port, forged, ANNOUNCED, b"{" + b" " * 1000)
    try:
        got = status_within(s, 3.0)
    finally:
        s.close()
    assert got == 401, (
        "C waited for the announced body of a caller without the secret instead of "
        f"refusing it at its headers (status {got})"
    )


def test_a_signed_body_must_arrive_whole_in_time(c_server, monkeypatch):
    monkeypatch.setattr(routes, "BODY_READ_DEADLINE_S", 1.0)
    c = c_server(ExtConfig(**C_CONFIG))
    body = b'{"token_ids": [1, 2, 3]}'
    signed = auth.sign(TOKEN, "POST", "/push_blocks", body)
    s = raw_post(c.port, signed, len(body), body[:5])  # the rest never comes
    t0 = time.monotonic()
    try:
        got = status_within(s, 5.0)
    finally:
        s.close()
    assert got == 408 and time.monotonic() - t0 < 3.0, got


def test_a_body_other_than_the_signed_one_is_refused(c_server):
    c = c_server(ExtConfig(**C_CONFIG))
    signed = auth.sign(TOKEN, "POST", "/match_blocks", b'{"token_ids": [1]}')
    r = c.http.post(
        "/match_blocks",
        content=f'{{"token_ids": {TOKENS}}}'.encode(),
        headers={"authorization": signed, "content-type": "application/json"},
    )
    assert r.status_code == 401 and "not the one that was signed" in r.text, r.text
    assert len(auth.parse_signed(signed)) == 4  # t, n, b, s
