# SPDX-License-Identifier: Apache-2.0
"""Who may call this series' bootstrap-server endpoints, and how a call proves it.

``/push_blocks`` makes this instance write into a peer's memory, ``/match_blocks``
and ``/hashsync`` reveal its prefix cache; upstream's server authenticates nothing.
With ``MOONCAKE_BOOTSTRAP_TOKEN`` set (the same everywhere, never sent) D signs its
POSTs (:func:`sign`) and C accepts one only with a valid signature, a timestamp in
its window and an unseen nonce; GET routes take a Bearer :func:`read_key`. Without a
token: open on loopback, else closed (403) unless ``MOONCAKE_BOOTSTRAP_INSECURE=1``.
Token holders are trusted alike, a request can be replayed once to another instance,
bodies travel in clear. TLS: bind to loopback with a token behind a TLS proxy that
forwards the path, ``Authorization`` and ``x-mooncake-source-refusal`` unchanged, and
list the source as ``https://host:port`` in D's MOONCAKE_PUSH_SOURCES.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm.logger import init_logger

from .config import ExtConfig

logger = init_logger(__name__)

HEADER = "authorization"
SCHEME = "Mooncake-HMAC-SHA256"
CONTEXT = b"mooncake-push-v1"
# the GET routes' bearer key is derived from the token (read_key), never the token
READ_CONTEXT = b"mooncake-read-v1"
# nonces remembered at once (32 hex digits each): with the default window of 35 s,
# about 1900 signed requests a second
NONCES_KEPT = 1 << 16

# a signed body must arrive whole within this after its headers (408 beyond)
BODY_READ_DEADLINE_S = 10.0

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MS = re.compile(r"[0-9]{1,16}")


def read_key(token: str) -> str:
    """The GET routes' bearer key: a leaked one cannot sign, nor yield the token."""
    return hmac.new(token.encode(), READ_CONTEXT, hashlib.sha256).hexdigest()


def body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def signature(
    token: str, method: str, target: str, timestamp_ms: str, nonce: str, digest: str
) -> str:
    """Hex HMAC-SHA256 over context, method, target, timestamp, nonce and body hash."""
    msg = b"\n".join(
        [
            CONTEXT,
            method.upper().encode(),
            target.encode("latin-1"),
            timestamp_ms.encode(),
            nonce.encode(),
            digest.encode(),
        ]
    )
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def sign(
    token: str,
    method: str,
    target: str,
    body: bytes,
    now_ms: int | None = None,
    nonce: str | None = None,
) -> str:
    """The Authorization value of one signed request."""
    t = str(int(time.time() * 1000) if now_ms is None else now_ms)
    n = secrets.token_hex(16) if nonce is None else nonce
    b = body_hash(body)
    return f"{SCHEME} t={t},n={n},b={b},s={signature(token, method, target, t, n, b)}"


def parse_signed(authorization: str | None) -> tuple[str, str, str, str] | None:
    """(timestamp, nonce, body hash, signature) of a well-formed signed header."""
    scheme, _, params = (authorization or "").partition(" ")
    if scheme.lower() != SCHEME.lower():
        return None
    fields: dict[str, str] = {}
    for part in params.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key in fields:
            return None
        fields[key] = value
    if fields.keys() != {"t", "n", "b", "s"}:
        return None
    t, n, b, s = fields["t"], fields["n"], fields["b"], fields["s"]
    if not (
        _MS.fullmatch(t)
        and _HEX32.fullmatch(n)
        and _HEX64.fullmatch(b)
        and _HEX64.fullmatch(s)
    ):
        return None
    return t, n, b, s


