# SPDX-License-Identifier: Apache-2.0
"""Scheduler-process recorder of prefix-cache changes (BlockPool's observer).

Set as ``block_pool.block_hash_observer`` by scheduler_sync.py and drained into a
:class:`HashDelta` each step. A reset is also told at once, before it returns (to
listeners in this process, else ``worker_notifier``): an idle instance takes no
step, and its mirror must not offer forgotten blocks meanwhile. Imports nothing
heavy (``block_pool.py`` imports it); single-threaded: the pool and
``build_connector_meta`` run on the engine core's scheduler thread.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from vllm.logger import init_logger

from .hash_config import HashConfig

logger = init_logger(__name__)

# Beyond this many undrained events the recorder drops them and emits one
# CLEARED event instead: the worker then forgets everything (safe: it only
# loses matches, it never serves a stale block).
DEFAULT_MAX_PENDING = 1 << 20


class HashEventKind(IntEnum):
    STORED = 0  # block_id now cached under key
    REMOVED = 1  # block_id no longer cached under key (evicted / about to be reused)
    CLEARED = 2  # the whole prefix cache was reset (key b"", block_id -1)


# (kind, BlockHashWithGroupId bytes, block id): plain tuples pickle compactly.
HashEvent = tuple[int, bytes, int]


@dataclass
class HashDelta:
    """Ordered prefix-cache changes since the previous drain."""

    events: list[HashEvent] = field(default_factory=list)
    # The scheduler's hash configuration, carried with every delta so a worker
    # can hash pushes the same way (and fail loudly if it ever changes).
    hash_config: HashConfig | None = None
    # prefix-cache resets recorded before this delta was drained
    resets: int = 0

    def __len__(self) -> int:
        return len(self.events)


class HashRecorder:
    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.enabled: bool = False
        self.max_pending = max_pending
        self.hash_config: HashConfig | None = None
        self._events: list[HashEvent] = []
        self._overflowed = False
        self.resets = 0  # prefix-cache resets recorded so far
        self._reset_listeners: list[Callable[[int], None]] = []
        # told instead when no listener is in this process (the worker's own)
        self.worker_notifier: Callable[[int], None] | None = None

    def add_reset_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(resets)`` on every prefix-cache reset, on the thread that
        resets (the engine core's), before the reset returns."""
        self._reset_listeners.append(listener)

    def remove_reset_listener(self, listener: Callable[[int], None]) -> None:
        if listener in self._reset_listeners:
            self._reset_listeners.remove(listener)

    def enable(self, hash_config: HashConfig | None = None) -> None:
        self.enabled = True
        if hash_config is not None:
            self.hash_config = hash_config

    def set_hash_config(self, hash_config: HashConfig) -> None:
        self.hash_config = hash_config

    def _append(self, event: HashEvent) -> None:
        if len(self._events) >= self.max_pending:
            if not self._overflowed:
                logger.warning(
                    "hashsync: %d undrained prefix-cache events; dropping them "
                    "and clearing the worker-side table",
                    len(self._events),
                )
                self._overflowed = True
            self._events = [(HashEventKind.CLEARED, b"", -1)]
        self._events.append(event)

    def record_stored(self, key: bytes, block_id: int) -> None:
        if self.enabled:
            self._append((HashEventKind.STORED, key, block_id))

    def record_removed(self, key: bytes, block_id: int) -> None:
        if self.enabled:
            self._append((HashEventKind.REMOVED, key, block_id))

    def record_cleared(self) -> None:
        if not self.enabled:
            return
        self.resets += 1
        # Everything before a reset is moot for the worker.
        self._events = [(HashEventKind.CLEARED, b"", -1)]
        listeners = tuple(self._reset_listeners) or (
            (self.worker_notifier,) if self.worker_notifier is not None else ()
        )
        for listener in listeners:
            try:
                listener(self.resets)
            except Exception:  # the pool's reset has happened: it must not fail
                logger.exception(
                    "hashsync: a listener failed on a prefix-cache reset; the "
                    "worker-side table forgets the cache with the next step"
                )

    def drain(self) -> HashDelta:
        events, self._events = self._events, []
        self._overflowed = False
        return HashDelta(
            events=events, hash_config=self.hash_config, resets=self.resets
        )


_RECORDER = HashRecorder()


def get_recorder() -> HashRecorder:
    return _RECORDER
