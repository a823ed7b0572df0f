# SPDX-License-Identifier: Apache-2.0
"""D's admission of incoming transfers: at most N pulls written into D at once.

In a burst every pull would reach P at once and hold D's blocks while P's queue
drains. :class:`PullAdmission` bounds the pulls in flight into D
(``MOONCAKE_DECODE_MAX_PULLS``); a request beyond it waits in D's queue, in order,
without blocks and without asking P, and after ``MOONCAKE_DECODE_PULL_WAIT_S`` is
prefilled on D (P is told to free its copy). That wait stays below P's
MOONCAKE_LAYERWISE_TIMEOUT_S, so an admitted pull still finds P's KV. Scheduler
thread only (no lock); state is bounded by D's waiting queue plus ``max_pulls``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable

from vllm.logger import init_logger

logger = init_logger(__name__)


class Verdict(enum.Enum):
    ADMIT = "admit"  # allocate and pull now
    WAIT = "wait"  # stay in the waiting queue; ask again next step
    PREFILL_LOCALLY = "prefill_locally"  # waited its whole bound


class PullAdmission:
    def __init__(
        self,
        max_pulls: int,
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_pulls`` 0: no bound (every pull admitted at once)."""
        self.max_pulls = max_pulls
        self.wait_s = wait_s
        self._clock = clock
        self._in_flight: set[str] = set()
        self._queued_since: dict[str, float] = {}  # request -> first told to wait
        # waited the whole bound: prefilled here, also when asked again (the
        # scheduler asks again if it could not allocate the request's blocks)
        self._local: set[str] = set()

    def ask(self, req_id: str) -> Verdict:
        """May ``req_id``'s pull start now? Asked each step until :meth:`started`."""
        if req_id in self._local:
            return Verdict.PREFILL_LOCALLY
        if (
            not self.max_pulls
            or req_id in self._in_flight
            or len(self._in_flight) < self.max_pulls
        ):
            return Verdict.ADMIT
        now = self._clock()
        since = self._queued_since.get(req_id)
        if since is None:
            self._queued_since[req_id] = now
            return Verdict.WAIT
        if now - since < self.wait_s:
            return Verdict.WAIT
        self._queued_since.pop(req_id)
        self._local.add(req_id)
        logger.warning(
            "Request %s waited %.0f s for one of MOONCAKE_DECODE_MAX_PULLS=%d incoming "
            "transfers (MOONCAKE_DECODE_PULL_WAIT_S=%g): prefilling it on this decode "
            "instance instead (the prefill instance is told to free its copy). Raise "
            "MOONCAKE_DECODE_MAX_PULLS, or add prefill capacity.",
            req_id,
            now - since,
            self.max_pulls,
            self.wait_s,
        )
        return Verdict.PREFILL_LOCALLY

    def queued_since(self, req_id: str) -> float | None:
        """When ``req_id`` was first told to wait (None: admitted at once)."""
        return self._queued_since.get(req_id)

    def started(self, req_id: str) -> None:
        """``req_id``'s blocks were allocated: its pull is in flight."""
        self._queued_since.pop(req_id, None)
        self._in_flight.add(req_id)

    def ended(self, req_ids: Iterable[str]) -> None:
        """These pulls' ends (KV arrived, or the pull failed) reached the scheduler."""
        for rid in req_ids:
            self._in_flight.discard(rid)

    def forget(self, req_id: str) -> None:
        """``req_id`` finished (any way): it holds no slot and no place in the queue."""
        self._in_flight.discard(req_id)
        self._queued_since.pop(req_id, None)
        self._local.discard(req_id)
