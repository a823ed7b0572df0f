"""The source side of the prefix-cache feed: hashsync/worker_table.py's change log
and pages (feed_page), WorkerHashSync.feed and the route POST /hashsync/feed
(routes.py). A page is also applied to D's holder index (push/decode_index.py) to
check that what the source says is what D looks a prompt up by."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from helpers import commit_pending

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    EndpointGuard,
    request_headers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync import (
    worker_table,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.feed_protocol import (
    FEED_PATH,
    FeedPage,
    FeedRequest,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    hash_prompt_blocks,
    to_pool_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashDelta,
    HashEventKind,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.worker_sync import (
    WorkerHashSync,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.worker_table import (
    BlockHashTable,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_index import (
    HeldPrefix,
    HolderIndex,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.routes import (
    Served,
    add_routes,
)

S, R, C = HashEventKind.STORED, HashEventKind.REMOVED, HashEventKind.CLEARED
BS = 4
CFG = HashConfig("sha256", b"\x07" * 32, scheduler_id="source-sched")
ORIGIN = "http://c:1"
OPEN = ExtConfig(bootstrap_host="127.0.0.1")  # no token, loopback: open endpoints


def k(i: int) -> bytes:
    return to_pool_key(bytes([i]) * 32, 0)


def plus(i: int) -> str:
    return "+" + k(i).hex()


def minus(i: int) -> str:
    return "-" + k(i).hex()


def delta(*events, cfg=None) -> HashDelta:
    return HashDelta(events=list(events), hash_config=cfg)


def table(defer: bool = False, **kw) -> BlockHashTable:
    """A table that has seen its hash configuration (a step has run)."""
    t = BlockHashTable(defer_stores=defer, **kw)
    t.apply(delta(cfg=CFG))
    return t


def page_after(t: BlockHashTable, start: FeedPage) -> FeedPage:
    p = t.feed_page(start.epoch, start.seq, BS)
    assert p is not None
    return p


class Event:
    """A device event as seal_pending takes it: complete once ``done``."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


# ---- the log ----------------------------------------------------------------


def test_a_deferred_store_enters_the_feed_only_once_its_step_is_committed():
    t = table(defer=True)
    start = t.feed_page(None, 0, BS)
    assert start.reset and start.events == [] and start.seq == 0
    t.apply(delta((S, k(1), 10)))
    assert page_after(t, start).events == [] and t.feed_position() == 0
    ev = Event()
    t.seal_pending(ev)
    assert t.commit_ready() == 0  # the step's kernels have not completed
    assert page_after(t, start).events == []
    ev.done = True
    assert t.commit_ready() == 1
    p = page_after(t, start)
    assert (p.reset, p.events, p.seq, p.more) == (False, [plus(1)], 1, False)

    # a second block under the same key: the key was already held, no event
    t.apply(delta((S, k(1), 11)))
    commit_pending(t)
    assert t.lookup(k(1)) == [10, 11]
    assert page_after(t, p).events == [] and t.feed_position() == 1
    # a store removed before its step was committed never enters the feed
    t.apply(delta((S, k(2), 12), (R, k(2), 12)))
    commit_pending(t)
    assert page_after(t, p).events == []
    # one of two holders removed: still held, no event; the last one: "-"
    t.apply(delta((R, k(1), 10)))
    assert page_after(t, p).events == []
    t.apply(delta((R, k(1), 11)))
    q = page_after(t, p)
    assert (q.reset, q.events, q.seq) == (False, [minus(1)], 2)


def test_a_block_restored_under_another_key_feeds_the_old_keys_removal():
    t = table()
    start = t.feed_page(None, 0, BS)
    t.apply(delta((S, k(1), 10), (S, k(2), 10)))  # block 10 reused, no removal
    assert page_after(t, start).events == [plus(1), minus(1), plus(2)]


def test_a_peer_continues_with_exactly_the_changes_after_its_position():
    t = table()
    t.apply(delta((S, k(1), 10), (S, k(2), 11), (S, k(3), 12)))
    first = t.feed_page(None, 0, BS)
    assert first.reset and first.seq == 3
    t.apply(delta((S, k(4), 13), (R, k(2), 11), (S, k(5), 14)))
    p = t.feed_page(first.epoch, 3, BS)
    assert p.model_dump() == {
        "epoch": t.feed_epoch,
        "seq": 6,
        "reset": False,
        "events": [plus(4), minus(2), plus(5)],
        "more": False,
        "hash_algo": "sha256",
        "none_hash": CFG.none_hash.hex(),
        "scheduler_id": "source-sched",
        "block_size": BS,
    }
    mid = t.feed_page(first.epoch, 4, BS)
    assert (mid.reset, mid.events, mid.seq) == (False, [minus(2), plus(5)], 6)
    # nothing new: an empty page, not a reset, at the same position
    same = t.feed_page(first.epoch, 6, BS)
    assert (same.reset, same.events, same.seq, same.more) == (False, [], 6, False)


