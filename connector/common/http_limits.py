# SPDX-License-Identifier: Apache-2.0
"""Connections to the bootstrap server: few at once, few from one address, and
every request bounded in time and size before any route sees it.

Nothing authenticates a connection before its headers are in, so
:class:`LimitedH11Protocol` holds every caller to: headers within HEADER_DEADLINE_S,
the body within BODY_DEADLINE_S after them; a body above ``max_body_bytes`` refused;
at most MAX_CONNECTIONS open, MAX_CONNECTIONS_PER_ADDRESS from one address. Not
covered: a flood from many addresses can fill MAX_CONNECTIONS while it lasts, and
peers behind one NAT share one address's room (a firewall's job).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from vllm.logger import init_logger

from .auth import BODY_READ_DEADLINE_S

logger = init_logger(__name__)

HEADER_DEADLINE_S = 10.0
# NOTE: past the signed routes' own deadline (auth.py), so they answer 408 first
BODY_DEADLINE_S = BODY_READ_DEADLINE_S + 2.0
MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_ADDRESS = 64
# until the server sets its own (prefill_bootstrap.py: its routes' largest)
MAX_BODY_BYTES = 1 << 20
WARN_EVERY_S = 60.0

_DISCONNECT = {"type": "http.disconnect"}


def declared_length(scope: dict[str, Any]) -> int | None:
    """A request's Content-Length (h11 has checked it is one whole number)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value)
    return None


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of the module docstring."""

    header_deadline_s = HEADER_DEADLINE_S
    body_deadline_s = BODY_DEADLINE_S
    max_connections = MAX_CONNECTIONS
    max_connections_per_address = MAX_CONNECTIONS_PER_ADDRESS
    max_body_bytes = MAX_BODY_BYTES
    _timer: asyncio.TimerHandle | None = None
    _timed_cycle: object | None = None  # the request whose body deadline was armed
    # class-wide: each kind of warning at most once a minute per process
    _last_warned: ClassVar[dict[str, float]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn runs ``self.app`` for each request: every route, upstream's too,
        # is reached through the body cap
        self._routes = self.app
        self.app = self._capped_app

    @classmethod
    def admitting(cls, max_body_bytes: int) -> type[LimitedH11Protocol]:
        """This protocol, admitting request bodies up to ``max_body_bytes``."""
        return type(cls.__name__, (cls,), {"max_body_bytes": max_body_bytes})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        if len(self.connections) > self.max_connections:
            self._warn(
                "full",
                "bootstrap server: %d connections open, the most it keeps; closing "
                "new ones until some end (each without a whole request ends within "
                "%.0f s)",
                self.max_connections,
                self.header_deadline_s + self.body_deadline_s,
            )
            self.transport.close()
            return
        if address is not None and self._open_from(address) > (
            self.max_connections_per_address
        ):
            self._warn(
                "address",
                "bootstrap server: %d connections open from %s, the most it keeps "
                "from one address; closing new ones from there until some end (a "
                "flood, or more peers behind that address than it allows: give "
                "them their own addresses)",
                self.max_connections_per_address,
                address,
            )
            self.transport.close()
            return
        self._arm(self.header_deadline_s)

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return  # waiting for headers: their deadline is armed
        if not cycle.more_body:
            self._disarm()  # the request is whole: the route answers in its own time
        elif cycle is not self._timed_cycle:
            self._arm(self.body_deadline_s)  # headers in: the body's deadline starts
        self._timed_cycle = cycle

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # NOTE: a pipelined request started in super() has armed its own deadline
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._arm(self.header_deadline_s)  # the next request's headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    async def _capped_app(self, scope: Any, receive: Any, send: Any) -> None:
        cap = self.max_body_bytes
        declared = declared_length(scope)
        if declared is not None and declared > cap:
            await self._too_large(send, declared, cap)
            return
        received = 0

        async def capped_receive() -> Any:
            nonlocal received
            if received > cap:
                return _DISCONNECT
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    self._warn(
                        "body",
                        "bootstrap server: closed a connection from %s: its request "
                        "body grew past %d bytes, the most a route here accepts",
                        self.client[0] if self.client else "?",
                        cap,
                    )
                    self.transport.close()
                    return _DISCONNECT
            return message

        await self._routes(scope, capped_receive, send)

    @staticmethod
    async def _too_large(send: Any, declared: int, cap: int) -> None:
        body = json.dumps(
            {"detail": f"request body of {declared} bytes: at most {cap} accepted"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),  # what follows is not read
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _open_from(self, address: str) -> int:
        return sum(
            1
            for c in self.connections
            if (getattr(c, "client", None) or ("",))[0] == address
        )

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not cycle.more_body:
                return  # whole just now: the route answers
            self._warn(
                "slow body",
                "bootstrap server: closed a connection from %s: its request body "
                "was not whole within %.0f s of its headers",
                self.client[0] if self.client else "?",
                self.body_deadline_s,
            )
        self.transport.close()

    @staticmethod
    def _warn(kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - LimitedH11Protocol._last_warned.get(kind, -WARN_EVERY_S) >= (
            WARN_EVERY_S
        ):
            LimitedH11Protocol._last_warned[kind] = now
            logger.warning(message, *args)


__all__ = [
    "BODY_DEADLINE_S",
    "HEADER_DEADLINE_S",
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "MAX_CONNECTIONS_PER_ADDRESS",
    "LimitedH11Protocol",
]
