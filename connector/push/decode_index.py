# SPDX-License-Identifier: Apache-2.0
"""D's index of which allowed push source holds which prefix blocks (``push_from: "auto"``).

Fed by each source's signed feed of its block-hash mirror (``POST /hashsync/feed``,
hashsync/feed_protocol.py), one long-polling thread per source; the feed carries
the source's hash configuration, so D hashes a prompt as the source does. A hint
only: the chosen source's ``/match_blocks`` stays the truth, so a stale entry or
a collision of the 64-bit ``hash()`` kept per key costs a round trip, never
wrong KV. Bounded and untrusted: MOONCAKE_PUSH_INDEX_MAX_BLOCKS keys over all
sources (split evenly), a malformed page dropped whole, a source whose blocks
can never match refused, a silent one forgotten after FORGET_AFTER_S, one whose
advertised blocks keep failing demoted for DEMOTE_S, each paced by
:func:`feed_pause`. An instance stops following its own feed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.utils.hashing import get_hash_fn_by_name

from ..common.auth import request_headers
from ..common.config import ExtConfig
from ..common.counters import Counters
from ..common.fingerprint import WarnLimiter
from ..common.peer_client import SourceLanes
from ..hashsync.feed_protocol import (
    FEED_PAGE_MAX_EVENTS,
    FEED_PATH,
    FEED_SNAPSHOT_MAX_KEYS,
    KEY_HEX_MAX,
    FeedPage,
    FeedRequest,
    decode_event,
)
from ..hashsync.hash_config import SCHEDULER_ID
from ..hashsync.hashing import iter_prompt_block_hashes, to_pool_key

logger = init_logger(__name__)

FEED_WAIT_MS = 5_000  # a feed request waits this long at the source for a change
FEED_CALL_SLACK_S = 5.0  # and its answer this much longer
# a page: its most events, each of the longest key in JSON ("+hex", and a comma)
FEED_MAX_ANSWER_BYTES = (
    max(FEED_PAGE_MAX_EVENTS, FEED_SNAPSHOT_MAX_KEYS) * (1 + KEY_HEX_MAX + 3) + 4096
)
FEED_MIN_INTERVAL_S = 0.05  # a source is asked at most once in this long
FEED_WORK_PAUSE = 3.0  # and after a page, this many times what applying it took
REFUSED_RETRY_S = 60.0  # a source whose blocks cannot match is asked again after
FEED_BACKOFF_MAX_S = 5.0  # a failing source is asked again after 1, 2, 4, 5, 5 .. s
NOT_READY_RETRY_S = 1.0  # a source that has not run a step yet is asked again after
FORGET_AFTER_S = 30.0  # a source not answering this long is forgotten
DEMOTE_AFTER = 3  # advertised blocks that failed in a row before a demotion
DEMOTE_S = 60.0
DEFAULT_MAX_BLOCKS = 1 << 20
APPLY_SLICE = 4096  # keys applied per hold of the index's lock


class FeedRejected(ValueError):
    """A page that is not applied (counted and dropped)."""


class SourceRefused(FeedRejected):
    """A source whose blocks can never match this instance's (not a failure)."""


class SourceNotReady(RuntimeError):
    """The source has not run a step yet (503): it holds nothing."""


def feed_pause(started: float, received: float, done: float) -> float:
    """How long to wait before asking a source again: a source answering at once
    takes at most 1 / (1 + FEED_WORK_PAUSE) of its thread's time (and the GIL)."""
    return max(
        FEED_MIN_INTERVAL_S - (done - started), FEED_WORK_PAUSE * (done - received)
    )


def held_runs(
    members: Sequence[tuple[str, set[int]]], keys: Iterable[int]
) -> dict[str, int]:
    """How many of ``keys`` (a prompt's blocks, in order) each source holds in a
    row from the first: drawn one at a time, no further than the last source
    still holding them (sources holding none are left out)."""
    runs: dict[str, int] = {}
    for n, h in enumerate(keys, start=1):
        members = [(origin, held) for origin, held in members if h in held]
        if not members:
            break
        for origin, _ in members:
            runs[origin] = n
    return runs


