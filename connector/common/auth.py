# SPDX-License-Identifier: Apache-2.0
"""Who may call this series' endpoints on the bootstrap server, and how a call proves it.

``/push_blocks`` makes this instance write memory (its transfer engine into a
peer's registered buffers); ``/match_blocks`` and ``/hashsync`` tell what its
prefix cache holds. Upstream's bootstrap server binds 0.0.0.0 and has no
authentication, so these endpoints need their own:

- ``MOONCAKE_BOOTSTRAP_TOKEN`` set: a shared secret, the same on every instance,
  never sent on ``POST /match_blocks`` and ``POST /push_blocks``. D signs each of
  those requests (:func:`request_headers`)::

      Authorization: Mooncake-HMAC-SHA256 t=<unix ms>,n=<nonce>,b=<body hash>,s=<signature>
      body hash = hex SHA-256(body)
      signature = hex HMAC-SHA256(key=token, "mooncake-push-v1" LF method LF path
                                  LF t LF nonce LF body hash)

  (the nonce: 32 random hex digits). The body names ``dst_session`` and the
  push's deadline, so neither can be changed without the secret. C checks the
  header before it reads a byte of the body (:meth:`EndpointGuard.verify_header`:
  the signature over the hash the header names, and the timestamp), so only a
  holder of the secret makes it read a body at all; then it reads the body
  (capped, within BODY_READ_DEADLINE_S) and checks that its hash is the signed
  one (:meth:`EndpointGuard.verify`). C recomputes the signature and compares it
  in constant time (401 if it differs), refuses a timestamp more than
  MOONCAKE_PUSH_CLOCK_SKEW_S + MOONCAKE_PUSH_TIMEOUT_S behind its own clock
  (401: stale) or more than MOONCAKE_PUSH_CLOCK_SKEW_S ahead of it (401: from
  the future), and refuses a nonce it has already accepted (409: a replay). A
  nonce is remembered until its timestamp would be refused as stale anyway, at
  most :data:`NONCES_KEPT` at once; beyond that the oldest is forgotten and
  every request signed no later than it is refused (401, :class:`NonceMemory`),
  so a captured request can be neither replayed nor altered, and a flood of
  signed requests shuts others out for at most the clock skew after it ends.
  A bad signature is refused before its nonce is looked at: an unauthenticated
  caller cannot fill the nonce memory. ``Authorization: Bearer`` is refused on
  these two routes.
  The GET routes (``/push/stats``, ``/hashsync``, ``/layerwise/transfers``;
  read-only) take ``Authorization: Bearer <read key>`` (compared in constant
  time), else 401. The read key is derived from the token (:func:`read_key`;
  ``python -m vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth
  read-key`` prints it): it travels in that header, so a leaked one reads
  statistics but cannot sign, and the token itself is never sent.
- no token, server bound to loopback (``MOONCAKE_BOOTSTRAP_HOST=127.0.0.1``):
  open; only local processes can reach it.
- no token, bound to anything else: closed (403, saying what to set), unless
  ``MOONCAKE_BOOTSTRAP_INSECURE=1`` says the network is trusted (logged loudly).

What the signature does not do: every holder of the secret is trusted alike
(any instance may name any destination session), and a request may be
replayed once to *another* instance that shares the secret within its window
(each instance remembers only the nonces it accepted; such a replay writes the
same prompt's blocks into the same blocks, before the push's deadline). The
bodies travel in clear: an observer learns prompts' token ids and D's layout.

TLS (optional, not built in): the bootstrap server is upstream's plain-HTTP
server. To encrypt, bind it to loopback (``MOONCAKE_BOOTSTRAP_HOST=127.0.0.1``)
with ``MOONCAKE_BOOTSTRAP_TOKEN`` set, and put a TLS-terminating reverse proxy
in front of it on the host's address (nginx ``proxy_pass
http://127.0.0.1:<bootstrap port>``, stunnel, an Envoy sidecar), forwarding
the path and the ``Authorization`` header unchanged (the path is signed),
and the source's ``x-mooncake-source-refusal`` answer header too (D ends a
push early only on an answer carrying it; the proxy's own errors, such as a
504 at its read timeout, keep D's blocks until the push's hold).
List the sources as ``https://host:port`` in D's MOONCAKE_PUSH_SOURCES; D
verifies the proxy's certificate against the system's CA store
(``common/peer_client.py``; no proxy variables are read). The signatures then also
keep working end to end, and the GET routes' read key no longer travels
in clear.

Upstream's own ``/register`` and ``/query`` are left as upstream has them.
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
    """The GET routes' bearer key: hex HMAC-SHA256(token, "mooncake-read-v1"). A
    leaked read key (the header of a GET sent in clear) reads statistics; it cannot
    sign a push, nor be turned back into the token."""
    return hmac.new(token.encode(), READ_CONTEXT, hashlib.sha256).hexdigest()


def body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def signature(
    token: str, method: str, target: str, timestamp_ms: str, nonce: str, digest: str
) -> str:
    """The hex HMAC-SHA256 of one request whose body hashes to ``digest`` (see
    the module docstring)."""
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
    """(timestamp, nonce, body hash, signature) of a well-formed signed
    Authorization value."""
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
    """Nonces of accepted requests, each until it expires, at most ``capacity``.

    Full, it forgets the nonce that expires first and from then on refuses every
    request expiring no later than that one (``floor_ms``), so no forgotten nonce
    can be replayed. A holder of the token who floods signed requests then shuts
    others out only while its own timestamps are ahead of theirs, which the guard
    bounds by the clock skew it accepts ahead of its clock (before, a full memory
    answered 503 to everyone until the flood's nonces expired: 35 s by default).
    """

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
    """What :meth:`EndpointGuard.verify` found: ``denied`` (HTTP status, reason) or
    None; ``signed_ms``: the signed timestamp of an authenticated request (None when
    the endpoints are open)."""

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
        """Signed routes, before the body is read: None if the header may carry a
        valid signature (:meth:`verify` decides once the body is in)."""
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
        """Signed routes, once the body is read: :meth:`verify_header`, then the
        body's hash against the signed one, then the nonce (remembered only now)."""
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
        """Signed routes, before the body is read: the signature over the method,
        the path (``target``, as sent: path and query), the timestamp, the nonce and
        the body hash the header names; then the timestamp's age."""
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
    """The path (and query) of a request as its client sent it (an ASGI scope): what
    the signature covers."""
    path = scope.get("raw_path") or scope.get("path", "").encode()
    query = scope.get("query_string") or b""
    return (path + (b"?" + query if query else b"")).decode("latin-1")


def request_headers(
    config: ExtConfig, method: str, target: str, body: bytes
) -> dict[str, str]:
    """Headers D sends with one call to a push source: signed when a token is set
    (make them right before sending: the signature's timestamp starts its window)."""
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
