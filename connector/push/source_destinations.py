# SPDX-License-Identifier: Apache-2.0
"""Where C may write: never its own engine, and each destination's KV layout.

:class:`OwnEngine` refuses (409) a destination session on C's own rpc port whose
host is this host's name or ``localhost``, or resolves to a loopback,
unspecified or own address (IPv4-mapped IPv6 as IPv4): strings are not enough,
``127.1:P``, ``[::1]:P`` or ``0.0.0.0:P`` reach C too. A lookup that does not end
in time is refused (C writes only where it can tell it is not itself); a name
the resolver does not know passes (the engine cannot reach it either). Residual:
DNS rebinding between this check and the engine's lookup (D's sessions are IP
literals). :class:`Destinations` records each destination's layout by canonical
``host:port``; another layout is refused while a push into it is written or when
signed no later than the recording push (a replay), else re-registered (a
restarted D).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import ipaddress
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm.logger import init_logger

from .protocol import PushRequestError

logger = init_logger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

RESOLVE_TIMEOUT_S = 1.0
MAX_LOOKUPS = 4  # name lookups in progress at once (a hung resolver holds one each)
DESTINATIONS_KEPT = 1024

_lookups = threading.BoundedSemaphore(MAX_LOOKUPS)


class Unresolved(OSError):
    """A destination host whose lookup did not end in time (or could not start)."""


@dataclass(frozen=True)
class Session:
    host: str  # as given, without IPv6 brackets
    port: int

    @property
    def key(self) -> str:
        """Canonical ``host:port``: an IP literal compressed, a name lower-cased."""
        addr = literal(self.host)
        host = str(addr) if addr is not None else self.host.lower()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def parse_session(session: str) -> Session:
    """``host:port`` / ``[v6]:port`` -> Session; PushRequestError (422) otherwise."""
    host, sep, port = session.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if (
        not sep
        or not host
        or not port.isascii()
        or not port.isdigit()
        or len(port) > 8
        or not 0 < int(port) < 65536
        or any(c.isspace() for c in host)
    ):
        raise PushRequestError(
            "dst_session", f"expected 'host:port', got {session[:100]!r}"
        )
    return Session(host, int(port))


def normalize(addr: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address as IPv4; no IPv6 scope."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return addr.ipv4_mapped
        if addr.scope_id:
            return ipaddress.IPv6Address(str(addr).split("%", 1)[0])
    return addr


def literal(host: str) -> IPAddress | None:
    """The address of a canonical IP literal (no lookup), else None."""
    try:
        return normalize(ipaddress.ip_address(host))
    except ValueError:
        return None


def _getaddrinfo(host: str) -> list[IPAddress]:
    out = []
    for *_, sockaddr in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP):
        with contextlib.suppress(ValueError):
            out.append(normalize(ipaddress.ip_address(sockaddr[0])))
    return out


def resolve(
    host: str,
    timeout_s: float = RESOLVE_TIMEOUT_S,
    lookup: Callable[[str], list[IPAddress]] = _getaddrinfo,
) -> list[IPAddress]:
    """Every address ``host`` names: a literal at once, else a lookup of at most
    ``timeout_s`` on a daemon thread ([] for an unknown name). Unresolved: no
    answer in time, or too many lookups in progress."""
    addr = literal(host)
    if addr is not None:
        return [addr]
    if not _lookups.acquire(blocking=False):
        raise Unresolved(f"{MAX_LOOKUPS} name lookups already in progress")
    done = threading.Event()
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["addrs"] = lookup(host)
        except Exception as e:  # handed to the caller
            result["error"] = e
        finally:
            _lookups.release()
            done.set()

    threading.Thread(target=run, name="mooncake-resolve", daemon=True).start()
    if not done.wait(timeout_s):
        raise Unresolved(f"no answer within {timeout_s:g} s")
    if "error" in result:
        if isinstance(result["error"], socket.gaierror):
            return []
        raise Unresolved(str(result["error"]))
    addrs = result["addrs"]
    assert isinstance(addrs, list)
    return addrs


def _interface_addresses() -> set[IPAddress]:
    """This host's interface addresses (Linux; best effort, empty elsewhere)."""
    out: set[IPAddress] = set()
    with (
        contextlib.suppress(OSError),
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s,
    ):
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name.encode()[:15])
                raw = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
                out.add(ipaddress.IPv4Address(raw[20:24]))
    with contextlib.suppress(OSError, ValueError), open("/proc/net/if_inet6") as f:
        for line in f:
            out.add(ipaddress.IPv6Address(int(line.split()[0], 16)))
    return out


def this_host_addresses(
    own_session_host: str | None = None, timeout_s: float = RESOLVE_TIMEOUT_S
) -> set[IPAddress]:
    """Addresses that reach this host: its interfaces', its hostname's and its
    engine session's host's."""
    out = {normalize(a) for a in _interface_addresses()}
    for host in (socket.gethostname(), own_session_host):
        if host:
            with contextlib.suppress(Unresolved):
                out.update(resolve(host, timeout_s))
    return out


def reaches_this_host(addr: IPAddress, own: Iterable[IPAddress]) -> bool:
    addr = normalize(addr)
    return addr.is_loopback or addr.is_unspecified or addr in own


