# SPDX-License-Identifier: Apache-2.0
"""Peers whose writes keep failing are refused for a while, visibly.

Every engine write of a worker goes through a :class:`~.engine_write.TerminalWriter`,
which asks here first. After REFUSE_AFTER failed writes in a row to a peer, writes
to it are refused for REFUSE_FIRST_S, twice as long on each new refusal (at most
REFUSE_MAX_S); one successful write ends it. A failed write holds blocks until the
kernel delivers or drops its bytes; a refused one submits nothing, so none can land.
A peer is its session *and* the KV layout asked for, so a caller naming a victim's
session with a layout of its own cannot get the victim's writes refused.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(__name__)

REFUSE_AFTER = 3  # failed writes in a row to one peer
REFUSE_FIRST_S = 30.0
REFUSE_MAX_S = 240.0
PEERS_KEPT = 4096  # peers remembered (least recently written to forgotten first)

# A destination's KV layout (its base addresses, in order); None where the caller
# does not know it (upstream's post-hoc send).
Layout = tuple[int, ...] | None


@dataclass
class _Peer:
    failures: int = 0  # failed writes in a row
    refused_until: float = 0.0  # this clock; 0: not refused
    refusal_s: float = 0.0  # the last refusal's length (0: none yet)


class RefusedPeers:
    """Per peer: failed writes in a row, refused after ``refuse_after``. Thread-safe."""

    def __init__(
        self,
        refuse_after: int = REFUSE_AFTER,
        first_s: float = REFUSE_FIRST_S,
        max_s: float = REFUSE_MAX_S,
        kept: int = PEERS_KEPT,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.refuse_after = refuse_after
        self.first_s = first_s
        self.max_s = max_s
        self.kept = kept
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: collections.OrderedDict[tuple[str, Layout], _Peer] = (
            collections.OrderedDict()
        )
        self.refusals = 0  # refusals started (observability)
        self.refused_writes = 0  # writes refused in all

    def refusal(self, session: str, layout: Layout = None) -> str | None:
        """Why a write to ``session`` with ``layout`` is refused now (counted), or None."""
        with self._lock:
            peer = self._peers.get((session, layout))
            if peer is None:
                return None
            left = peer.refused_until - self._clock()
            if left <= 0:
                return None
            self.refused_writes += 1
            return (
                f"writes to {session} are refused for another {left:.0f} s: its last "
                f"{peer.failures} writes failed (a peer that is down or cut off); "
                "nothing written"
            )

    def record(self, session: str, ok: bool, layout: Layout = None) -> None:
        """A write to ``session`` with ``layout`` ended, written (``ok``) or failed."""
        key = (session, layout)
        with self._lock:
            if ok:
                peer = self._peers.pop(key, None)
                if peer is not None and peer.refusal_s:
                    logger.info(
                        "transfer-engine writes to %s succeed again; no longer refused",
                        session,
                    )
                return
            peer = self._peers.get(key)
            if peer is None:
                peer = self._peers[key] = _Peer()
            self._peers.move_to_end(key)
            while len(self._peers) > self.kept:
                self._peers.popitem(last=False)
            peer.failures += 1
            now = self._clock()
            if (
                self.refuse_after <= 0
                or peer.failures < self.refuse_after
                or peer.refused_until > now  # a write started before the refusal
            ):
                return
            peer.refusal_s = (
                min(self.max_s, 2 * peer.refusal_s) if peer.refusal_s else self.first_s
            )
            peer.refused_until = now + peer.refusal_s
            self.refusals += 1
            logger.warning(
                "the last %d transfer-engine writes to %s failed: writes to it are "
                "refused for %.0f s (the requests that need it fail at once, or fall "
                "back as the decode instance's kv_load_failure_policy says); after "
                "that it is tried again, and one write that succeeds ends this",
                peer.failures,
                session,
                peer.refusal_s,
            )

    def num_refused(self) -> int:
        """Peers refused now."""
        now = self._clock()
        with self._lock:
            return sum(1 for p in self._peers.values() if p.refused_until > now)


__all__ = ["Layout", "RefusedPeers"]
