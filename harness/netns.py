"""Hosts of their own: one Linux network namespace per vLLM instance, on one bridge.

    with Topology(["prefill", "decode"]) as topo:
        topo.host("prefill").ip          # 10.231.N.2: its API, bootstrap server, ZMQ, engine
        topo.link_down("decode")         # unplug decode's cable (for every peer and the client)
        topo.limit("prefill", mbit=200)  # tc tbf, both directions

Layout: a bridge ``vmpbr<tag>`` in the test's own (root) namespace holds
10.231.N.1/24, so the test process reaches every host; each host is a namespace
``vmp<tag>-<name>`` with ``lo`` and ``eth0`` (a veth whose other end,
``vmp<tag><i>``, is a port of the bridge; tag = owner pid + a letter). Everything between two hosts crosses
two veths and the bridge, a link that can fail. Addresses come from 10.231.0.0/16
and exist only inside what this module creates: nothing is ever routed anywhere
else (network tests talk only to loopback or to namespaces the test creates).

``destroy`` (also on interpreter exit and after a crashed run: ``cleanup_stale``)
kills every process left in the namespaces, then deletes namespaces, veths and
the bridge. Needs root and iproute2 (``ip``, ``tc``).

Fault tools: the host's link cut beyond its NIC (its port leaves the bridge) or
its NIC's carrier taken away (its port down), and either undone; ``tc tbf`` rate limit;
``tc netem`` (loss, delay) where the kernel has it (``netem_available``):
this project's CI kernel does not (``Error: Specified qdisc kind is unknown``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

PREFIX = "vmp"
_NS_RE = re.compile(rf"^{PREFIX}(\d+)[a-z]?-[a-z0-9_]+$")
_SEQ = itertools.count()  # topologies made by this process: a letter each


class TopologyError(RuntimeError):
    pass


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=30, check=False
        )
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess(args, -1, "", "timed out after 30 s")
    if check and proc.returncode != 0:
        raise TopologyError(
            f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}"
        )
    return proc


def available() -> str | None:
    """None when namespaces can be made here; else why not (tests skip with it)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if _run("sh", "-c", f"command -v {tool}", check=False).returncode != 0:
            return f"{tool} (iproute2) is not installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def netem_available() -> str | None:
    """None when ``tc qdisc ... netem`` works on this kernel; else the error."""
    dev = f"{PREFIX}nt{os.getpid()}"
    made = _run(
        "ip", "link", "add", dev, "type", "veth", "peer", "name", dev + "p", check=False
    )
    if made.returncode != 0:
        return f"cannot create a veth to probe netem: {made.stderr.strip()}"
    try:
        r = _run(
            "tc",
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "netem",
            "delay",
            "1ms",
            check=False,
        )
        return None if r.returncode == 0 else f"tc netem: {r.stderr.strip()}"
    finally:
        _run("ip", "link", "del", dev, check=False)


