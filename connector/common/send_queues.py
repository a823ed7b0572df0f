# SPDX-License-Identifier: Apache-2.0
"""The fence after a failed transfer-engine write (on the writing side): it returns
only once none of the write's bytes can still land in the peer's memory.

A FAILED task is no proof: the kernel keeps dropped connections as orphans and
retransmits their queued bytes into the peer's memory when the link returns
(docs/results/2026-11-26-late-bytes.md). :class:`SendQueueFence` reads this
namespace's TCP sockets to the peer and waits until every byte they held at the
failure is acknowledged or its socket is gone. It fails closed: an unreadable kernel
or an unresolvable peer holds the write ``hold_s``, the longest queued bytes can
still land; a failed RDMA write (no kernel queue) is held ``rdma_hold_s``.
Not covered: bytes the peer's kernel acknowledged that its engine has not yet read.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(__name__)

# Poll interval of a fence: from POLL_MIN_S, backing off toward the sockets'
# retransmission timer (tcp_info's rto, halved), at most POLL_MAX_S.
POLL_MIN_S = 0.1
POLL_MAX_S = 2.0
NETLINK_TIMEOUT_S = 2.0  # one sock_diag dump
ADDRESSES_KEPT = 4096  # peer sessions whose addresses are remembered

# Linux's TCP states (include/net/tcp_states.h), and the ones a dump asks for:
# every state but LISTEN (no peer) and CLOSE.
TCP_LISTEN, TCP_CLOSE = 10, 7
# This side closed and the peer's application has not (FIN_WAIT1, FIN_WAIT2,
# CLOSING): bytes the peer's kernel acknowledged may still wait in its receive
# queue. The peer's engine closes once it has read everything (EOF), which moves
# the socket to TIME_WAIT; a peer that never closes is dropped after
# net.ipv4.tcp_fin_timeout (60 s by default).
_CLOSING_BY_US = frozenset({4, 5, 11})
_STATES = 0xFFF & ~((1 << TCP_LISTEN) | (1 << TCP_CLOSE))
# netlink / sock_diag constants (linux/netlink.h, sock_diag.h, inet_diag.h)
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
INET_DIAG_INFO = 2
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_JMP = 1
INET_DIAG_BC_D_COND = 8  # the socket's remote address matches (any port)
_BC_OP = struct.Struct("=BBH")  # code, yes, no: jumps in bytes
_BC_HOSTCOND = struct.Struct("=BBxxi")  # family, prefix_len, port (-1: any)
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQ = struct.Struct("=BBBBI48x")  # inet_diag_req_v2, its sockid zeroed
_MSG_HEAD = struct.Struct("=BB2x")  # inet_diag_msg: family, state, timer, retrans
_MSG_PORTS = struct.Struct(">HH")  # sockid: sport, dport (network order)
_MSG_QUEUES = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode
_MSG_LEN = 72
_RTA = struct.Struct("=HH")
_TCPI_RTO = struct.Struct("=I")  # tcp_info.tcpi_rto, microseconds, at offset 8
_TCPI_BYTES_ACKED = struct.Struct("=Q")  # tcp_info.tcpi_bytes_acked, at offset 120


@dataclass(frozen=True)
class QueuedSocket:
    """One TCP socket of this namespace, as the kernel reports it."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    send_q: int  # bytes not yet acknowledged by the peer (sent or not)
    bytes_acked: int | None  # None: this reading cannot tell (/proc)
    rto_s: float | None = None  # the retransmission timer (None: not read)

    @property
    def key(self) -> tuple[tuple[str, int], tuple[str, int]]:
        return (self.local, self.remote)


def normal_ip(address: str) -> str:
    """An IP address in one spelling: IPv4-mapped IPv6 as IPv4, scope dropped."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def _packed_forms(ips: Iterable[str]) -> frozenset[bytes]:
    """The addresses as sock_diag's 16-byte sockid holds them (IPv4 also mapped)."""
    out = set()
    for text in ips:
        ip = ipaddress.ip_address(text)
        if isinstance(ip, ipaddress.IPv4Address):
            out.add(ip.packed + bytes(12))
            out.add(ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed).packed)
        else:
            out.add(ip.packed)
    return frozenset(out)


