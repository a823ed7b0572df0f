"""harness/launcher.py's free_port(): ports the instances bind later, so none may
come from the range the kernel draws outgoing connections' source ports from (a
bootstrap port taken that way left P unable to start)."""

from __future__ import annotations

from pathlib import Path

from harness import launcher


def test_free_ports_stay_below_the_ephemeral_range_and_never_repeat():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [launcher.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert [p for p in ports if not launcher.PICK_PORTS.start <= p < low] == []