class OwnEngine:
    """Refuses destinations that are this instance's own transfer engine, or (TP > 1)
    another rank's of this instance on this host (``siblings``)."""

    def __init__(
        self,
        local_session: str,
        addresses: set[IPAddress] | None = None,
        timeout_s: float = RESOLVE_TIMEOUT_S,
        lookup: Callable[[str], list[IPAddress]] = _getaddrinfo,
    ):
        own = parse_session(local_session)
        self.session = local_session
        self.port = own.port
        self.ports = frozenset({own.port})  # this engine's and its siblings'
        self.timeout_s = timeout_s
        self._lookup = lookup
        self.addresses = (
            set(addresses)
            if addresses is not None
            else this_host_addresses(own.host, timeout_s)
        )
        self.addresses |= {a for a in [literal(own.host)] if a is not None}
        self.names = {
            n.lower().rstrip(".")
            for n in ("localhost", socket.gethostname(), own.host)
            if n
        }

    def siblings(self, ports: Iterable[int]) -> None:
        """The engine ports of this instance's other TP ranks, on this host."""
        self.ports = frozenset({self.port, *ports})

    def check(self, session: str) -> Session:
        """The parsed destination; PushRequestError 409 if it is this engine (or
        cannot be told apart from it), 422 if it is no ``host:port``."""
        dst = parse_session(session)
        if dst.port not in self.ports:
            return dst
        name = dst.host.lower().rstrip(".")
        if name in self.names or name.endswith(".localhost"):
            raise PushRequestError(
                "dst_session",
                (
                    f"{session[:100]!r} is this instance's own transfer engine (this host's "
                    f"name, port {dst.port}): a push never writes into its source"
                ),
                409,
            )
        try:
            addrs = resolve(dst.host, self.timeout_s, self._lookup)
        except Unresolved as e:
            raise PushRequestError(
                "dst_session",
                (
                    f"{session[:100]!r} names this instance's engine port and its host did not "
                    f"resolve ({e}): a push is written only where this instance can tell it is "
                    "not its own engine"
                ),
                409,
            ) from None
        hit = next((a for a in addrs if reaches_this_host(a, self.addresses)), None)
        if hit is not None:
            raise PushRequestError(
                "dst_session",
                (
                    f"{session[:100]!r} is this instance's own transfer engine ({hit} port "
                    f"{dst.port}, own session {self.session}): a push never writes into its "
                    "source"
                ),
                409,
            )
        return dst


@dataclass
class _Layout:
    num_blocks: int
    base_addrs: tuple[int, ...]
    signed_ms: int | None  # the push that recorded it (None: not authenticated)
    writing: int = 0  # pushes into this destination being written now


class Destinations:
    """Where C may write: not its own engine, and each destination's layout."""

    def __init__(self, own: OwnEngine, kept: int = DESTINATIONS_KEPT):
        self.own = own
        self.kept = kept
        self._lock = threading.Lock()
        self._layouts: collections.OrderedDict[str, _Layout] = collections.OrderedDict()

    def check(
        self,
        session: str,
        num_blocks: int,
        base_addrs: list[int],
        signed_ms: int | None = None,
    ) -> str:
        """Raise PushRequestError unless a push into ``session`` with this layout
        may be written; record it and return the key for :meth:`writing`.
        ``signed_ms``: the push's signed timestamp, if authenticated."""
        key = self.own.check(session).key
        layout = (num_blocks, tuple(base_addrs))
        with self._lock:
            known = self._layouts.get(key)
            if known is not None and (known.num_blocks, known.base_addrs) != layout:
                why = None
                if known.writing:
                    why = (
                        f"a push into it with that layout is being written ({known.writing} "
                        "now); retry once it has ended"
                    )
                elif (
                    signed_ms is not None
                    and known.signed_ms is not None
                    and signed_ms <= known.signed_ms
                ):
                    why = (
                        "this push is signed no later than the one that registered it "
                        "(a replay of an older push)"
                    )
                if why is not None:
                    raise PushRequestError(
                        "dst_session",
                        (
                            f"{key} was registered with {known.num_blocks} blocks at other "
                            f"base addresses and {why}; a restarted instance is served "
                            "under a new layout only then, or under a new session"
                        ),
                        409,
                    )
                logger.info(
                    "push destination %s re-registered: %d blocks at new base "
                    "addresses (was %d; no push into it in flight); a restarted instance",
                    key,
                    num_blocks,
                    known.num_blocks,
                )
                del self._layouts[key]
                known = None
            if known is None:
                self._layouts[key] = _Layout(num_blocks, tuple(base_addrs), signed_ms)
            elif signed_ms is not None and (
                known.signed_ms is None or signed_ms > known.signed_ms
            ):
                known.signed_ms = signed_ms
            self._layouts.move_to_end(key)
            self._forget_oldest()
        return key

    def _forget_oldest(self) -> None:
        """Beyond ``kept`` destinations, forget the least recently pushed to that
        nothing is being written into. Caller holds _lock."""
        extra = len(self._layouts) - self.kept
        if extra <= 0:
            return
        for key in [k for k, v in self._layouts.items() if not v.writing][:extra]:
            del self._layouts[key]

    @contextlib.contextmanager
    def writing(self, key: str, num_blocks: int, base_addrs: list[int]):
        """A push into ``key`` (a key :meth:`check` returned) with this layout is
        being written: no other layout is registered for it until it ends."""
        layout = (num_blocks, tuple(base_addrs))
        with self._lock:
            known = self._layouts.get(key)
            if known is None or (known.num_blocks, known.base_addrs) != layout:
                # re-registered between the check and the write: refuse it
                raise PushRequestError(
                    "dst_session",
                    f"{key} was re-registered with another layout meanwhile; nothing "
                    "written",
                    409,
                )
            known.writing += 1
        try:
            yield
        finally:
            with self._lock:
                known.writing -= 1
