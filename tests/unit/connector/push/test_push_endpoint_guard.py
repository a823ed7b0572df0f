"""The bootstrap server's guard (EndpointGuard) on every route of this series:
the token, loopback, a closed bind, the insecure opt-out, the read key.

In-process HTTP (uvicorn on 127.0.0.1 in a thread); no vLLM instance.
"""

from __future__ import annotations

import hmac
from types import SimpleNamespace

import pytest
from helpers import (
    AUTH,
    BLEN,
    D_SESSION,
    READ,
    SLOTS,
    TOKEN,
    TOKENS,
    assert_push_ok,
    push_body,
)

from harness.pd_client import bootstrap_headers
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import auth
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    EndpointGuard,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
    is_loopback,
)


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1", "10.1.2.3"])
@pytest.mark.parametrize("insecure", [False, True])
def test_token_is_required_when_set(host, insecure):
    g = EndpointGuard(
        ExtConfig(
            bootstrap_token=TOKEN, bootstrap_host=host, bootstrap_insecure=insecure
        )
    )
    assert g.check(f"Bearer {READ}") is None
    assert g.check(f"bearer {READ}") is None  # the scheme is case-insensitive
    for header in [
        None,
        "",
        READ,
        f"Bearer {TOKEN}",  # the signing key itself is never a bearer key
        f"Bearer {auth.read_key(TOKEN + 'x')}",
        "Bearer",
        "Bearer ",
        f"Basic {READ}",
        f"Token {READ}",
        f"Bearer {READ[:-1]}",
        f"Bearer {READ}x",
        f"Bearer x{READ}",
        f"Bearer {READ.upper()}",
        f"Bearer  {READ}",
        f"Bearer {READ} ",
        f"Bearer {READ} {READ}",
        "Bearer wrong",
        "Bearer \u00e9t\u00e9",
    ]:
        denied = g.check(header)
        assert denied is not None and denied[0] == 401, (header, denied)
        assert TOKEN not in denied[1] and READ not in denied[1]  # nor echoes them


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.8.9.10", "localhost", "::1", "[::1]"]
)
def test_no_token_on_loopback_is_open(host):
    assert is_loopback(host)
    g = EndpointGuard(ExtConfig(bootstrap_host=host))
    for header in [None, "", "Bearer anything", "garbage"]:
        assert g.check(header) is None


@pytest.mark.parametrize(
    "host",
    [
        "0.0.0.0",
        "::",
        "10.1.2.3",
        "192.168.0.7",
        "example.com",
        "127.example.com",
        "localhost.evil",
    ],
)
def test_no_token_on_another_bind_is_closed(host):
    assert not is_loopback(host)
    g = EndpointGuard(ExtConfig(bootstrap_host=host))
    for header in [None, "", f"Bearer {TOKEN}", "Bearer "]:
        denied = g.check(header)
        assert denied is not None and denied[0] == 403, (host, header, denied)
        assert "MOONCAKE_BOOTSTRAP_TOKEN" in denied[1] and host in denied[1]
    # the explicit opt-out for a trusted network
    assert (
        EndpointGuard(ExtConfig(bootstrap_host=host, bootstrap_insecure=True)).check(
            None
        )
        is None
    )


def test_guard_from_the_environment():
    closed = EndpointGuard(ExtConfig.from_env({"MOONCAKE_BOOTSTRAP_TOKEN": ""}))
    assert (
        closed.check(None)[0] == 403
    )  # an empty token is no token; default bind 0.0.0.0
    cfg = ExtConfig.from_env(
        {"MOONCAKE_BOOTSTRAP_TOKEN": TOKEN, "MOONCAKE_BOOTSTRAP_HOST": " 10.0.0.1 "}
    )
    assert cfg.bootstrap_host == "10.0.0.1" and cfg.bootstrap_token == TOKEN
    assert EndpointGuard(cfg).check(f"Bearer {READ}") is None
    assert (
        EndpointGuard(ExtConfig.from_env({"MOONCAKE_BOOTSTRAP_INSECURE": "1"})).check(
            None
        )
        is None
    )
    assert (
        EndpointGuard(
            ExtConfig.from_env({"MOONCAKE_BOOTSTRAP_HOST": "127.0.0.1"})
        ).check(None)
        is None
    )


