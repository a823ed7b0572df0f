"""Where Mooncake's transfer engine listens (0.3.13.post1, TCP, P2PHANDSHAKE).

What docs/security.md (Bind addresses) says about the engine, shown on the real
engine: its handshake daemon listens on 0.0.0.0 and its TCP data acceptor on
`*` (all IPv4 and IPv6 addresses), whatever MC_TCP_BIND_ADDRESS or the host it
is initialized with says; MC_MIN_RPC_PORT / MC_MAX_RPC_PORT pin the ports (so
a firewall rule can name them); a network namespace confines both. If a
Mooncake release starts binding where it is told, the first test fails and
docs/security.md and the README must be updated.
"""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from harness.engine_peer import EnginePeer

pytestmark = pytest.mark.integration

NBYTES = 1 << 20
PORTS = (21000, 21019)
PINNED = {
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "MC_MIN_RPC_PORT": str(PORTS[0]),
    "MC_MAX_RPC_PORT": str(PORTS[1]),
}


def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on (ss -ltnp)."""
    out = subprocess.run(
        ["ss", "-ltnpH"], capture_output=True, text=True, check=True
    ).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        local = line.split()[3]
        addr, _, port = local.rpartition(":")
        found.append((addr, int(port)))
    return found


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) is not installed")
def test_the_engine_listens_on_every_interface_whatever_the_bind_address_says():
    peer = EnginePeer("receiver", str(NBYTES), env=PINNED)
    try:
        _, port, _ = peer.expect("READY", 60)[0].split()
        found = listeners(peer.proc.pid)
    finally:
        peer.close()
    assert len(found) >= 2, found  # the handshake daemon and the TCP data acceptor
    assert ("0.0.0.0", int(port)) in found, (
        found
    )  # the handshake port, on every IPv4 address
    assert all(addr in ("0.0.0.0", "*", "[::]") for addr, _ in found), found
    assert all(PORTS[0] <= p <= PORTS[1] for _, p in found), (
        found
    )  # pinned by the range


@pytest.mark.skipif(
    shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="unshare / ip are not installed",
)
def test_a_network_namespace_confines_the_engines_listeners():
    """Run in a namespace of its own (only its loopback), the engine's ports are
    not reachable from this one, although it listens on 0.0.0.0 there."""
    peer = EnginePeer(
        "receiver",
        str(NBYTES),
        env=PINNED,
        prefix=[
            "unshare",
            "--net",
            "--",
            "sh",
            "-c",
            'ip link set lo up && exec "$@"',
            "sh",
        ],
    )
    try:
        _, port, _ = peer.expect("READY", 60)[0].split()
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.1", int(port))) != 0, "reachable from outside"
        assert listeners(peer.proc.pid) == []  # none in this namespace
    finally:
        peer.close()