# what a reset page must list: the keys held, the most recently cached first
HELD_NOW = [plus(i) for i in (5, 4, 3, 1)]


def _wrong_epoch(t):
    return "0123456789abcdef", t.feed_position()


def _no_epoch(t):
    return None, t.feed_position()


def _since_beyond(t):
    return t.feed_epoch, t.feed_position() + 1


@pytest.mark.parametrize(
    "position", [_wrong_epoch, _no_epoch, _since_beyond], ids=lambda f: f.__name__
)
def test_a_position_the_source_cannot_continue_from_gets_a_reset_page(position):
    t = table()
    t.apply(delta((S, k(1), 10), (S, k(2), 11), (S, k(3), 12)))
    t.apply(delta((R, k(2), 11), (S, k(4), 13), (S, k(5), 14)))
    epoch, since = position(t)
    p = t.feed_page(epoch, since, BS)
    assert p.reset and not p.more
    assert p.events == HELD_NOW
    assert (p.epoch, p.seq) == (t.feed_epoch, 6)
    # and from the reset page's position the peer continues
    t.apply(delta((S, k(6), 15)))
    q = page_after(t, p)
    assert (q.reset, q.events, q.seq) == (False, [plus(6)], 7)


def test_a_position_older_than_the_kept_log_gets_a_reset_page():
    t = table(feed_log_max=4)
    start = t.feed_page(None, 0, BS)
    assert start.seq == 0
    t.apply(delta(*[(S, k(i), 100 + i) for i in range(1, 7)]))  # 6 changes
    t.apply(delta((R, k(2), 102)))  # and a 7th
    old = t.feed_page(start.epoch, start.seq, BS)
    assert old.reset and old.seq == 7
    assert old.events == [plus(i) for i in (6, 5, 4, 3, 1)]
    one_back = t.feed_page(start.epoch, 6, BS)  # still kept: continued
    assert (one_back.reset, one_back.events, one_back.seq) == (False, [minus(2)], 7)


def test_a_reset_of_the_prefix_cache_sends_peers_a_snapshot():
    t = table()
    t.apply(delta((S, k(1), 10), (S, k(2), 11)))
    before = t.feed_page(None, 0, BS)
    assert before.events == [plus(2), plus(1)]
    t.apply(delta((C, b"", -1), (S, k(3), 12)))
    p = page_after(t, before)
    assert p.reset and p.events == [plus(3)] and p.epoch == before.epoch
    assert p.seq > before.seq
    t.apply(delta((S, k(4), 13)))
    q = page_after(t, p)
    assert (q.reset, q.events) == (False, [plus(4)])


def test_more_changes_than_a_page_holds_come_on_the_next_pages(monkeypatch):
    monkeypatch.setattr(worker_table, "FEED_PAGE_MAX_EVENTS", 3)
    t = table()
    start = t.feed_page(None, 0, BS)
    t.apply(delta(*[(S, k(i), 100 + i) for i in range(1, 8)]))  # 7 changes
    pages = [page_after(t, start)]
    while pages[-1].more:
        pages.append(page_after(t, pages[-1]))
    assert [(p.seq, p.more, p.reset) for p in pages] == [
        (3, True, False),
        (6, True, False),
        (7, False, False),
    ]
    assert [e for p in pages for e in p.events] == [plus(i) for i in range(1, 8)]


def test_a_reset_page_lists_at_most_the_snapshot_cap_newest_first(monkeypatch):
    monkeypatch.setattr(worker_table, "FEED_SNAPSHOT_MAX_KEYS", 2)
    t = table()
    t.apply(delta(*[(S, k(i), 100 + i) for i in range(1, 6)]))
    p = t.feed_page(None, 0, BS)
    assert (p.reset, p.events, p.seq, p.more) == (True, [plus(5), plus(4)], 5, False)


def test_no_page_before_the_hash_configuration_is_known():
    t = BlockHashTable(defer_stores=False)
    t.apply(delta((S, k(1), 10)))
    assert t.feed_page(None, 0, BS) is None
    sync = WorkerHashSync(BS)
    assert sync.feed(FeedRequest()) is None
    sync.on_metadata(delta(cfg=CFG))
    assert sync.feed(FeedRequest()).reset


# ---- the source's page in D's index -----------------------------------------------

PROMPT = list(range(300, 300 + 4 * BS + 2))  # 4 full blocks and 2 tokens


def prompt_keys(tokens=PROMPT, cache_salt=None) -> list[bytes]:
    hashes = hash_prompt_blocks(
        tokens, BS, CFG.hash_algo, CFG.none_hash, cache_salt=cache_salt
    )
    return [to_pool_key(h) for h in hashes]


