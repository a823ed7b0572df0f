"""harness/netns.py: hosts in namespaces on a bridge; faults; nothing left behind."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest

from harness import netns

pytestmark = pytest.mark.skipif(netns.available() is not None,
                                reason=f"no network namespaces here: {netns.available()}")


def reachable(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def test_hosts_reach_each_other_link_down_cuts_them_and_nothing_is_left():
    topo = netns.Topology(["prefill", "decode"])
    with topo:
        p, d = topo.host("prefill"), topo.host("decode")
        server = subprocess.Popen([*p.exec_prefix(), sys.executable, "-m", "http.server",
                                   "18080", "--bind", p.ip],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://{p.ip}:18080/"
        deadline = time.monotonic() + 10
        while not reachable(url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reachable(url)  # from the test's namespace, over the bridge
        from_decode = [*d.exec_prefix(), sys.executable, "-c",
                       f"import urllib.request; urllib.request.urlopen('{url}', timeout=2)"]
        assert subprocess.run(from_decode, capture_output=True).returncode == 0
        topo.link_down("prefill")
        assert subprocess.run(from_decode, capture_output=True).returncode != 0
        topo.link_up("prefill")
        topo.limit("prefill", mbit=50)
        assert subprocess.run(from_decode, capture_output=True).returncode == 0
        topo.clear("prefill")
        assert topo.leftovers()
    assert topo.leftovers() == []
    assert server.wait(timeout=10) is not None  # killed with its namespace


def test_stale_topology_of_a_dead_owner_is_removed():
    topo = netns.Topology(["x"])
    topo.tag = "999999"  # an owner pid that cannot exist (pid_max is lower)
    topo.bridge = f"{netns.PREFIX}br999999"
    topo.hosts = {"x": netns.Host("x", f"{netns.PREFIX}999999-x", "10.231.250.2",
                                  f"{netns.PREFIX}999999h0")}
    topo.created = True  # as if a crashed run made it: create by hand
    subprocess.run(["ip", "netns", "add", topo.hosts["x"].netns], check=True)
    subprocess.run(["ip", "link", "add", topo.bridge, "type", "bridge"], check=True)
    try:
        removed = netns.cleanup_stale()
        assert topo.hosts["x"].netns in removed and topo.bridge in removed
        assert topo.leftovers() == []
    finally:
        topo.destroy()


def test_netem_is_probed_not_assumed():
    why = netns.netem_available()
    assert why is None or "netem" in why
