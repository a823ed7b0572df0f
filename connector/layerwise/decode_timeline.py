# SPDX-License-Identifier: Apache-2.0
"""D's scheduler-side timeline of each pull: when the KV came, when the request ran.

:class:`DecodePullTimeline` notes on the scheduler's clock when a pull's end reached
the scheduler, when the request first ran after that, when it finished and when an
admission wait began; the scheduler returns it once in ``kv_transfer_params`` as
``mooncake_timeline``. ``time.monotonic()`` seconds: comparable with P's
``GET /layerwise/transfers`` on one host only. At most ``MAX_TRACKED`` at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

TIMELINE_PARAM = "mooncake_timeline"  # key in D's response kv_transfer_params
MAX_TRACKED = 65536


@dataclass
class PullTimeline:
    """One pull on D (time.monotonic() seconds of D's scheduler process)."""

    allocated: float  # blocks allocated for the remote KV; the pull starts
    # first told to wait for a slot (decode_admission.py); None: admitted at once
    queued: float | None = None
    kv_arrived: float | None = None  # finished_recving reached the scheduler
    scheduled: float | None = None  # first step after kv_arrived that computes it
    finished: float | None = None  # the request finished (first token if max_tokens=1)


class DecodePullTimeline:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tracked: dict[str, PullTimeline] = {}
        self._to_schedule: set[str] = set()  # arrived, not yet scheduled

    def allocated(self, req_id: str, queued: float | None = None) -> None:
        if req_id not in self._tracked and len(self._tracked) < MAX_TRACKED:
            self._tracked[req_id] = PullTimeline(allocated=self._clock(), queued=queued)

    def kv_arrived(self, req_ids: Iterable[str]) -> None:
        now = None
        for rid in req_ids:
            t = self._tracked.get(rid)
            if t is not None and t.kv_arrived is None:
                now = self._clock() if now is None else now
                t.kv_arrived = now
                self._to_schedule.add(rid)

    def step_scheduled(self, num_scheduled_tokens: Mapping[str, int]) -> None:
        if not self._to_schedule:
            return
        ran = [r for r in self._to_schedule if num_scheduled_tokens.get(r)]
        if ran:
            now = self._clock()
            for rid in ran:
                self._tracked[rid].scheduled = now
                self._to_schedule.discard(rid)

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """The request's timeline (once), or None if it was not a timed pull."""
        t = self._tracked.pop(req_id, None)
        self._to_schedule.discard(req_id)
        if t is None:
            return None
        t.finished = self._clock()
        return asdict(t)

    def __len__(self) -> int:
        return len(self._tracked)
