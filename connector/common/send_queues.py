# SPDX-License-Identifier: Apache-2.0
"""The kernel's TCP send queues toward a peer: what a failed write may still deliver.

Measured with the real engine (Mooncake 0.3.13.post1, TCP) and two network
namespaces, the receiver's link cut 80 ms into a 512 MiB write for 40 s
(docs/results/2026-11-26-late-bytes.md): the writer's four data connections
each held about 4 MB in their send queues; after 30 s without progress the
transport closed them ("dropping connection"), the kernel kept them as
FIN-WAIT-1 orphans with those bytes still queued, the engine reported every
task on them FAILED and the terminal write returned -1 1.4 s after the link
came back, and 12.7 s later the orphans' next retransmission delivered their
16.6 MB to the receiver's still-open connections, whose engine copied them into
its registered memory. A task the engine reports FAILED is therefore no proof:
the bytes sit in the kernel until they are delivered or the kernel gives up on
the connection (``tcp_orphan_retries``; ``tcp_retries2`` for a connection still
open).

:class:`SendQueueFence` is the fence engine_write.py puts after a write that
failed: it reads this network namespace's TCP sockets to the peer's address
(``ss -tinHOn``: state, Send-Q, ``bytes_acked``) when the write returned, and
waits until every byte each of them held then has been acknowledged by the
peer's kernel, or the socket is gone (the kernel delivered it and closed, or
gave up: then nothing of it can arrive any more). Sockets that carry other
writes to the same peer are waited for only up to what they held at that
moment.

What it does not cover: bytes the peer's kernel has acknowledged but the peer's
engine has not yet copied out of its receive queue (a window of the engine's
read loop; the receiving side can see it as its own Recv-Q). RDMA has no kernel
send queue to read: with the RDMA transport the fence finds no TCP socket to
the peer and returns at once (unverified: no RDMA NIC here).
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

SS_TIMEOUT_S = 5.0
POLL_S = 0.1
_INFO = re.compile(r"\b(bytes_acked):(\d+)")


@dataclass(frozen=True)
class QueuedSocket:
    """One TCP socket of this namespace to the peer, as the kernel reports it."""

    state: str
    local: str
    remote: str
    send_q: int  # bytes not yet acknowledged by the peer (sent or not), FIN included
    bytes_acked: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.local, self.remote)


def _host(addr: str) -> str:
    """The address part of ``ss``'s ``host:port`` (IPv6 in brackets, IPv4-mapped
    IPv6 as its IPv4 address)."""
    host = addr.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def parse_ss(text: str, peer_ip: str) -> list[QueuedSocket]:
    """``ss -tinHOn`` output (one socket a line) -> the sockets whose remote
    address is ``peer_ip``."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[1].isdigit() or not fields[2].isdigit():
            continue
        if _host(fields[4]) != peer_ip:
            continue
        acked = _INFO.search(line)
        out.append(
            QueuedSocket(
                state=fields[0],
                local=fields[3],
                remote=fields[4],
                send_q=int(fields[2]),
                bytes_acked=int(acked.group(2)) if acked else 0,
            )
        )
    return out


