"""harness/netns.py: hosts in namespaces on a bridge; faults; nothing left behind."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from harness import netns

pytestmark = pytest.mark.hosts


def reachable(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def carrier(host: netns.Host) -> str:
    """The carrier of the host's eth0, as its own namespace sees it."""
    return subprocess.run(
        [*host.exec_prefix(), "cat", "/sys/class/net/eth0/carrier"],
        capture_output=True,
        text=True,
    ).stdout.strip()


def test_hosts_reach_each_other_link_down_cuts_them_and_nothing_is_left():
    topo = netns.Topology(["prefill", "decode"])
    with topo:
        p, d = topo.host("prefill"), topo.host("decode")
        server = subprocess.Popen(
            [
                *p.exec_prefix(),
                sys.executable,
                "-m",
                "http.server",
                "18080",
                "--bind",
                p.ip,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://{p.ip}:18080/"
        deadline = time.monotonic() + 10
        while not reachable(url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reachable(url)  # from the test's namespace, over the bridge
        from_decode = [
            *d.exec_prefix(),
            sys.executable,
            "-c",
            f"import urllib.request; urllib.request.urlopen('{url}', timeout=2)",
        ]
        assert subprocess.run(from_decode, capture_output=True).returncode == 0
        topo.link_down("prefill")
        assert subprocess.run(from_decode, capture_output=True).returncode != 0
        assert carrier(p) == "1"  # cut beyond P's NIC: its own stack sees no change
        topo.link_up("prefill")
        assert subprocess.run(from_decode, capture_output=True).returncode == 0
        topo.nic_down("prefill")
        assert subprocess.run(from_decode, capture_output=True).returncode != 0
        assert carrier(p) == "0"
        topo.link_up("prefill")
        assert carrier(p) == "1"
        topo.limit("prefill", mbit=50)
        assert subprocess.run(from_decode, capture_output=True).returncode == 0
        topo.clear("prefill")
        assert topo.leftovers()
    assert topo.leftovers() == []
    assert server.wait(timeout=10) is not None  # killed with its namespace


def test_stale_topology_of_a_dead_owner_is_removed():
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
    ns, bridge = f"{netns.PREFIX}{dead}a-x", f"{netns.PREFIX}br{dead}a"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
    try:
        removed = netns.cleanup_stale()
        assert ns in removed and bridge in removed
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)
    live = netns.Topology(["y"])  # a live owner's (ours) is kept
    with live:
        removed = netns.cleanup_stale()
        assert live.host("y").netns not in removed and live.bridge not in removed
        assert len(live.leftovers()) == 3


def test_two_topologies_of_one_process_do_not_collide():
    with netns.Topology(["a"]) as one, netns.Topology(["a"]) as two:
        assert one.host("a").netns != two.host("a").netns
        assert one.subnet != two.subnet
    assert one.leftovers() == [] and two.leftovers() == []


def test_netem_is_probed_and_refused_clearly_when_missing():
    with netns.Topology(["a"]) as topo:
        if netns.netem_available() is None:
            topo.netem("a", "delay", "1ms")
            shown = subprocess.run(
                [*topo.host("a").exec_prefix(), "tc", "qdisc", "show", "dev", "eth0"],
                capture_output=True,
                text=True,
            ).stdout
            assert "netem" in shown
        else:
            with pytest.raises(netns.TopologyError, match="netem is not available"):
                topo.netem("a", "delay", "1ms")


def test_data_link_down_cuts_the_engine_ports_only():
    """An HTTP server on an engine port (15500) and one above the range (18080) on
    P: with the data network cut, D reaches the second only; cleared, both."""
    assert netns._port_blocks(range(15000, 17001)) == [
        (14336, 0xFC00),
        (15360, 0xFC00),
        (16384, 0xFC00),
    ]
    topo = netns.Topology(["prefill", "decode"])
    with topo:
        p, d = topo.host("prefill"), topo.host("decode")
        servers = [
            subprocess.Popen(
                [*p.exec_prefix(), sys.executable, "-m", "http.server", str(port)]
                + ["--bind", p.ip],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for port in (15500, 18080)
        ]

        def from_decode(port: int) -> bool:
            code = f"import urllib.request; urllib.request.urlopen('http://{p.ip}:{port}/', timeout=2)"
            run = [*d.exec_prefix(), sys.executable, "-c", code]
            return subprocess.run(run, capture_output=True).returncode == 0

        deadline = time.monotonic() + 10
        while not (from_decode(15500) and from_decode(18080)):
            assert time.monotonic() < deadline, "servers never answered"
            time.sleep(0.1)
        topo.data_link_down("prefill")
        topo.data_link_down("decode")
        assert not from_decode(15500)
        assert from_decode(18080)
        topo.clear("prefill")
        topo.clear("decode")
        assert from_decode(15500) and from_decode(18080)
    assert topo.leftovers() == []
    for server in servers:
        assert server.wait(timeout=10) is not None