def _pids_in(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def _kill_ns(ns: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_in(ns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = _pids_in(ns)
        if not pids:
            return


def cleanup_stale() -> list[str]:
    """Remove namespaces, veths and bridges left by a crashed earlier run (ours only:
    names ``vmp<tag>-...``, ``vmp<tag><i>``, ``vmpbr<tag>``, probes, whose owner process is gone)."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = _NS_RE.match(ns) or re.match(rf"^{PREFIX}probe(\d+)$", ns)
        if m and not _alive(int(m.group(1))):
            _kill_ns(ns)
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = re.match(rf"^{PREFIX}(?:br|nt)?(\d+)(?:[a-z]\d*|p)?$", name)
        if m and not _alive(int(m.group(1))):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_subnet(start: int) -> int:
    """The first 10.231.N.0/24 from ``start`` on that no interface here uses."""
    used = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    for i in range(250):
        n = 1 + (start - 1 + i) % 250
        if f" 10.231.{n}." not in used:
            return n
    raise TopologyError(
        "every 10.231.N.0/24 is in use: stale topologies? (cleanup_stale)"
    )


# Mooncake's transfer-engine ports (its RPC and data listeners): MC_MIN_RPC_PORT ..
# MC_MAX_RPC_PORT, 15000-17000 by default; the harness's own ports lie above them
ENGINE_PORTS = range(15000, 17001)


def _port_blocks(ports: range) -> list[tuple[int, int]]:
    """(value, mask) pairs of 16-bit ports whose blocks together cover ``ports``
    (and at most the rest of the aligned blocks they fall in)."""
    mask_bits = 10  # blocks of 1024 ports
    first, last = ports.start >> mask_bits, (ports.stop - 1) >> mask_bits
    mask = 0xFFFF & ~((1 << mask_bits) - 1)
    return [(b << mask_bits, mask) for b in range(first, last + 1)]


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ip: str
    port_dev: str  # its cable's end on the bridge, in the root namespace

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def sysctl(self, name: str, value: int) -> None:
        """Set a per-namespace kernel setting (net.*) in this host only."""
        _run(*self.exec_prefix(), "sysctl", "-qw", f"{name}={value}")


_LIVE: set[Topology] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _destroy_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for topo in live:
        topo.destroy()


class Topology:
    """Hosts on a bridge; owns every namespace, interface and qdisc it makes."""

    def __init__(self, names: list[str]) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be unique and non-empty: {names}")
        # the owner's pid names everything (cleanup_stale tells live from stale); a
        # second topology of the same process gets the next subnet
        self.tag = f"{os.getpid()}{chr(ord('a') + next(_SEQ) % 26)}"
        self.subnet = _free_subnet(1 + os.getpid() % 250)  # 10.231.<subnet>.0/24
        self.bridge = f"{PREFIX}br{self.tag}"
        self.hosts = {
            name: Host(
                name,
                netns=f"{PREFIX}{self.tag}-{re.sub(r'[^a-z0-9_]', '_', name.lower())}",
                ip=f"10.231.{self.subnet}.{i + 2}",
                port_dev=f"{PREFIX}{self.tag}{i}",
            )
            for i, name in enumerate(names)
        }
        self.created = False

    def host(self, name: str) -> Host:
        return self.hosts[name]

    @property
    def gateway_ip(self) -> str:
        return f"10.231.{self.subnet}.1"

    def create(self) -> Topology:
        why = available()
        if why:
            raise TopologyError(f"cannot build the namespace topology: {why}")
        cleanup_stale()
        with _LIVE_LOCK:
            _LIVE.add(self)
        self.created = True
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for h in self.hosts.values():
                _run("ip", "netns", "add", h.netns)
                _run(
                    "ip",
                    "link",
                    "add",
                    h.port_dev,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    h.netns,
                )
                _run("ip", "link", "set", h.port_dev, "master", self.bridge)
                _run("ip", "link", "set", h.port_dev, "up")
                ns = ["ip", "netns", "exec", h.netns]
                _run(*ns, "ip", "link", "set", "lo", "up")
                _run(*ns, "ip", "addr", "add", f"{h.ip}/24", "dev", "eth0")
                _run(*ns, "ip", "link", "set", "eth0", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def destroy(self) -> None:
        """Kill what runs in the namespaces, delete them, their veths and the bridge."""
        if not self.created:
            return
        for h in self.hosts.values():
            _kill_ns(h.netns)
            _run("ip", "netns", "del", h.netns, check=False)
            _run("ip", "link", "del", h.port_dev, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        self.created = False
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def leftovers(self) -> list[str]:
        """Anything of this topology still present (for tests of the teardown)."""
        names = {
            line.split()[0]
            for line in _run("ip", "netns", "list", check=False).stdout.splitlines()
            if line.split()
        }
        links = {
            line.split(":")[1].strip().split("@")[0]
            for line in _run(
                "ip", "-o", "link", "show", check=False
            ).stdout.splitlines()
            if ":" in line
        }
        out = [h.netns for h in self.hosts.values() if h.netns in names]
        out += [
            d
            for d in [self.bridge, *(h.port_dev for h in self.hosts.values())]
            if d in links
        ]
        return out

    # -- faults ---------------------------------------------------------------

    def link_down(self, name: str) -> None:
        """Cut the host's link beyond its NIC, as a failure past the host's own
        switch port does: its port leaves the bridge, so every frame to or from the host is
        lost on the way, while the host's eth0 keeps its carrier and its TCP
        stack retransmits as it would over a real network."""
        _run("ip", "link", "set", self.hosts[name].port_dev, "nomaster")

    def data_link_down(self, name: str, ports: range = ENGINE_PORTS) -> None:
        """Cut only the transfer engines' traffic into the host (TCP to or from
        ``ports``), beyond its NIC, while its other traffic (HTTP, ZMQ) flows: as
        when the data network (the RDMA fabric) fails and the front-end network
        does not. Frames into the host on those ports are classified (u32) into an
        HTB class whose queue holds none, so each is dropped on the way;
        :meth:`clear` removes it. Cut both hosts of a pair for a cut both ways."""
        dev = self.hosts[name].port_dev
        tc = ["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:"]
        _run(*tc, "htb", "default", "10")
        cls = ["tc", "class", "add", "dev", dev, "parent", "1:", "classid"]
        _run(*cls, "1:10", "htb", "rate", "10gbit")
        _run(*cls, "1:20", "htb", "rate", "8bit", "ceil", "8bit")
        _run(*f"tc qdisc add dev {dev} parent 1:20 handle 20: pfifo limit 0".split())
        for value, mask in _port_blocks(ports):
            for field in ("sport", "dport"):
                match = ["match", "ip", field, str(value), hex(mask)]
                _run(
                    *f"tc filter add dev {dev} parent 1: protocol ip prio 1 u32".split(),
                    *match,
                    "flowid",
                    "1:20",
                )

    def nic_down(self, name: str) -> None:
        """Take away the carrier of the host's NIC (its bridge port down): the
        host's own stack sees NO-CARRIER and drops what it sends. Kept for the
        fault matrix's ``nic_down_short`` (docs/faults.md), not the CI rows."""
        _run("ip", "link", "set", self.hosts[name].port_dev, "down")

    def pin_neighbour(self, name: str, peer: str) -> None:
        """Host ``name``'s neighbour (ARP) entry for ``peer`` made permanent, as for
        a peer behind a router whose own address always resolves: a connect to
        ``peer`` while its link is down then lasts until the kernel gives up the
        SYN (net.ipv4.tcp_syn_retries), not until ARP fails (about 3 s)."""
        h, p = self.host(name), self.host(peer)
        mac = _run(*p.exec_prefix(), "cat", "/sys/class/net/eth0/address").stdout
        _run(
            *h.exec_prefix(),
            "ip", "neigh", "replace", p.ip, "lladdr", mac.strip(),
            "nud", "permanent", "dev", "eth0",
        )  # fmt: skip

    def link_up(self, name: str) -> None:
        """Undo :meth:`link_down` and :meth:`nic_down`."""
        port = self.hosts[name].port_dev
        _run("ip", "link", "set", port, "master", self.bridge)
        _run("ip", "link", "set", port, "up")

    def limit(
        self, name: str, *, mbit: float, burst_kb: int = 64, latency_ms: int = 50
    ) -> None:
        """Token-bucket rate limit on the host's link, both directions (tc tbf)."""
        h = self.hosts[name]
        spec = [
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            f"{burst_kb}kb",
            "latency",
            f"{latency_ms}ms",
        ]
        _run("tc", "qdisc", "replace", "dev", h.port_dev, "root", *spec)
        _run(*h.exec_prefix(), "tc", "qdisc", "replace", "dev", "eth0", "root", *spec)

    def netem(self, name: str, *args: str) -> None:
        """tc netem (e.g. "loss", "5%" or "delay", "20ms") on both directions."""
        why = netem_available()
        if why:
            raise TopologyError(f"netem is not available on this kernel: {why}")
        h = self.hosts[name]
        _run("tc", "qdisc", "replace", "dev", h.port_dev, "root", "netem", *args)
        _run(
            *h.exec_prefix(),
            "tc",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "netem",
            *args,
        )

    def clear(self, name: str) -> None:
        h = self.hosts[name]
        _run("tc", "qdisc", "del", "dev", h.port_dev, "root", check=False)
        _run(*h.exec_prefix(), "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        self.link_up(name)

    def __enter__(self) -> Topology:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()
