# SPDX-License-Identifier: Apache-2.0
"""Worker-side mirror of the scheduler's prefix cache: hash -> block id.

Fed in order with the scheduler's :class:`HashDelta` s; read from the bootstrap
server's thread, hence the lock. Keys are ``BlockHashWithGroupId`` bytes; a key
may be held by several blocks, a block holds at most one. A block's generation
is bumped whenever its cached identity changes: a push whose blocks' generations
changed by the end of its write must be reported failed. Removals and resets act
at once; with ``defer_stores`` a store is published only once its step completed.
The feed (feed_protocol.py) logs published keys gained and lost, until a reset;
a feed reader waiting for a change is woken when the log moves (:meth:`watch`).
"""

import itertools
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vllm.logger import init_logger

from .feed_protocol import (
    FEED_LOG_MAX,
    FEED_PAGE_MAX_EVENTS,
    FEED_SNAPSHOT_MAX_KEYS,
    FeedPage,
)
from .hash_config import HashConfig
from .hashing import BlockHash, from_pool_key, to_pool_key
from .scheduler_recorder import HashDelta, HashEventKind

logger = init_logger(__name__)


class BlockHashTable:
    def __init__(self, defer_stores: bool = False, feed_log_max: int = FEED_LOG_MAX):
        self.defer_stores = defer_stores
        self.hash_config: HashConfig | None = None
        self._lock = threading.Lock()
        # key -> block ids holding it (dict as an insertion-ordered set)
        self._by_key: dict[bytes, dict[int, None]] = {}
        self._by_block: dict[int, bytes] = {}  # committed: block id -> key
        self._pending: dict[int, bytes] = {}  # stored by the current step
        # steps whose forward was launched, oldest first: (event, their stores)
        self._sealed: list[tuple[Any, dict[int, bytes]]] = []
        self._gen: dict[int, int] = {}
        self._resets = 0  # the scheduler's prefix-cache resets applied so far
        # the feed: this process's epoch, the last change's number, the kept changes
        # ("+"/"-" + key hex; numbered _feed_first .. _feed_seq) since the last reset
        self.feed_epoch = secrets.token_hex(8)
        self._feed_seq = 0
        self._feed_first = 1
        self._feed: list[str] = []
        self._feed_max = feed_log_max
        # feed readers waiting for a change; called under the lock: must not block
        self._wakes: set[Callable[[], None]] = set()

    # ---- updates (worker thread) -------------------------------------------
    def apply(self, delta: HashDelta) -> None:
        """Apply a drained delta in order. Raises ``HashConfigMismatchError``
        if its hash configuration differs from the one seen before."""
        with self._changing():
            if delta.hash_config is not None:
                if self.hash_config is None:
                    self.hash_config = delta.hash_config
                else:
                    self.hash_config.check_same(delta.hash_config)
            if delta.resets < self._resets:
                # drained before a reset applied already: its stores name blocks
                # the cache has forgotten
                return
            if delta.resets > self._resets:
                self._resets = delta.resets
                # NOTE: resets this table was not told of (a notice failed): what it
                # holds predates them, unless the delta opens with the reset itself
                if not delta.events or delta.events[0][0] != HashEventKind.CLEARED:
                    self._clear()
            for kind, key, block_id in delta.events:
                if kind == HashEventKind.STORED:
                    self._store(key, block_id)
                elif kind == HashEventKind.REMOVED:
                    self._remove(key, block_id)
                elif kind == HashEventKind.CLEARED:
                    self._clear()
                else:
                    raise ValueError(f"unknown hash event kind {kind!r}")

    def clear(self, resets: int) -> None:
        """The scheduler's ``resets``-th prefix-cache reset: forget every block now."""
        with self._changing():
            if resets > self._resets:
                self._resets = resets
                self._clear()

    def clear_next(self, resets: int) -> int | None:
        """:meth:`clear` if ``resets`` is the next reset (one more than applied):
        None once cleared, else the resets applied (nothing changed)."""
        with self._changing():
            if resets != self._resets + 1:
                return self._resets
            self._resets = resets
            self._clear()
            return None

    def resets_applied(self) -> int:
        with self._lock:
            return self._resets

    def seal_pending(self, event: Any = None) -> None:
        """Forward launched; ``event.query()`` says when it completed (None: done)."""
        with self._changing():
            if self._pending:
                self._sealed.append((event, self._pending))
                self._pending = {}
                if event is not None:  # readers look again until it completes
                    self._wake()

    def commit_ready(self) -> int:
        """Publish the sealed steps whose event has completed, in order; returns how many
        stores became visible."""
        n = 0
        with self._changing():
            while self._sealed:
                event, stores = self._sealed[0]
                if event is not None and not event.query():
                    break
                self._sealed.pop(0)
                for block_id, key in stores.items():
                    self._insert(key, block_id)
                n += len(stores)
        return n

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """The lock, and the watchers woken on leaving it if the feed moved."""
        with self._lock:
            seq = self._feed_seq
            yield
            if self._feed_seq != seq:
                self._wake()

    def _wake(self) -> None:
        for wake in self._wakes:
            wake()

    def watch(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from the thread that changes the table, holding its lock:
        it must return at once) whenever the feed moves or a step is sealed whose
        event must complete before it is published."""
        with self._lock:
            self._wakes.add(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakes.discard(wake)

    def awaits_device(self) -> bool:
        """A sealed step waits for its device event. Its stores are published by
        the first :meth:`commit_ready` that finds the event complete, which no one
        signals: a reader waiting for the feed must look again while this holds."""
        with self._lock:
            return any(event is not None for event, _ in self._sealed)

    def _unpublished(self, block_id: int) -> dict[int, bytes] | None:
        """The not yet published stores (current or sealed step) holding block_id."""
        if block_id in self._pending:
            return self._pending
        for _, stores in self._sealed:
            if block_id in stores:
                return stores
        return None

    def _bump(self, block_id: int) -> None:
        self._gen[block_id] = self._gen.get(block_id, 0) + 1

    def _log(self, event: str) -> None:
        self._feed_seq += 1
        self._feed.append(event)
        if len(self._feed) > self._feed_max:  # trim by half: amortised O(1)
            cut = len(self._feed) - self._feed_max // 2
            del self._feed[:cut]
            self._feed_first += cut

    def _insert(self, key: bytes, block_id: int) -> None:
        self._by_block[block_id] = key
        holders = self._by_key.setdefault(key, {})
        if not holders:
            self._log("+" + key.hex())
        holders[block_id] = None

    def _drop(self, block_id: int) -> None:
        key = self._by_block.pop(block_id)
        holders = self._by_key[key]
        del holders[block_id]
        if not holders:
            del self._by_key[key]
            self._log("-" + key.hex())

    def _store(self, key: bytes, block_id: int) -> None:
        unpublished = self._unpublished(block_id)
        if self._by_block.get(block_id) == key or (
            unpublished is not None and unpublished[block_id] == key
        ):
            return  # idempotent
        # Re-stored under another key without a removal: the block was
        # reused, its old hash must never be served again.
        if block_id in self._by_block:
            self._drop(block_id)
            self._bump(block_id)
        if unpublished is not None:
            del unpublished[block_id]
            self._bump(block_id)
        # vLLM caches a block when it is scheduled, before its KV is computed (on
        # CUDA, get_finished runs at launch): publish it once its step completed
        if self.defer_stores:
            self._pending[block_id] = key
        else:
            self._insert(key, block_id)

    def _remove(self, key: bytes, block_id: int) -> None:
        if self._by_block.get(block_id) == key:
            self._drop(block_id)
            self._bump(block_id)
        elif (unpublished := self._unpublished(block_id)) is not None and unpublished[
            block_id
        ] == key:
            del unpublished[block_id]
            self._bump(block_id)
        # else: stale removal (block now holds another key, or unknown): ignore

    def _clear(self) -> None:
        sealed = [b for _, stores in self._sealed for b in stores]
        for block_id in itertools.chain(self._by_block, self._pending, sealed):
            self._bump(block_id)
        self._by_key.clear()
        self._by_block.clear()
        self._pending.clear()
        self._sealed = [(event, {}) for event, _ in self._sealed]
        # nothing before a reset can be continued from: peers take a snapshot
        self._feed_seq += 1
        self._feed = []
        self._feed_first = self._feed_seq + 1

    # ---- reads (bootstrap-server thread) -----------------------------------
    def _match(self, hashes: Sequence[BlockHash], group_id: int) -> list[int]:
        out: list[int] = []
        for block_hash in hashes:
            holders = self._by_key.get(to_pool_key(block_hash, group_id))
            if not holders:
                break
            out.append(next(iter(holders)))
        return out

    def match_prefix(self, hashes: Sequence[BlockHash], group_id: int = 0) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (group ``group_id``)."""
        with self._lock:
            return self._match(hashes, group_id)

    def match_and_snapshot(
        self, hashes: Sequence[BlockHash], group_id: int = 0
    ) -> tuple[list[int], list[int]]:
        """:meth:`match_prefix` plus the matched blocks' generations, atomically."""
        with self._lock:
            block_ids = self._match(hashes, group_id)
            return block_ids, [self._gen.get(b, 0) for b in block_ids]

    def feed_page(
        self, epoch: str | None, since: int, block_size: int
    ) -> FeedPage | None:
        """A peer's next page (changes since its position, or a reset page); None
        before any step has run."""
        with self._lock:
            cfg = self.hash_config
            if cfg is None:
                return None
            continues = (
                epoch == self.feed_epoch
                and self._feed_first - 1 <= since <= self._feed_seq
            )
            if continues:
                start = since - (self._feed_first - 1)
                events = self._feed[start : start + FEED_PAGE_MAX_EVENTS]
                seq, more = since + len(events), since + len(events) < self._feed_seq
                keys: list[bytes] = []
            else:  # the most recently cached keys first
                keys = list(
                    itertools.islice(reversed(self._by_key), FEED_SNAPSHOT_MAX_KEYS)
                )
                seq, more = self._feed_seq, False
        if not continues:  # encoded outside the lock the worker's step takes
            events = ["+" + k.hex() for k in keys]
        # built from this table's own state: no validation (the peer validates)
        return FeedPage.model_construct(
            epoch=self.feed_epoch,
            seq=seq,
            reset=not continues,
            events=events,
            more=more,
            hash_algo=cfg.hash_algo,
            none_hash=cfg.none_hash.hex(),
            scheduler_id=cfg.scheduler_id,
            block_size=block_size,
        )

    def feed_position(self) -> int:
        with self._lock:
            return self._feed_seq

    def generations(self, block_ids: Sequence[int]) -> list[int]:
        with self._lock:
            return [self._gen.get(b, 0) for b in block_ids]

    def generations_unchanged(
        self, block_ids: Sequence[int], gens: Sequence[int]
    ) -> bool:
        if len(block_ids) != len(gens):
            raise ValueError("block_ids and gens differ in length")
        with self._lock:
            return all(self._gen.get(b, 0) == g for b, g in zip(block_ids, gens))

    def lookup(self, key: bytes) -> list[int]:
        """Committed block ids holding a block-pool key (hash + group id)."""
        with self._lock:
            return list(self._by_key.get(key, ()))

    def size(self) -> int:
        """Number of cached (committed) blocks."""
        with self._lock:
            return len(self._by_block)

    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending) + sum(len(stores) for _, stores in self._sealed)

    def sample(self, n: int) -> list[dict[str, int | str]]:
        """Up to ``n`` committed entries, for a debug endpoint."""
        with self._lock:
            items = list(itertools.islice(self._by_block.items(), max(n, 0)))
        out: list[dict[str, int | str]] = []
        for block_id, key in items:
            block_hash, group_id = from_pool_key(key)  # type: ignore[arg-type]
            out.append(
                {
                    "block_id": block_id,
                    "group_id": group_id,
                    "block_hash": block_hash.hex(),
                }
            )
        return out