def on_the_wire(page: FeedPage) -> FeedPage:
    return FeedPage.model_validate_json(page.model_dump_json())


def test_a_page_tells_d_which_leading_blocks_of_a_prompt_the_source_holds():
    keys = prompt_keys()
    t = table(defer=True)
    t.apply(delta(*[(S, key, 20 + i) for i, key in enumerate(keys[:3])]))
    commit_pending(t)
    idx = HolderIndex([ORIGIN], BS)
    first = on_the_wire(t.feed_page(None, 0, BS))
    assert idx.apply(ORIGIN, first) is False
    assert idx.best(PROMPT, None, None, have_blocks=0) == HeldPrefix(ORIGIN, 3)
    assert idx.best(PROMPT, None, None, have_blocks=3) is None  # nothing beyond D's
    assert idx.best(PROMPT, "another-salt", None, have_blocks=0) is None
    assert idx.best(PROMPT[:BS] + [1] + PROMPT[BS + 1 :], None, None, 0) == HeldPrefix(
        ORIGIN, 1
    )

    t.apply(delta((R, keys[1], 21)))  # the second block evicted
    second = on_the_wire(page_after(t, first))
    assert second.events == ["-" + keys[1].hex()] and not second.reset
    idx.apply(ORIGIN, second)
    assert idx.best(PROMPT, None, None, have_blocks=0) == HeldPrefix(ORIGIN, 1)
    t.apply(delta((R, keys[0], 20)))
    idx.apply(ORIGIN, on_the_wire(page_after(t, second)))
    assert idx.best(PROMPT, None, None, have_blocks=0) is None
    assert idx.snapshot()["sources"][ORIGIN]["blocks"] == 1  # the third block


def test_a_prompt_with_a_cache_salt_matches_only_its_salted_blocks():
    salted = prompt_keys(cache_salt="tenant-a")
    t = table()
    t.apply(delta(*[(S, key, 40 + i) for i, key in enumerate(salted)]))
    idx = HolderIndex([ORIGIN], BS)
    idx.apply(ORIGIN, on_the_wire(t.feed_page(None, 0, BS)))
    assert idx.best(PROMPT, "tenant-a", None, 0) == HeldPrefix(ORIGIN, 4)
    assert idx.best(PROMPT, None, None, 0) is None
    assert idx.best(PROMPT, "tenant-b", None, 0) is None


# ---- the route ------------------------------------------------------------------


def feed_client(hashsync, here: bool = True) -> TestClient:
    app = FastAPI()
    add_routes(
        app,
        EndpointGuard(OPEN),
        OPEN,
        Served(
            hashsync=lambda: hashsync,
            push=lambda: None,
            layerwise=lambda: None,
            hashsync_here=here,
        ),
    )
    return TestClient(app)


