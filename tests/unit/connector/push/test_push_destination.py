"""Never into C's own engine, by what the engine would connect to (push/destination.py).

C's own session is C_SESSION (127.0.0.1:17001). Every other spelling of an
address of this host with C's engine port is C's engine too: a push naming it
must be refused (409) before the engine is called, even where the engine (here
a memmove registered for that spelling) would accept the write. Over real HTTP
(helpers.CServer) and against OwnEngine directly, with injected lookups.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import (
    C_SESSION,
    D_SESSION,
    KV,
    NBLK,
    assert_push_ok,
    push_body,
    refused,
    wait_until,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    PushRequestError,
)

OWN_PORT = int(C_SESSION.rsplit(":", 1)[1])


def own_aliases() -> list[str]:
    p = OWN_PORT
    return [
        f"localhost:{p}",
        f"LOCALHOST:{p}",
        f"127.0.0.1:0{p}",
        f"127.0.0.1:000{p}",
        f"127.1.2.3:{p}",
        f"[::1]:{p}",
        f"0.0.0.0:{p}",
        f"[::]:{p}",
        f"127.1:{p}",
        f"2130706433:{p}",
        f"0x7f.1:{p}",
        f"[::ffff:127.0.0.1]:{p}",
        f"{socket.gethostname()}:{p}",
        f"foo.localhost:{p}",
    ]


@pytest.mark.parametrize("alias", own_aliases())
def test_every_spelling_of_cs_own_engine_is_refused(c_server, alias):
    c = c_server()
    own = KV(fill=False)  # what C's engine would write into through that spelling
    c.engine.register(alias, own)
    out = refused(c, push_body(own, session=alias), 409, own)
    assert out["detail"]["field"] == "dst_session", out
    assert c.server.stats["refused"] == 1


def test_the_same_port_on_another_host_and_another_port_here_are_written(c_server):
    c = c_server()
    for session in (f"192.0.2.7:{OWN_PORT}", D_SESSION, f"127.0.0.1:{OWN_PORT + 7}"):
        d = c.destination(session)
        assert_push_ok(c, d, c.post("/push_blocks", push_body(d, session=session)))


def test_a_zero_padded_port_is_the_same_destination_for_its_layout(c_server):
    """While a push into D is being written, another layout is refused for D under
    any spelling of its session (the layout is kept per canonical host:port)."""
    c = c_server()
    d = c.destination()
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))
    host, port = D_SESSION.rsplit(":", 1)
    padded = f"{host}:0{port}"
    c.engine.register(padded, d)
    gate = c.engine.gate()
    with ThreadPoolExecutor(1) as pool:
        writing = pool.submit(c.post, "/push_blocks", push_body(d))
        assert wait_until(lambda: c.engine.entered == 2), "the write never started"
        body = push_body(d, session=padded, dst_num_blocks=NBLK - 1)
        out = refused(c, body, 409)
        assert out["detail"]["field"] == "dst_session"
        assert "being written" in out["detail"]["message"]
        gate.set()
        assert writing.result(10).json()["status"] == "ok"


# ---- OwnEngine alone ---------------------------------------------------------------------


def own_engine(**kw):
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push import (
        source_destinations,
    )

    return source_destinations, source_destinations.OwnEngine(C_SESSION, **kw)


@pytest.mark.parametrize("alias", own_aliases())
def test_own_engine_refuses_each_alias(alias):
    _, own = own_engine()
    with pytest.raises(PushRequestError) as e:
        own.check(alias)
    assert e.value.status == 409 and e.value.field == "dst_session"


def test_this_hosts_interface_addresses_are_its_own():
    source_destinations, own = own_engine()
    addrs = source_destinations._interface_addresses()
    assert any(a.is_loopback for a in addrs)
    for a in addrs:
        host = f"[{a}]" if a.version == 6 else str(a)
        with pytest.raises(PushRequestError):
            own.check(f"{host}:{OWN_PORT}")


def test_an_address_given_as_this_hosts_own_is_refused():
    import ipaddress

    _, own = own_engine(addresses={ipaddress.ip_address("10.9.8.7")})
    with pytest.raises(PushRequestError):
        own.check(f"10.9.8.7:{OWN_PORT}")
    assert own.check(f"10.9.8.7:{OWN_PORT + 1}").port == OWN_PORT + 1


def test_a_name_is_resolved_and_refused_if_any_address_is_local():
    import ipaddress

    asked = []

    def lookup(host):
        asked.append(host)
        return [ipaddress.ip_address("192.0.2.1"), ipaddress.ip_address("127.0.0.5")]

    _, own = own_engine(lookup=lookup)
    with pytest.raises(PushRequestError):
        own.check(f"d.example:{OWN_PORT}")
    assert asked == ["d.example"]
    asked.clear()
    assert own.check(f"d.example:{OWN_PORT + 1}").port == OWN_PORT + 1
    assert asked == []  # another port: no lookup


def test_a_name_resolving_elsewhere_is_written_and_an_unknown_name_is_left_to_the_engine():
    import ipaddress

    _, own = own_engine(lookup=lambda h: [ipaddress.ip_address("192.0.2.1")])
    assert own.check(f"D.Example:0{OWN_PORT}").key == f"d.example:{OWN_PORT}"

    def unknown(h):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    _, own = own_engine(lookup=unknown)
    assert own.check(f"nowhere.invalid:{OWN_PORT}").port == OWN_PORT


def test_a_lookup_that_does_not_answer_in_time_is_refused_in_time():
    def hangs(host):
        time.sleep(3)
        return []

    _, own = own_engine(lookup=hangs, timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(PushRequestError) as e:
        own.check(f"slow.example:{OWN_PORT}")
    assert time.monotonic() - t0 < 1.0
    assert e.value.status == 409 and "resolve" in e.value.message


@pytest.mark.parametrize(
    "session",
    [
        "127.0.0.1:",
        ":17001",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:\uff11\uff17",
        "127.0.0.1:1e3",
        "a b:17001",
        "127.0.0.1:-1",
        "127.0.0.1:" + "0" * 9 + "1",
    ],
)
def test_a_session_that_is_no_host_and_port_is_422(session):
    _, own = own_engine()
    with pytest.raises(PushRequestError) as e:
        own.check(session)
    assert e.value.status == 422