@functools.lru_cache(maxsize=4096)  # a reading meets few distinct addresses
def _ip_of(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    return normal_ip(str(ipaddress.IPv6Address(raw)))


def _remote_filter(peers: frozenset[str]) -> bytes:
    """Bytecode keeping sockets to ``peers``, encoded as ``ss`` encodes "A or B" (the
    kernel's audit wants every false jump to land on the walk of true jumps)."""
    program = b""
    for text in sorted(peers, reverse=True):
        ip = ipaddress.ip_address(text)
        family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        cond = _BC_HOSTCOND.pack(family, ip.max_prefixlen, -1) + ip.packed
        size = _BC_OP.size + len(cond)
        op = _BC_OP.pack(INET_DIAG_BC_D_COND, size, size + 4) + cond
        if program:
            op += _BC_OP.pack(INET_DIAG_BC_JMP, 4, len(program) + 4)
        program = op + program
    if not program:
        return b""
    return _RTA.pack(_RTA.size + len(program), INET_DIAG_REQ_BYTECODE) + program


def read_sock_diag(peers: frozenset[str] | None) -> list[QueuedSocket] | None:
    """This namespace's TCP sockets to ``peers`` (None: all), filtered in the
    kernel; None when sock_diag fails or is silent for NETLINK_TIMEOUT_S."""
    wanted = None if peers is None else _packed_forms(peers)
    bytecode = b"" if peers is None else _remote_filter(peers)
    out: list[QueuedSocket] = []
    try:
        with socket.socket(
            socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG
        ) as nl:
            nl.settimeout(NETLINK_TIMEOUT_S)
            for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
                ext = 1 << (INET_DIAG_INFO - 1)
                body = _REQ.pack(family, socket.IPPROTO_TCP, ext, 0, _STATES) + bytecode
                head = _NLMSG.pack(
                    _NLMSG.size + len(body),
                    SOCK_DIAG_BY_FAMILY,
                    NLM_F_REQUEST | NLM_F_DUMP,
                    seq,
                    0,
                )
                nl.send(head + body)
                if not _read_dump(nl, seq, wanted, out):
                    return None
    except OSError:
        return None
    return out


def _read_dump(
    nl: socket.socket,
    seq: int,
    wanted: frozenset[bytes] | None,
    out: list[QueuedSocket],
) -> bool:
    """The answers to dump ``seq`` into ``out``; False on an error answer."""
    while True:
        data = nl.recv(1 << 20)
        if not data:
            return False
        off = 0
        while off + _NLMSG.size <= len(data):
            length, kind, _, got_seq, _ = _NLMSG.unpack_from(data, off)
            if length < _NLMSG.size:
                return False
            if got_seq == seq:
                if kind == NLMSG_DONE:
                    return True
                if kind == NLMSG_ERROR:
                    return False
                if kind == SOCK_DIAG_BY_FAMILY:
                    sock = _parse_msg(data, off + _NLMSG.size, off + length, wanted)
                    if sock is not None:
                        out.append(sock)
            off += (length + 3) & ~3


def _parse_msg(
    data: bytes, start: int, end: int, wanted: frozenset[bytes] | None
) -> QueuedSocket | None:
    if end - start < _MSG_LEN:
        return None
    dst = data[start + 24 : start + 40]
    if wanted is not None and dst not in wanted:
        return None  # the common case, decided before anything else is read
    family, state = _MSG_HEAD.unpack_from(data, start)
    sport, dport = _MSG_PORTS.unpack_from(data, start + 4)
    _, _, wqueue, _, _ = _MSG_QUEUES.unpack_from(data, start + 52)
    acked, rto = 0, None  # a socket reported without tcp_info acknowledged nothing yet
    off = start + _MSG_LEN if wqueue else end  # an empty queue: no target to read
    while off + _RTA.size <= end:
        rta_len, rta_type = _RTA.unpack_from(data, off)
        if rta_len < _RTA.size:
            break
        if rta_type == INET_DIAG_INFO:
            info = data[off + _RTA.size : off + rta_len]
            if len(info) >= 128:
                acked = _TCPI_BYTES_ACKED.unpack_from(info, 120)[0]
            if len(info) >= 12:
                rto = _TCPI_RTO.unpack_from(info, 8)[0] * 1e-6
        off += (rta_len + 3) & ~3
    return QueuedSocket(
        local=(_ip_of(family, data[start + 8 : start + 24]), sport),
        remote=(_ip_of(family, dst), dport),
        state=state,
        send_q=wqueue,
        bytes_acked=acked,
        rto_s=rto,
    )


def _proc_address(text: str) -> tuple[str, int]:
    """``/proc/net/tcp{,6}``'s ``HEX_IP:HEX_PORT`` (32-bit words in host order)."""
    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return _ip_of(family, raw), int(hex_port, 16)


def parse_proc_net_tcp(text: str, peers: frozenset[str] | None) -> list[QueuedSocket]:
    """``/proc/net/tcp{,6}`` -> the sockets to ``peers`` (None: all); no bytes_acked."""
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            remote = _proc_address(fields[2])
            if peers is not None and remote[0] not in peers:
                continue
            state = int(fields[3], 16)
            send_q = int(fields[4].split(":")[0], 16)
            local = _proc_address(fields[1])
        except ValueError:
            continue
        if state in (TCP_LISTEN, TCP_CLOSE):
            continue
        out.append(QueuedSocket(local, remote, state, send_q, None))
    return out


def read_proc_net_tcp(
    peers: frozenset[str] | None, root: str = "/proc/net"
) -> list[QueuedSocket] | None:
    """The sockets to ``peers`` from ``/proc/net/tcp{,6}``; None when unreadable."""
    out: list[QueuedSocket] = []
    read_any = False
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(root, name)) as f:
                text = f.read()
        except OSError:
            continue
        read_any = True
        out.extend(parse_proc_net_tcp(text, peers))
    return out if read_any else None