def post_feed(client: TestClient, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(
        FEED_PATH, content=raw, headers=request_headers(OPEN, "POST", FEED_PATH, raw)
    )


def mirror_holding(*ids: int) -> WorkerHashSync:
    sync = WorkerHashSync(BS)
    sync.on_metadata(delta(*[(S, k(i), 10 + i) for i in ids], cfg=CFG))
    sync.after_step()
    return sync


def store(sync: WorkerHashSync, i: int) -> None:
    """A step of the source's engine: the delta before the forward, then its end."""
    sync.on_metadata(delta((S, k(i), 10 + i)))
    sync.after_step()


def test_the_route_answers_a_snapshot_then_waits_for_the_next_change():
    sync = mirror_holding(1, 2)
    client = feed_client(sync)
    r = post_feed(client, {"wait_ms": 0})
    assert r.status_code == 200, r.text
    first = FeedPage.model_validate_json(r.content)
    assert first.reset and first.events == [plus(2), plus(1)]
    assert (first.epoch, first.seq, first.block_size) == (sync.table.feed_epoch, 2, BS)

    timer = threading.Timer(0.3, store, (sync, 3))
    began = time.monotonic()
    timer.start()
    try:
        r = post_feed(
            client, {"epoch": first.epoch, "since": first.seq, "wait_ms": 2000}
        )
    finally:
        timer.join()
    took = time.monotonic() - began
    assert r.status_code == 200, r.text
    page = FeedPage.model_validate_json(r.content)
    assert (page.reset, page.events, page.seq) == (False, [plus(3)], 3)
    assert 0.25 <= took < 1.2, f"answered after {took:.2f} s"


def test_the_table_wakes_its_watchers_only_when_the_feed_moves():
    t = table(defer=True)
    woken: list[None] = []
    t.watch(lambda: woken.append(None))  # under the table's lock: only note it
    t.apply(delta((S, k(1), 10)))  # stored, not yet published
    t.seal_pending()  # a step with nothing to wait for: no need to look again
    assert len(woken) == 0 and not t.awaits_device()
    assert t.commit_ready() == 1
    assert len(woken) == 1 and t.feed_position() == 1
    t.apply(delta((S, k(1), 11)))  # a second holder of a published key: no event
    t.seal_pending()
    t.commit_ready()
    assert len(woken) == 1
    ev = Event()
    t.apply(delta((S, k(2), 12)))
    t.seal_pending(ev)  # published only once ev completes, which no one signals
    assert len(woken) == 2 and t.awaits_device()
    assert t.commit_ready() == 0 and len(woken) == 2
    ev.done = True
    assert t.commit_ready() == 1 and len(woken) == 3
    assert not t.awaits_device() and t.feed_position() == 2
    t.clear(1)  # a reset: peers need a snapshot
    assert len(woken) == 4
    t.apply(delta((R, k(9), 99)))  # a stale removal changes nothing
    assert len(woken) == 4


def test_a_waiting_feed_request_looks_again_only_when_the_table_moves(monkeypatch):
    sync = mirror_holding(1)
    looks: list[float] = []
    feed = sync.feed

    def counted(req):
        looks.append(time.monotonic())
        return feed(req)

    monkeypatch.setattr(sync, "feed", counted)
    client = feed_client(sync)
    began = time.monotonic()
    r = post_feed(client, {"epoch": sync.table.feed_epoch, "since": 1, "wait_ms": 600})
    took = time.monotonic() - began
    page = FeedPage.model_validate_json(r.content)
    assert (page.events, page.seq) == ([], 1)
    assert 0.59 <= took < 2.0, f"answered after {took:.2f} s"
    # an idle source is asked once when the request comes and once at its end
    assert len(looks) <= 2, f"looked {len(looks)} times in {took:.2f} s"


def page_when(sync: WorkerHashSync, since: int, act) -> tuple[FeedPage, float]:
    """The page a feed request waiting from ``since`` gets when ``act`` runs 0.3 s
    into its wait (of 3 s), and how long it took."""
    client = feed_client(sync)
    timer = threading.Timer(0.3, act)
    began = time.monotonic()
    timer.start()
    try:
        r = post_feed(
            client, {"epoch": sync.table.feed_epoch, "since": since, "wait_ms": 3000}
        )
    finally:
        timer.join()
    assert r.status_code == 200, r.text
    return FeedPage.model_validate_json(r.content), time.monotonic() - began


def test_a_waiting_request_looks_while_a_step_waits_for_its_device_event():
    sync = mirror_holding(1)
    ev = Event()
    sync.on_metadata(delta((S, k(2), 12)))
    sync.after_step(ev)  # the forward launched; its event not yet complete

    def complete() -> None:  # the device finishes: no call into the table
        ev.done = True

    page, took = page_when(sync, 1, complete)
    assert (page.reset, page.events, page.seq) == (False, [plus(2)], 2)
    assert 0.25 <= took < 1.5, f"answered after {took:.2f} s"


def test_a_reset_wakes_a_waiting_request_with_a_snapshot():
    sync = mirror_holding(1, 2)
    page, took = page_when(sync, 2, lambda: sync.table.clear(1))
    assert (page.reset, page.events) == (True, [])
    assert 0.25 <= took < 1.5, f"answered after {took:.2f} s"


def test_the_route_answers_an_empty_page_when_nothing_changed_in_the_wait():
    sync = mirror_holding(1)
    client = feed_client(sync)
    began = time.monotonic()
    r = post_feed(client, {"epoch": sync.table.feed_epoch, "since": 1, "wait_ms": 200})
    took = time.monotonic() - began
    page = FeedPage.model_validate_json(r.content)
    assert (page.reset, page.events, page.seq, page.more) == (False, [], 1, False)
    assert 0.19 <= took < 1.5, f"answered after {took:.2f} s"


@pytest.mark.parametrize(
    "body",
    [
        {"since": "5"},
        {"since": -1},
        {"epoch": 5},
        {"wait_ms": 10_001},
        {"wait_ms": 0, "unknown": 1},
        b"not json",
        b"[]",
    ],
)
def test_a_malformed_feed_request_answers_422(body):
    r = post_feed(feed_client(mirror_holding(1)), body)
    assert r.status_code == 422, (body, r.status_code, r.text)


def test_an_instance_without_a_mirror_answers_404_and_one_not_ready_503():
    assert post_feed(feed_client(None, here=False), {}).status_code == 404
    assert post_feed(feed_client(None, here=True), {}).status_code == 503
    # built, but no engine step has run (no hash configuration yet)
    assert post_feed(feed_client(WorkerHashSync(BS)), {}).status_code == 503
