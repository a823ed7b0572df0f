# SPDX-License-Identifier: Apache-2.0
"""P's layer-wise transfer totals and last timelines (``GET /layerwise/transfers``),
updated under the sender's lock; times are P's ``time.monotonic()`` seconds."""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass
from typing import Any

from ..common.counters import Counters

STATS_KEPT = 256  # transfers whose timeline is kept (the oldest are forgotten)


@dataclass
class TransferStats:
    """Timeline of one transfer on P (time.monotonic() seconds), for tests and benches."""

    transfer_id: str
    prompt_len: int = 0
    first_write_start: float | None = None
    last_write_end: float | None = None
    prefill_end: float | None = (
        None  # P's last layer of the prompt's last chunk computed
    )
    # computed per layer (steps seen); a post-hoc transfer is sent whole by design
    layerwise: bool = False
    destination_at: float | None = None  # D's addresses (its pull) arrived
    # layer-wise, and D's pull arrived after P's prefill had ended: nothing could
    # overlap the prefill (a dispatcher that sends D's request after P's answer)
    destination_after_prefill: bool = False
    bytes_written: int = 0
    bytes_before_prefill_end: int = 0
    writes: int = 0
    writes_dropped: int = 0  # queued writes of an ended transfer that never ran
    # longest a write of it waited in its peer's writer FIFO (queued -> started)
    queue_wait_max_s: float = 0.0
    outcome: str | None = None  # "completed" or the error
    ended_at: float | None = (
        None  # its end was reported (D answered, blocks releasable)
    )


class TransferLog:
    """The totals and the last :data:`STATS_KEPT` transfers' timelines."""

    def __init__(self, kept: int = STATS_KEPT):
        self.kept = kept
        self.totals = Counters(
            writes=0,
            bytes=0,
            writes_dropped=0,
            transfers_completed=0,
            transfers_failed=0,
            # layer-wise transfers whose destination arrived after P's prefill ended
            destination_after_prefill=0,
        )
        self._transfers: collections.OrderedDict[str, TransferStats] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._transfers)

    def get(self, transfer_id: str) -> TransferStats | None:
        return self._transfers.get(transfer_id)

    def of(self, transfer_id: str, prompt_len: int = 0) -> TransferStats:
        """The transfer's timeline, started on first use."""
        st = self._transfers.get(transfer_id)
        if st is None:
            st = self._transfers[transfer_id] = TransferStats(transfer_id)
            while len(self._transfers) > self.kept:
                self._transfers.popitem(last=False)
        if prompt_len:
            st.prompt_len = prompt_len
        return st

    def snapshot(self, waiting_unknown: int) -> dict[str, Any]:
        """What ``GET /layerwise/transfers`` answers."""
        return {
            "totals": {**self.totals, "waiting_unknown": waiting_unknown},
            "transfers": [asdict(s) for s in self._transfers.values()],
        }