def read_ss() -> str | None:
    """This namespace's TCP sockets with their info, or None when ``ss`` cannot be
    run (not installed, or it failed)."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    try:
        r = subprocess.run(
            [ss, "-tinHOn"], capture_output=True, text=True, timeout=SS_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def peer_ip(session: str) -> str | None:
    """A transfer-engine session ``host:port`` -> the peer's IP address (None when
    its name does not resolve)."""
    host = session.rsplit(":", 1)[0].strip("[]")
    try:
        return _host(f"{socket.getaddrinfo(host, None)[0][4][0]}:0")
    except (OSError, IndexError):
        return None


class SendQueueFence:
    """Waits until nothing a failed write queued in this namespace's kernel for a
    peer can still be delivered (module docstring). Thread-safe: no state but
    its counters, which one lock guards."""

    def __init__(
        self,
        read: Callable[[], str | None] = read_ss,
        resolve: Callable[[str], str | None] = peer_ip,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._read = read
        self._resolve = resolve
        self._clock = clock
        self._sleep = sleep
        self._warned_unreadable = False
        self._counters = threading.Lock()
        self.fenced = 0  # failed writes whose queued bytes had to be waited for
        self.fence_seconds = 0.0
        # failed writes waiting now: their blocks (and the peer's, held for them)
        # are out of use until the kernel has delivered or dropped the bytes
        self.fencing = 0

    def held(
        self, session: str, ip: str | None
    ) -> dict[tuple[str, str], tuple[int, int]] | None:
        """Per socket to the peer (``session``, at ``ip``) that holds bytes now: the
        ``bytes_acked`` by which all of them are acknowledged, and how many they are
        (None: the sockets cannot be read)."""
        text = self._read()
        if ip is None or text is None:
            if not self._warned_unreadable:
                self._warned_unreadable = True
                logger.warning(
                    "cannot read the kernel's TCP send queues toward %s (%s): a failed "
                    "transfer-engine write is taken as ended when the engine says so, "
                    "though bytes still queued in the kernel may land later; install "
                    "iproute2 (ss)",
                    session,
                    "its address does not resolve" if ip is None else "ss failed",
                )
            return None
        return {
            s.key: (s.bytes_acked + s.send_q, s.send_q)
            for s in parse_ss(text, ip)
            if s.send_q > 0
        }

    def wait(self, session: str, bound_s: float, started: float) -> float:
        """Return once every byte the sockets to ``session``'s host held now has been
        acknowledged or its socket is gone; logs once past ``bound_s`` after
        ``started`` (this clock) and keeps waiting. Returns the seconds waited."""
        t0 = self._clock()
        ip = self._resolve(session)  # once: a name lookup per poll is not needed
        held = self.held(session, ip)
        if not held or ip is None:
            return 0.0
        targets = {k: target for k, (target, _) in held.items()}
        logger.warning(
            "engine write to %s failed with %d bytes still queued in this host's kernel "
            "on %d connection(s) to it: the write ends once they are delivered or the "
            "kernel drops them (a failed task's bytes can still land)",
            session,
            sum(queued for _, queued in held.values()),
            len(held),
        )
        with self._counters:
            self.fencing += 1
        try:
            self._wait_for(session, ip, targets, bound_s, started)
        finally:
            waited = self._clock() - t0
            with self._counters:
                self.fencing -= 1
                self.fenced += 1
                self.fence_seconds += waited
        return waited

    def _wait_for(
        self,
        session: str,
        ip: str,
        targets: dict[tuple[str, str], int],
        bound_s: float,
        started: float,
    ) -> None:
        warned = False
        while targets:
            self._sleep(POLL_S)
            text = self._read()
            if text is None:
                continue  # unreadable for a moment: keep the bytes' targets
            now = {s.key: s for s in parse_ss(text, ip)}
            targets = {
                k: target
                for k, target in targets.items()
                if k in now and now[k].bytes_acked < target and now[k].send_q > 0
            }
            if targets and not warned and self._clock() - started > bound_s:
                warned = True
                logger.error(
                    "engine write to %s: %d connection(s) still hold its bytes %.0f s "
                    "after it started, past the engine's bound; its blocks stay out of "
                    "use until the kernel delivers or drops them",
                    session,
                    len(targets),
                    self._clock() - started,
                )


def fence_stats(write_fn: Any) -> dict[str, float]:
    """The send-queue fence's counters of a terminal write function (zeros for
    another write function), as the stats routes serve them."""
    fence = getattr(write_fn, "fence", None)
    return {
        "fenced_writes": getattr(fence, "fenced", 0),
        "fence_seconds": round(getattr(fence, "fence_seconds", 0.0), 3),
        "fencing_now": getattr(fence, "fencing", 0),
    }


__all__ = [
    "QueuedSocket",
    "SendQueueFence",
    "fence_stats",
    "parse_ss",
    "peer_ip",
    "read_ss",
]
