# SPDX-License-Identifier: Apache-2.0
"""Connections to the bootstrap server: few at once, and none idle without a request.

The routes check a request's credentials before they read its body
(routes.py), but uvicorn waits for a request's headers without a deadline: a
connection that sends nothing, or a request line and then one header byte a
minute, stays open for ever, and each costs the process that holds the model
and the KV cache a socket and a buffer. Nothing authenticates a connection
before its headers have arrived, so the only limits that hold for callers
without credentials are these, in uvicorn's h11 protocol
(:class:`LimitedH11Protocol`, used by prefill_bootstrap.py):

- a request's headers must be complete within HEADER_DEADLINE_S of the
  connection's opening, or of the previous response's end; else the
  connection is closed (a request whose headers have arrived is bounded by the
  routes: its body within BODY_READ_DEADLINE_S, auth.py);
- at most MAX_CONNECTIONS are open at once; one beyond is closed at once, with
  a warning at most once a minute.

A flood of connections can still keep callers with credentials out for as
long as it lasts (each connection of it lives at most HEADER_DEADLINE_S);
a firewall or TLS proxy in front is the place to limit by source address.
Verified on the CPU backend's bootstrap server with uvicorn 0.54.0 (both
releases' virtualenvs).
"""

from __future__ import annotations

import asyncio
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from vllm.logger import init_logger

logger = init_logger(__name__)

HEADER_DEADLINE_S = 10.0
MAX_CONNECTIONS = 256
WARN_EVERY_S = 60.0


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the two limits of the module docstring."""

    header_deadline_s = HEADER_DEADLINE_S
    max_connections = MAX_CONNECTIONS
    _headers_timer: asyncio.TimerHandle | None = None
    _last_warned = -WARN_EVERY_S  # class-wide: one warning a minute per process

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            now = time.monotonic()
            if now - LimitedH11Protocol._last_warned >= WARN_EVERY_S:
                LimitedH11Protocol._last_warned = now
                logger.warning(
                    "bootstrap server: %d connections open, the most it keeps; closing "
                    "new ones until some end (each without a request ends within %.0f s)",
                    self.max_connections,
                    self.header_deadline_s,
                )
            self.transport.close()
            return
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers are in: the route bounds the body

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers, in the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._headers_timer = self.loop.call_later(
            self.header_deadline_s, self._headers_late
        )

    def _disarm(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_late(self) -> None:
        self._headers_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


__all__ = ["HEADER_DEADLINE_S", "MAX_CONNECTIONS", "LimitedH11Protocol"]