class NonceMemory:
    """Accepted nonces until they expire, at most ``capacity``. Full, it forgets the
    one expiring first and refuses all expiring no later (``floor_ms``), so none can
    be replayed; a flood shuts others out for about the clock skew accepted ahead."""

    def __init__(self, capacity: int = NONCES_KEPT):
        self.capacity = capacity
        self.floor_ms = 0  # requests expiring at or before this are refused
        self._expiry: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def add(self, nonce: str, expires_ms: int, now_ms: int) -> str | None:
        """Remember ``nonce``; None if new, "replay" if remembered, "older" if it
        expires no later than a nonce already forgotten (it may be a replay)."""
        with self._lock:
            while self._heap and self._heap[0][0] <= now_ms:
                _, old = heapq.heappop(self._heap)
                self._expiry.pop(old, None)
            if nonce in self._expiry:
                return "replay"
            while len(self._expiry) >= self.capacity:
                forgotten, old = heapq.heappop(self._heap)
                del self._expiry[old]
                self.floor_ms = max(self.floor_ms, forgotten)
            if expires_ms <= self.floor_ms:
                return "older"
            self._expiry[nonce] = expires_ms
            heapq.heappush(self._heap, (expires_ms, nonce))
            return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)


@dataclass(frozen=True)
class Verified:
    """``denied``: (status, reason) or None; ``signed_ms``: None when open."""

    denied: tuple[int, str] | None = None
    signed_ms: int | None = None