@dataclass(frozen=True)
class HeldPrefix:
    origin: str
    blocks: int  # leading full blocks of the prompt the index says the source holds


@dataclass
class _Source:
    origin: str
    cap: int  # keys kept at most
    epoch: str | None = None
    seq: int = 0
    config: tuple[str, bytes] | None = None  # (hash algorithm, NONE_HASH)
    keys: set[int] = field(default_factory=set)
    itself: bool = False
    answered_at: float | None = None
    failing_since: float | None = None
    misses: int = 0
    demoted_until: float = 0.0
    refused: str | None = None  # why its blocks cannot match this instance's


class HolderIndex:
    """Which of ``origins`` holds which blocks; thread-safe (feed threads write,
    the scheduler reads)."""

    def __init__(
        self,
        origins: Sequence[str],
        block_size: int,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        own_scheduler_id: str = SCHEDULER_ID,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._own = own_scheduler_id
        self._clock = clock
        cap = max_blocks // max(1, len(origins))
        self._sources = {o: _Source(o, cap) for o in origins}
        self._lock = threading.Lock()
        self._warnings = WarnLimiter(logger)
        self.stats = Counters(
            pages=0,
            keys_stored=0,
            keys_removed=0,
            keys_dropped_full=0,
            pages_malformed=0,
            feed_failures=0,
            forgotten=0,
            demoted=0,
            pages_refused=0,
        )

    @property
    def origins(self) -> list[str]:
        return list(self._sources)

    def position(self, origin: str) -> tuple[str | None, int]:
        with self._lock:
            s = self._sources[origin]
            return s.epoch, s.seq

    # ---- the feed (follower threads) -----------------------------------------
    def apply(self, origin: str, page: FeedPage) -> bool:
        """Apply one page of ``origin``'s feed; True if more changes are waiting.
        FeedRejected (nothing applied) if the page cannot be used; SourceRefused if
        the source's blocks can never match this instance's."""
        try:
            events = [decode_event(e) for e in page.events]
            none_hash = bytes.fromhex(page.none_hash)
        except ValueError as e:
            self.malformed()
            raise FeedRejected(f"a malformed page ({str(e)[:200]})") from None
        why = self._mismatch(page)
        first, was = False, None
        with self._lock:
            s = self._sources[origin]
            s.answered_at, s.failing_since = self._clock(), None
            if why is not None:
                self.stats.add(pages_refused=1)
                s.keys, s.epoch, s.seq, s.config = set(), None, 0, None
                first, s.refused = s.refused != why, why
            else:
                self.stats.add(pages=1)
                was, s.refused = s.refused, None
        if why is not None:
            if first:  # one warning per difference, not one per page
                logger.warning(
                    "Prefix push index: %s is not indexed: %s, so its blocks can "
                    "never be pushed here. Give both instances the same setting; it "
                    "is asked again every %.0f s",
                    origin,
                    why,
                    REFUSED_RETRY_S,
                )
            raise SourceRefused(why)
        if was is not None:
            logger.info(
                "Prefix push index: %s is indexed again (it was refused: %s)",
                origin,
                was,
            )
        with self._lock:
            if page.scheduler_id and page.scheduler_id == self._own:
                s.itself = True
                s.keys = set()
                return False
            config = (page.hash_algo, none_hash)
            if page.reset or page.epoch != s.epoch or config != s.config:
                s.keys = set()
                s.epoch, s.seq, s.config = None, 0, config
            keys = s.keys
        # in slices: a lookup meanwhile sees part of the page (a hint, like the rest)
        for at in range(0, len(events), APPLY_SLICE):
            with self._lock:
                self._apply_slice(s, keys, events[at : at + APPLY_SLICE])
        with self._lock:
            # the position only once the page is in: a failure before asks for it again
            if s.keys is keys:
                s.epoch, s.seq = page.epoch, page.seq
        return page.more

    def _mismatch(self, page: FeedPage) -> str | None:
        """Why ``page``'s source's blocks can never match this instance's, if so
        (not its NONE_HASH: a prompt is hashed with the source's own)."""
        if page.block_size != self.block_size:
            return (
                f"its block size is {page.block_size}, this instance's "
                f"{self.block_size}"
            )
        try:
            get_hash_fn_by_name(page.hash_algo)
        except (ValueError, KeyError):
            return (
                f"it hashes blocks with {page.hash_algo[:64]!r}, which this "
                "instance's vLLM does not implement"
            )
        return None

    def _apply_slice(
        self, s: _Source, keys: set[int], events: list[tuple[bool, bytes]]
    ) -> None:
        for stored, key in events:
            h = hash(key)
            if not stored:
                keys.discard(h)
                self.stats.add(keys_removed=1)
            elif h in keys:
                pass
            elif len(keys) < s.cap:
                keys.add(h)
                self.stats.add(keys_stored=1)
            else:
                self.stats.add(keys_dropped_full=1)
                self._warnings.warn(
                    f"full:{s.origin}",
                    "Prefix push index: %s advertises more than %d blocks "
                    "(MOONCAKE_PUSH_INDEX_MAX_BLOCKS=%d over %d sources); "
                    "its further blocks are not indexed",
                    s.origin,
                    s.cap,
                    self.max_blocks,
                    len(self._sources),
                )

    def malformed(self) -> None:
        with self._lock:
            self.stats.add(pages_malformed=1)

    def is_itself(self, origin: str) -> bool:
        with self._lock:
            return self._sources[origin].itself

    def not_ready(self, origin: str) -> None:
        """``origin`` has not run a step yet: it holds nothing."""
        with self._lock:
            s = self._sources[origin]
            s.answered_at, s.failing_since = self._clock(), None
            s.keys, s.epoch, s.seq, s.config = set(), None, 0, None

    def failed(self, origin: str, why: str) -> None:
        """A feed call of ``origin`` failed; forget its blocks once it has not
        answered for FORGET_AFTER_S."""
        now = self._clock()
        with self._lock:
            s = self._sources[origin]
            self.stats.add(feed_failures=1)
            if s.failing_since is None:
                s.failing_since = now
            silent = now - (s.answered_at or s.failing_since)
            forget = s.epoch is not None and silent >= FORGET_AFTER_S
            if forget:
                s.keys, s.epoch, s.seq, s.config = set(), None, 0, None
                self.stats.add(forgotten=1)
        self._warnings.warn(
            f"feed:{origin}",
            "Prefix push index: the feed of %s failed (%s)%s; asking again",
            origin,
            why[:300],
            "; its blocks are forgotten" if forget else "",
        )

    # ---- lookups (scheduler) ---------------------------------------------------
    def best(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        lora_name: str | None,
        have_blocks: int,
    ) -> HeldPrefix | None:
        """The source holding the longest run of the prompt's leading full blocks,
        if longer than ``have_blocks`` (this instance's own hit); None otherwise.
        Hashes per configuration, no further than the longest run held."""
        if len(token_ids) // self.block_size <= have_blocks:
            return None
        now = self._clock()
        with self._lock:
            groups: dict[tuple[str, bytes], list[tuple[str, set[int]]]] = {}
            for s in self._sources.values():
                usable = s.config is not None and not s.itself and s.keys
                if usable and s.demoted_until <= now:
                    groups.setdefault(s.config, []).append((s.origin, s.keys))
        best: HeldPrefix | None = None
        for (algo, none_hash), members in groups.items():
            # membership tests are atomic under the GIL: a feed thread's concurrent
            # change only makes the answer a moment older (the source has the truth)
            blocks = iter_prompt_block_hashes(
                token_ids, self.block_size, algo, none_hash, cache_salt, lora_name
            )
            runs = held_runs(members, (hash(to_pool_key(b, 0)) for b in blocks))
            for origin, run in runs.items():
                if run > have_blocks and (best is None or run > best.blocks):
                    best = HeldPrefix(origin, run)
        return best

    def confirmed(self, origin: str) -> None:
        """The source held and pushed what the index said."""
        with self._lock:
            if origin in self._sources:
                self._sources[origin].misses = 0

    def missed(self, origin: str, why: str) -> None:
        """The source did not hold or push what the index said; DEMOTE_AFTER in a row
        demote it for DEMOTE_S."""
        with self._lock:
            s = self._sources.get(origin)
            if s is None:
                return
            s.misses += 1
            demote = s.misses >= DEMOTE_AFTER
            if demote:
                s.misses, s.demoted_until = 0, self._clock() + DEMOTE_S
                self.stats.add(demoted=1)
        if demote:
            logger.warning(
                "Prefix push index: %s is not chosen for %.0f s: %d pushes in a row "
                "found less than its feed advertised (last: %s)",
                origin,
                DEMOTE_S,
                DEMOTE_AFTER,
                why,
            )

    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        with self._lock:
            return {
                **self.stats,
                "sources": {
                    o: {
                        "blocks": len(s.keys),
                        "epoch": s.epoch,
                        "seq": s.seq,
                        "itself": s.itself,
                        "demoted_for_s": max(0.0, round(s.demoted_until - now, 1)),
                        "refused": s.refused,
                    }
                    for o, s in self._sources.items()
                },
            }


class FeedFollower:
    """One thread per source following its feed into ``index``; each call signed
    and bounded, paced by :func:`feed_pause`, a failing source asked with backoff."""

    def __init__(self, index: HolderIndex, config: ExtConfig):
        self.index = index
        self.config = config
        self._stop = threading.Event()
        self._lanes = SourceLanes("mooncake-push-feed", 1, FEED_MAX_ANSWER_BYTES)
        for origin in index.origins:
            self._lanes.submit(origin, self._follow, origin)

    def _follow(self, origin: str) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            epoch, since = self.index.position(origin)
            body = FeedRequest(
                epoch=epoch, since=since, wait_ms=FEED_WAIT_MS
            ).model_dump_json()
            content = body.encode()
            started = time.monotonic()
            deadline = started + FEED_WAIT_MS / 1000 + FEED_CALL_SLACK_S
            try:
                r = self._lanes.post(
                    origin,
                    FEED_PATH,
                    content,
                    request_headers(self.config, "POST", FEED_PATH, content),
                    deadline,
                )
                if r.status == 503:
                    raise SourceNotReady(r.text())
                if r.status != 200:
                    raise RuntimeError(f"it answered {r.status}: {r.text()}")
                received = time.monotonic()
                try:
                    page = FeedPage.model_validate_json(r.body)
                except ValueError as e:
                    self.index.malformed()
                    raise FeedRejected(f"a malformed page ({str(e)[:200]})") from None
                self.index.apply(origin, page)
            except SourceNotReady:  # just started: asked again shortly, quietly
                self.index.not_ready(origin)
                if self._stop.wait(NOT_READY_RETRY_S):
                    return
                continue
            except SourceRefused:  # warned once; asked again rarely (it may restart)
                if self._stop.wait(REFUSED_RETRY_S):
                    return
                continue
            except Exception as e:
                if self._stop.is_set():
                    return
                self.index.failed(origin, f"{type(e).__name__}: {e}")
                backoff = min(max(1.0, 2 * backoff), FEED_BACKOFF_MAX_S)
                if self._stop.wait(backoff):
                    return
                continue
            backoff = 0.0
            if self.index.is_itself(origin):
                logger.info(
                    "Prefix push index: %s is this instance; not following it", origin
                )
                return
            # NOTE: after every page, ``more`` or not: a source answering at once
            # (hostile, or buggy) must not keep this thread (and the GIL) busy
            pause = feed_pause(started, received, time.monotonic())
            if pause > 0 and self._stop.wait(pause):
                return

    def shutdown(self) -> None:
        self._stop.set()
        self._lanes.shutdown()