def test_token_is_compared_with_hmac_compare_digest(monkeypatch):
    calls = []

    def spy(a, b):
        calls.append((a, b))
        return hmac.compare_digest(a, b)

    g = EndpointGuard(ExtConfig(bootstrap_token=TOKEN))
    monkeypatch.setattr(auth, "hmac", SimpleNamespace(compare_digest=spy))
    assert g.check(f"Bearer {READ}") is None
    assert g.check("Bearer nope")[0] == 401
    assert (
        g.check(f"Bearer {READ}" + "0" * 1000)[0] == 401
    )  # other length: no exception
    assert calls == [
        (READ.encode(), READ.encode()),
        (b"nope", READ.encode()),
        ((READ + "0" * 1000).encode(), READ.encode()),
    ]


def test_a_reader_sends_the_read_key_never_the_token(monkeypatch):
    monkeypatch.setenv("MOONCAKE_BOOTSTRAP_TOKEN", TOKEN)
    assert bootstrap_headers("GET", "/push/stats") == {
        "authorization": f"Bearer {READ}"
    }
    assert TOKEN not in READ and len(READ) == 64
    monkeypatch.delenv("MOONCAKE_BOOTSTRAP_TOKEN")
    assert bootstrap_headers("GET", "/push/stats") == {}


def test_guard_over_http(c_servers):
    """Every route of this series answers 401/403 before reading a body or writing."""
    c = c_servers()  # token set
    d = c.destination()
    for headers in [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Basic {TOKEN}"},
    ]:
        assert c.post("/push_blocks", push_body(d), headers=headers).status_code == 401
        assert (
            c.post("/match_blocks", {"token_ids": TOKENS}, headers=headers).status_code
            == 401
        )
        assert c.http.get("/hashsync", headers=headers).status_code == 401
        assert c.http.get("/layerwise/transfers", headers=headers).status_code == 401
    assert c.http.get("/hashsync", headers=AUTH).status_code == 200
    assert (
        c.http.get("/layerwise/transfers", headers=AUTH).status_code == 404
    )  # not enabled
    assert c.engine.log == [] and d.untouched()

    closed = c_servers(ExtConfig())  # no token, default bind 0.0.0.0
    d2 = closed.destination()
    for headers in [{}, AUTH]:
        assert (
            closed.post("/push_blocks", push_body(d2), headers=headers).status_code
            == 403
        )
        assert (
            closed.post(
                "/match_blocks", {"token_ids": TOKENS}, headers=headers
            ).status_code
            == 403
        )
        assert closed.http.get("/hashsync", headers=headers).status_code == 403
    assert closed.engine.log == [] and d2.untouched()

    for cfg in [
        ExtConfig(bootstrap_insecure=True),
        ExtConfig(bootstrap_host="127.0.0.1"),
    ]:
        open_ = c_servers(cfg)
        d3 = open_.destination()
        assert_push_ok(open_, d3, open_.post("/push_blocks", push_body(d3), headers={}))


def test_push_stats_have_their_own_route_behind_the_guard(c_servers):
    """C's push counters are served as GET /push/stats (bearer), not inside the
    block-hash mirror's /hashsync."""
    c = c_servers()  # token set
    d = c.destination()
    for headers in [{}, {"authorization": "Bearer wrong"}]:
        assert c.http.get("/push/stats", headers=headers).status_code == 401
    assert c.http.get("/push/stats", headers=AUTH).json()["pushes"] == 0
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))
    stats = c.http.get("/push/stats", headers=AUTH).json()
    assert (
        stats["pushes"] == 1 and stats["ok"] == 1 and stats["bytes"] == 3 * SLOTS * BLEN
    )
    assert stats["bytes_by_destination"] == {D_SESSION: 3 * SLOTS * BLEN}
    mirror = c.http.get("/hashsync", headers=AUTH).json()
    assert mirror["size"] == 3 and "push" not in mirror