class EndpointGuard:
    def __init__(
        self,
        config: ExtConfig,
        wall_clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        nonces: NonceMemory | None = None,
    ):
        self._token = config.bootstrap_token
        self._read_key = read_key(self._token) if self._token is not None else None
        self.host = config.bootstrap_host
        self.open = self._token is None and (
            config.bootstrap_loopback or config.bootstrap_insecure
        )
        self.closed = self._token is None and not self.open
        self._insecure = (
            config.bootstrap_insecure
            and self._token is None
            and not config.bootstrap_loopback
        )
        # a signed request is accepted this long either side of this instance's clock
        self.window_ms = int(1000 * (config.push_clock_skew_s + config.push_timeout_s))
        # ... and at most this far ahead of it (D signs right before it sends)
        self.ahead_ms = int(1000 * config.push_clock_skew_s)
        self._now_ms = wall_clock_ms
        self.nonces = nonces if nonces is not None else NonceMemory()

    def log_at_start(self) -> None:
        if self._insecure:
            logger.warning(
                "MOONCAKE_BOOTSTRAP_INSECURE=1: /push_blocks, /match_blocks, /push/stats and /hashsync are "
                "served WITHOUT authentication on %s: anyone who reaches this port can make "
                "this instance write KV into any registered peer. Use only on a trusted network.",
                self.host,
            )
        elif self.closed:
            logger.warning(
                "The bootstrap server binds %s and MOONCAKE_BOOTSTRAP_TOKEN is not set: prefix "
                "push endpoints are closed (403). Set the same MOONCAKE_BOOTSTRAP_TOKEN on every "
                "instance, or MOONCAKE_BOOTSTRAP_HOST=127.0.0.1 for a single host.",
                self.host,
            )

    def _closed(self) -> tuple[int, str]:
        return 403, (
            f"prefix push endpoints are closed: the bootstrap server binds "
            f"{self.host} and no MOONCAKE_BOOTSTRAP_TOKEN is set on this instance"
        )

    def check(self, authorization: str | None) -> tuple[int, str] | None:
        """GET routes: None if the call may proceed, else (HTTP status, reason)."""
        if self.open:
            return None
        if self.closed:
            return self._closed()
        scheme, _, given = (authorization or "").partition(" ")
        assert self._read_key is not None
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.encode(), self._read_key.encode()
        ):
            return 401, (
                "missing or wrong read key (Authorization: Bearer <read key>; the "
                "read key is derived from MOONCAKE_BOOTSTRAP_TOKEN, never the token "
                f"itself: python -m {__name__} read-key)"
            )
        return None

    def check_signed_header(self, authorization: str | None) -> tuple[int, str] | None:
        """Signed routes, before the body is read: None if the header is well formed."""
        if self.open:
            return None
        if self.closed:
            return self._closed()
        if parse_signed(authorization) is None:
            return 401, (
                f"this route takes signed requests only (Authorization: {SCHEME} "
                "t=<unix ms>,n=<32 hex>,b=<SHA-256 of the body>,s=<HMAC-SHA256 with "
                "MOONCAKE_BOOTSTRAP_TOKEN>; auth.py); a bearer token is not accepted here"
            )
        return None

    def verify(
        self, method: str, target: str, authorization: str | None, body: bytes
    ) -> Verified:
        """Signed routes, once the body is read: header, body hash, then nonce."""
        # the signature is checked before the nonce is remembered: an
        # unauthenticated caller cannot fill the nonce memory
        header = self.verify_header(method, target, authorization)
        if header.denied is not None or self.open:
            return header
        parsed = parse_signed(authorization)
        assert parsed is not None
        t, nonce, digest, _ = parsed
        if not hmac.compare_digest(body_hash(body).encode(), digest.encode()):
            return Verified(
                (
                    401,
                    "the body is not the one that was signed (its SHA-256 differs "
                    "from the header's): the request was changed on its way",
                )
            )
        now, signed = self._now_ms(), int(t)
        seen = self.nonces.add(nonce, signed + self.window_ms, now)
        if seen == "replay":
            return Verified(
                (
                    409,
                    "this request was already received (same nonce): a replay "
                    "is refused; every request needs a new nonce",
                )
            )
        if seen == "older":
            return Verified(
                (
                    401,
                    f"more than {self.nonces.capacity} signed requests within "
                    f"{self.window_ms / 1000:g} s: this one is older than what this "
                    "instance still remembers, so it cannot tell it from a replay; "
                    "sign it anew",
                )
            )
        return Verified(None, signed)

    def verify_header(
        self, method: str, target: str, authorization: str | None
    ) -> Verified:
        """Signed routes, before the body is read (only a token holder makes C read
        one): the signature over the header's body hash, then the timestamp's age."""
        if self.open:
            return Verified()
        if (denied := self.check_signed_header(authorization)) is not None:
            return Verified(denied)
        assert self._token is not None
        parsed = parse_signed(authorization)
        assert parsed is not None
        t, nonce, digest, given = parsed
        expected = signature(self._token, method, target, t, nonce, digest)
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return Verified(
                (
                    401,
                    "wrong signature: another MOONCAKE_BOOTSTRAP_TOKEN, or the "
                    "request was changed on its way",
                )
            )
        now, signed = self._now_ms(), int(t)
        if signed - now > self.ahead_ms:
            return Verified(
                (
                    401,
                    (
                        f"the request was signed {(signed - now) / 1000:.1f} s ahead of this "
                        f"instance's clock, more than the {self.ahead_ms / 1000:g} s accepted "
                        "(MOONCAKE_PUSH_CLOCK_SKEW_S): clocks out of sync (NTP)"
                    ),
                )
            )
        if now - signed > self.window_ms:
            return Verified(
                (
                    401,
                    (
                        f"the request was signed {(now - signed) / 1000:+.1f} s from this instance's "
                        f"clock, outside the {self.window_ms / 1000:g} s accepted "
                        "(MOONCAKE_PUSH_CLOCK_SKEW_S + MOONCAKE_PUSH_TIMEOUT_S): a stale or replayed "
                        "request, or clocks out of sync (NTP)"
                    ),
                )
            )
        return Verified(None, signed)


def signed_target(scope: dict) -> str:
    """The path and query an ASGI request was sent with: what the signature covers."""
    path = scope.get("raw_path") or scope.get("path", "").encode()
    query = scope.get("query_string") or b""
    return (path + (b"?" + query if query else b"")).decode("latin-1")


def request_headers(
    config: ExtConfig, method: str, target: str, body: bytes
) -> dict[str, str]:
    """Headers for one call to a push source, signed when a token is set. Make them
    right before sending: the signature's timestamp starts its window."""
    headers = {"content-type": "application/json"}
    if config.bootstrap_token:
        headers["authorization"] = sign(config.bootstrap_token, method, target, body)
    return headers


if __name__ == "__main__":
    import os
    import sys

    if sys.argv[1:] != ["read-key"] or not os.environ.get("MOONCAKE_BOOTSTRAP_TOKEN"):
        sys.exit(
            f"usage: MOONCAKE_BOOTSTRAP_TOKEN=... python -m {__spec__.name} read-key\n"
            "prints the bearer key of the GET routes (/push/stats, /hashsync, "
            "/layerwise/transfers), derived from the token"
        )
    print(read_key(os.environ["MOONCAKE_BOOTSTRAP_TOKEN"]))