Reader = Callable[[frozenset[str] | None], "list[QueuedSocket] | None"]
READERS: dict[str, Reader] = {
    "sock_diag": read_sock_diag,
    "/proc/net/tcp": read_proc_net_tcp,
}


def probe_reader(readers: dict[str, Reader] = READERS) -> str | None:
    """The first reader that sees the queued bytes of a loopback socket whose peer
    does not read, or None: no reader sees send queues here (the fence is blind)."""
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client = socket.create_connection(listener.getsockname(), timeout=2)
            server, _ = listener.accept()
            with client, server:
                client.setblocking(False)
                chunk = bytes(65536)
                for _ in range(256):  # at most 16 MiB, until the send buffer is full
                    try:
                        client.send(chunk)
                    except BlockingIOError:
                        break
                key = (client.getsockname()[:2], listener.getsockname()[:2])
                for name, read in readers.items():
                    seen = read(frozenset({"127.0.0.1"}))
                    if seen is None:
                        continue
                    for s in seen:
                        if s.key == key and s.send_q > 0:
                            return name
    except OSError as e:
        logger.debug("send-queue probe failed: %s", e)
    return None


class KernelSockets:
    """The kernel's TCP sockets, read by the reader :func:`probe_reader` found."""

    def __init__(self, readers: dict[str, Reader] | None = None, probe: bool = True):
        self.readers = READERS if readers is None else readers
        self.mode = probe_reader(self.readers) if probe else next(iter(self.readers))

    @property
    def blind(self) -> bool:
        return self.mode is None

    def read(self, peers: frozenset[str] | None) -> list[QueuedSocket] | None:
        """The sockets to ``peers`` (None: all); None when the kernel is unreadable."""
        if self.mode is None:
            return None
        return self.readers[self.mode](peers)


class PeerAddresses:
    """Every address a peer's host name resolved to since its first write: the
    transport may have connected to any. Thread-safe; ADDRESSES_KEPT sessions."""

    def __init__(self, resolve: Callable[[str], set[str]] | None = None):
        self._resolve = resolve or resolve_host
        self._lock = threading.Lock()
        self._known: dict[str, set[str]] = {}

    def note(self, session: str) -> None:
        """A write to ``session`` starts: resolve its host once, off this thread."""
        host = session_host(session)
        with self._lock:
            if session in self._known:
                return
            if len(self._known) >= ADDRESSES_KEPT:
                self._known.pop(next(iter(self._known)))
            self._known[session] = set()
        if _literal(host) is not None:
            self._add(session, {_literal(host)})  # type: ignore[arg-type]
        else:
            threading.Thread(
                target=lambda: self._add(session, self._resolve(host)),
                name="fence-resolve",
                daemon=True,
            ).start()

    def of(self, session: str) -> frozenset[str]:
        """Its addresses now: what was noted and what the name resolves to now."""
        self._add(session, self._resolve(session_host(session)))
        with self._lock:
            return frozenset(self._known.get(session, ()))

    def of_noted(self, session: str) -> frozenset[str]:
        """Its addresses noted so far (no lookup)."""
        with self._lock:
            return frozenset(self._known.get(session, ()))

    def _add(self, session: str, ips: set[str]) -> None:
        with self._lock:
            self._known.setdefault(session, set()).update(ips)


def session_host(session: str) -> str:
    """A transfer-engine session ``host:port`` (IPv6 in brackets) -> its host."""
    return session.rsplit(":", 1)[0].strip("[]")


