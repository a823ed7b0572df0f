# SPDX-License-Identifier: Apache-2.0
"""D's worker side of layer-wise push: how each pull ends, reported exactly once.

Upstream's receiver drops a failed pull, leaving its request waiting forever.
:class:`PullOutcomes` reports a failed or timed-out pull finished with its blocks
invalid (per ``kv_load_failure_policy``), each pull once, and never a cleanup-only
pull (no local blocks). P answers only once no write of the transfer is in flight
(prefill_sender.py), so D reuses blocks only when no write into them can come.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from vllm.logger import init_logger

logger = init_logger(__name__)

ENDED_KEPT_S = 3600.0  # how long an ended pull's id is remembered (double reports)


def _forget_older(seen: collections.OrderedDict[str, float], now: float) -> None:
    """Drop ids remembered for ENDED_KEPT_S, from the oldest: O(1) amortized."""
    while seen:
        oldest, when = next(iter(seen.items()))
        if now - when < ENDED_KEPT_S:
            break
        del seen[oldest]


class PullOutcomes:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # D request id -> when it ended, oldest first (pruned from the front:
        # O(1) amortized per pull however many are remembered)
        self._ended: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._finished: set[str] = set()  # failed pulls to report in finished_recving
        # D request id -> when it was handed to the scheduler in finished_recving
        # (by upstream's receiver or by this tracker), oldest first
        self._reported: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._invalid: set[int] = set()  # their blocks (get_block_ids_with_load_errors)

    def _end(self, d_req_id: str, block_ids: list[int]) -> bool:
        """Under the lock: True on the pull's first end, if it has blocks to report."""
        if d_req_id in self._ended:
            return False
        now = self._clock()
        _forget_older(self._ended, now)
        self._ended[d_req_id] = now
        return bool(block_ids)

    def completed(self, d_req_id: str, block_ids: list[int]) -> bool:
        """All of a pull's KV arrived: True to report it (not a duplicate or cleanup)."""
        with self._lock:
            return self._end(d_req_id, block_ids)

    def failed(self, d_req_id: str, block_ids: list[int], reason: str) -> None:
        """A pull failed: report it once, finished with its blocks invalid."""
        with self._lock:
            if not self._end(d_req_id, block_ids):
                return
            self._finished.add(d_req_id)
            self._invalid.update(block_ids)
        logger.error("KV pull for request %s failed: %s", d_req_id, reason)

    def report_once(self, upstream: set[str]) -> set[str]:
        """This step's finished_recving, each id once ever: 0.32.0's receiver reports
        failures too, and a second report kills the engine (a scheduler assert)."""
        with self._lock:
            candidates = upstream | self._finished
            self._finished = set()
            now = self._clock()
            _forget_older(self._reported, now)
            out = {r for r in candidates if r not in self._reported}
            for r in out:
                self._reported[r] = now
            return out

    def take_invalid_block_ids(self) -> set[int]:
        with self._lock:
            out, self._invalid = self._invalid, set()
            return out