def _literal(host: str) -> str | None:
    try:
        return normal_ip(host)
    except ValueError:
        return None


def resolve_host(host: str) -> set[str]:
    """Every address ``host`` resolves to (A and AAAA), or the empty set."""
    literal = _literal(host)
    if literal is not None:
        return {literal}
    try:
        answers = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {normal_ip(str(a[4][0])) for a in answers}


class SendQueueFence:
    """The fence; concurrent fences share one kernel reading per poll."""

    def __init__(
        self,
        hold_s: float,
        rdma: bool = False,
        rdma_hold_s: float = 0.0,
        kernel: KernelSockets | None = None,
        addresses: PeerAddresses | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.hold_s = hold_s  # the longest queued bytes can still land (TCP)
        self.rdma = rdma
        self.rdma_hold_s = rdma_hold_s
        self.kernel = kernel if kernel is not None else KernelSockets()
        self.addresses = addresses if addresses is not None else PeerAddresses()
        self._clock = clock
        self._sleep = sleep
        self._counters = threading.Lock()
        self.fenced = 0  # failed writes whose queued bytes had to be waited for
        self.blind_holds = 0  # failed writes held for the bound: nothing to read
        self.fence_seconds = 0.0
        # failed writes waiting now: their blocks (and the peer's, held for them)
        # are out of use until the kernel has delivered or dropped the bytes
        self.fencing = 0
        # one kernel reading shared by every fence polling at the same time
        self._reading = threading.Lock()
        self._watched: dict[int, frozenset[str]] = {}  # per fencing thread
        self._last: tuple[float, list[QueuedSocket] | None] | None = None
        self._last_peers: frozenset[str] = frozenset()

    def say_at_start(self) -> None:
        """Say once what a failed write waits for on this host."""
        if self.kernel.blind:
            logger.warning(
                "Mooncake writes: cannot read this host's TCP send queues (no "
                "NETLINK_SOCK_DIAG answer, no readable /proc/net/tcp, or neither "
                "shows a test socket's queue). Every failed transfer-engine write "
                "will be held %.0f s (the longest its queued bytes can still land) "
                "before its transfer ends and its blocks are freed. To fence on "
                "the kernel's queues instead, allow netlink sock_diag sockets in "
                "this container's seccomp/sandbox profile, or mount /proc with "
                "this network namespace's /proc/net",
                self.hold_s,
            )
        else:
            logger.info(
                "Mooncake writes: a failed write ends once the kernel's TCP send "
                "queues to its peer hold none of its bytes (read with %s)%s",
                self.kernel.mode,
                f"; with RDMA, after {self.rdma_hold_s:.1f} s" if self.rdma else "",
            )

    def note(self, session: str) -> None:
        """A write to ``session`` starts (its addresses are noted)."""
        self.addresses.note(session)

    def wait(self, session: str, bound_s: float, started: float) -> float:
        """Return the seconds waited, once no byte a failed write to ``session``
        queued can still land; past ``bound_s`` after ``started`` it logs and waits on."""
        t0 = self._clock()
        with self._counters:
            self.fencing += 1
        try:
            self._fence(session, bound_s, started, t0)
        finally:
            with self._reading:
                self._watched.pop(threading.get_ident(), None)
            waited = self._clock() - t0
            with self._counters:
                self.fencing -= 1
                self.fence_seconds += waited
        return waited

    def _fence(self, session: str, bound_s: float, started: float, t0: float) -> None:
        peers = self.addresses.of(session)
        sockets = self._poll(peers, 0.0) if peers else None
        until = None  # the kernel bounds an orphan's life
        if sockets == [] and not self.rdma:
            # NOTE: no socket to any address of the peer: the kernel dropped them
            # all (nothing of the write can land), or the transport connected to
            # an address the name no longer gives. Either way every byte that can
            # still land sits in a socket of this host: wait for each that holds
            # bytes, wherever it goes, for at most as long as queued bytes land.
            sockets = self.kernel.read(None)
            peers = frozenset(s.remote[0] for s in sockets or () if s.send_q > 0)
            until = t0 + self.hold_s
        if sockets is None or not sockets and self.rdma:
            # NOTE: fail closed. An unreadable kernel or a name that resolves to
            # nothing tells nothing: hold for as long as queued bytes can land.
            # With RDMA, no TCP socket to the peer is the expected case: its own
            # bound.
            rdma_only = self.rdma and sockets is not None
            hold = self.rdma_hold_s if rdma_only else self.hold_s
            if not rdma_only:
                with self._counters:
                    self.blind_holds += 1
            logger.warning(
                "engine write to %s failed; %s: it ends after %.0f s",
                session,
                "RDMA holds a failed write for its fabric's bound"
                if rdma_only
                else "its host name resolves to no address"
                if not peers
                else "this host's TCP send queues cannot be read",
                hold,
            )
            self._sleep_until(t0 + hold)
            return
        targets = {
            s.key: (s.bytes_acked + s.send_q if s.bytes_acked is not None else None)
            for s in sockets
            if s.send_q > 0
        }
        if self.rdma:
            self._sleep_until(t0 + self.rdma_hold_s)
        if not targets:
            return
        logger.warning(
            "engine write to %s failed with %d bytes still queued in this host's kernel "
            "on %d connection(s)%s: the write ends once they are delivered or the "
            "kernel drops them (a failed task's bytes can still land)",
            session,
            sum(s.send_q for s in sockets if s.key in targets),
            len(targets),
            " to it"
            if until is None
            else f" (none to its addresses: waiting for every one, at most "
            f"{self.hold_s:.0f} s)",
        )
        with self._counters:
            self.fenced += 1
        self._wait_for(session, peers, targets, bound_s, started, until)

    def _sleep_until(self, until: float) -> None:
        while (left := until - self._clock()) > 0:
            self._sleep(min(left, POLL_MAX_S))

    def _poll(self, peers: frozenset[str], max_age: float) -> list[QueuedSocket] | None:
        """The sockets to ``peers`` from a shared reading at most ``max_age`` s old."""
        me = threading.get_ident()
        with self._reading:
            self._watched[me] = peers
            now = self._clock()
            last = self._last
            if last is None or now - last[0] > max_age or not peers <= self._last_peers:
                everyone = frozenset().union(*self._watched.values())
                self._last = last = (now, self.kernel.read(everyone))
                self._last_peers = everyone
            reading = last[1]
        if reading is None:
            return None
        return [s for s in reading if s.remote[0] in peers]

    def _wait_for(
        self,
        session: str,
        peers: frozenset[str],
        targets: dict[tuple[tuple[str, int], tuple[str, int]], int | None],
        bound_s: float,
        started: float,
        until: float | None = None,
    ) -> None:
        """Until every target is met or its socket gone, or ``until`` passes. Met:
        ``bytes_acked`` reached (None: queue empty) and, if we closed, the peer too."""
        warned = False
        interval = POLL_MIN_S
        while targets and (until is None or self._clock() < until):
            self._sleep(
                interval if until is None else min(interval, until - self._clock())
            )
            sockets = self._poll(peers, POLL_MIN_S)
            if sockets is None:
                continue  # unreadable for a moment: keep the targets
            now = {s.key: s for s in sockets}
            targets = {
                k: target
                for k, target in targets.items()
                if k in now
                and (
                    # NOTE: a dropped connection (an orphan) ends only once the
                    # peer's engine has read it to the end and closed its side
                    now[k].state in _CLOSING_BY_US
                    or (
                        now[k].send_q > 0
                        and (target is None or (now[k].bytes_acked or 0) < target)
                    )
                )
            }
            rtos = [now[k].rto_s for k in targets if now[k].rto_s]
            interval = min(
                POLL_MAX_S, max(POLL_MIN_S, min(rtos, default=2 * interval) / 2)
            )
            if targets and not warned and self._clock() - started > bound_s:
                warned = True
                logger.error(
                    "engine write to %s: %d connection(s) still hold its bytes "
                    "%.0f s after it started, past the engine's bound; its blocks "
                    "stay out of use until the kernel delivers or drops them",
                    session,
                    len(targets),
                    self._clock() - started,
                )


def fence_stats(write_fn: object) -> dict[str, float]:
    """The fence's counters of a write function (zeros without a fence)."""
    fence = getattr(write_fn, "fence", None)
    return {
        "fenced_writes": getattr(fence, "fenced", 0),
        "blind_holds": getattr(fence, "blind_holds", 0),
        "fence_seconds": round(getattr(fence, "fence_seconds", 0.0), 3),
        "fencing_now": getattr(fence, "fencing", 0),
    }


__all__ = [
    "KernelSockets",
    "PeerAddresses",
    "QueuedSocket",
    "SendQueueFence",
    "fence_stats",
    "parse_proc_net_tcp",
    "probe_reader",
    "read_proc_net_tcp",
    "read_sock_diag",
    "resolve_host",
]
