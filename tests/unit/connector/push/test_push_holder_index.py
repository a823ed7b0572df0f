"""D's side of ``push_from: "auto"``: the holder index and its feed followers
(push/decode_index.py) and the scheduler's choice of a source from it
(push/decode_scheduler.py). The sources are pages built here, a feed server of
this module's own on 127.0.0.1, or the real routes serving a WorkerHashSync;
the chosen source's /match_blocks is stubbed."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import C_SOURCE, Blocks, Clock, d_request, serve_routes, wait_until

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.peer_client import (
    Answer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.feed_protocol import (
    FEED_PATH,
    FeedPage,
    FeedRequest,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    SCHEDULER_ID,
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
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push import (
    decode_index,
    decode_scheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_cost import (
    PROBE_AFTER_S,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_index import (
    DEMOTE_AFTER,
    DEMOTE_S,
    FORGET_AFTER_S,
    FeedFollower,
    FeedRejected,
    HeldPrefix,
    HolderIndex,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
    PushOutcome,
)

BS = 16
SRC = "http://c:9000"
OTHER = "http://c2:9000"
CFG = HashConfig("sha256", b"\x05" * 32, scheduler_id="source-sched")
CFG_B = HashConfig("sha256", b"\x06" * 32, scheduler_id="other-sched")
PROMPT = list(range(1000, 1000 + 5 * BS + 3))  # 5 full blocks and 3 tokens
FP = KVFingerprint(
    model="Arch:0123456789abcdef", dtype="bfloat16/auto", block_size=BS, tp_size=1
)
C_FP = FP.model_copy(update={"block_len": 64, "num_kv_tensors": 2})
AUTO_CONFIG = ExtConfig(push_min_tokens=0, push_match_timeout_s=1, push_sources=(SRC,))


def keys(tokens=PROMPT, cfg=CFG, cache_salt=None) -> list[bytes]:
    hashes = hash_prompt_blocks(
        tokens, BS, cfg.hash_algo, cfg.none_hash, cache_salt=cache_salt
    )
    return [to_pool_key(h) for h in hashes]


def page(
    stored=(),
    removed=(),
    *,
    epoch="e1",
    seq=1,
    reset=True,
    more=False,
    cfg=CFG,
    block_size=BS,
) -> FeedPage:
    return FeedPage(
        epoch=epoch,
        seq=seq,
        reset=reset,
        events=["+" + key.hex() for key in stored]
        + ["-" + key.hex() for key in removed],
        more=more,
        hash_algo=cfg.hash_algo,
        none_hash=cfg.none_hash.hex(),
        scheduler_id=cfg.scheduler_id,
        block_size=block_size,
    )


def blocks_of(idx: HolderIndex, origin: str) -> int:
    return idx.snapshot()["sources"][origin]["blocks"]


# ---- HolderIndex: pages ---------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"events": ["*" + "ab" * 36]},  # neither "+" nor "-"
        {"events": ["+" + "zz" * 36]},  # not hex
        {"events": ["+" + "ab" * 36 + "a"]},  # odd length
        {"none_hash": "not hex"},
    ],
)
def test_a_malformed_page_is_counted_and_nothing_of_it_applied(bad):
    idx = HolderIndex([SRC], BS)
    good = page(keys()[:2]).model_dump()
    fields = {**good, **bad}
    if "events" in bad:  # a valid event before the bad one: not applied either
        fields["events"] = good["events"][:1] + bad["events"]
    with pytest.raises(FeedRejected):
        idx.apply(SRC, FeedPage.model_construct(**fields))
    snap = idx.snapshot()
    assert snap["pages_malformed"] == 1 and snap["pages"] == 0
    assert snap["keys_stored"] == 0 and blocks_of(idx, SRC) == 0
    assert idx.position(SRC) == (None, 0)
    assert idx.best(PROMPT, None, None, 0) is None


@pytest.mark.parametrize(
    "mismatch,named",
    [
        ({"block_size": 2 * BS}, f"its block size is {2 * BS}, this instance's {BS}"),
        ({"hash_algo": "md5-of-nothing"}, "it hashes blocks with 'md5-of-nothing'"),
    ],
    ids=["block-size", "hash-algorithm"],
)
def test_a_source_whose_blocks_cannot_match_is_refused_with_one_warning_naming_why(
    mismatch, named
):
    """Refused at its first page (nothing of it indexed), one warning however many
    pages follow, not counted as malformed; indexed once it sends pages that fit.
    Another NONE_HASH (seed) is no mismatch: D hashes with the source's own
    (test_sources_with_different_none_hashes_match_only_their_own_hashes)."""
    idx = HolderIndex([SRC], BS)
    rec = Recorded()
    decode_index.logger.addHandler(rec)
    try:
        for _ in range(3):
            bad = page(keys()).model_dump() | mismatch
            with pytest.raises(FeedRejected, match=named.split(",")[0]):
                idx.apply(SRC, FeedPage.model_construct(**bad))
        assert blocks_of(idx, SRC) == 0 and idx.position(SRC) == (None, 0)
        assert idx.best(PROMPT, None, None, 0) is None
        snap = idx.snapshot()
        assert named in snap["sources"][SRC]["refused"]
        assert (snap["pages_refused"], snap["pages_malformed"]) == (3, 0)
        idx.apply(SRC, page(keys()[:2]))  # it restarted with a matching setting
    finally:
        decode_index.logger.removeHandler(rec)
    warned = [r.getMessage() for r in rec.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and named in warned[0] and SRC in warned[0], warned
    assert idx.snapshot()["sources"][SRC]["refused"] is None
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 2)


def test_each_source_keeps_at_most_its_share_of_the_blocks():
    many = [to_pool_key(bytes([i]) * 32) for i in range(10)]
    idx = HolderIndex([SRC, OTHER], BS, max_blocks=8)  # 4 each
    idx.apply(SRC, page(many[:6]))
    assert blocks_of(idx, SRC) == 4
    assert idx.stats["keys_stored"] == 4 and idx.stats["keys_dropped_full"] == 2
    idx.apply(OTHER, page(many[6:10]))  # the other source's share is its own
    assert blocks_of(idx, OTHER) == 4 and idx.stats["keys_dropped_full"] == 2
    # a removal makes room again
    idx.apply(SRC, page(removed=[many[0]], seq=2, reset=False))
    assert blocks_of(idx, SRC) == 3
    idx.apply(SRC, page([many[5]], seq=3, reset=False))
    assert blocks_of(idx, SRC) == 4 and idx.stats["keys_dropped_full"] == 2
    idx.apply(SRC, page([many[4]], seq=4, reset=False))
    assert blocks_of(idx, SRC) == 4 and idx.stats["keys_dropped_full"] == 3


def test_a_source_that_is_this_instance_is_never_picked():
    mine = HashConfig(CFG.hash_algo, CFG.none_hash, scheduler_id="me")
    idx = HolderIndex([SRC, OTHER], BS, own_scheduler_id="me")
    assert idx.apply(SRC, page(keys(), cfg=mine, more=True)) is False
    idx.apply(OTHER, page(keys()[:2]))
    assert idx.is_itself(SRC) and not idx.is_itself(OTHER)
    assert blocks_of(idx, SRC) == 0
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(OTHER, 2)
    # and stays so whatever it sends later
    idx.apply(SRC, page(keys(), seq=2, reset=False))
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(OTHER, 2)


def test_a_new_epoch_or_a_reset_page_forgets_the_old_keys():
    k = keys()
    idx = HolderIndex([SRC], BS)
    idx.apply(SRC, page(k[:3], epoch="e1", seq=3))
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 3)
    # another process of the source (a restart): even a page of changes starts over
    idx.apply(SRC, page([k[3]], epoch="e2", seq=1, reset=False))
    assert blocks_of(idx, SRC) == 1 and idx.position(SRC) == ("e2", 1)
    assert idx.best(PROMPT, None, None, 0) is None
    idx.apply(SRC, page(k[:2], epoch="e2", seq=3, reset=False))
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 2)
    # a reset page of the same process: only what it lists
    idx.apply(SRC, page([k[0]], epoch="e2", seq=9, reset=True))
    assert blocks_of(idx, SRC) == 1 and idx.position(SRC) == ("e2", 9)
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 1)
    # a changed hash configuration: the old keys mean nothing any more
    idx.apply(SRC, page([], epoch="e2", seq=10, reset=False, cfg=CFG_B))
    assert blocks_of(idx, SRC) == 0


def test_a_source_is_forgotten_only_once_it_has_not_answered_for_a_while():
    clock = Clock()
    idx = HolderIndex([SRC], BS, clock=clock)
    idx.failed(SRC, "never answered")  # nothing to forget
    assert idx.stats["forgotten"] == 0
    idx.apply(SRC, page(keys()[:3], seq=3))
    clock.now += 10
    idx.failed(SRC, "refused")
    clock.now += FORGET_AFTER_S - 10 - 0.5
    idx.failed(SRC, "refused")
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 3)
    assert idx.stats["forgotten"] == 0
    clock.now += 0.5
    idx.failed(SRC, "refused")
    assert idx.best(PROMPT, None, None, 0) is None
    assert idx.position(SRC) == (None, 0)
    assert idx.stats["forgotten"] == 1 and idx.stats["feed_failures"] == 4
    # it answers again: its silence counts from then
    idx.apply(SRC, page(keys()[:2], epoch="e2", seq=2))
    clock.now += FORGET_AFTER_S - 1
    idx.failed(SRC, "refused")
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 2)


def test_a_source_that_misses_repeatedly_is_demoted_for_a_while():
    clock = Clock()
    idx = HolderIndex([SRC, OTHER], BS, clock=clock)
    idx.apply(SRC, page(keys()[:4]))
    idx.apply(OTHER, page(keys()[:2]))
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 4)
    for _ in range(DEMOTE_AFTER - 1):
        idx.missed(SRC, "found less")
    idx.confirmed(SRC)  # a push that landed: the count starts over
    for _ in range(DEMOTE_AFTER - 1):
        idx.missed(SRC, "found less")
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 4)
    assert idx.stats["demoted"] == 0
    idx.missed(SRC, "found less")  # DEMOTE_AFTER in a row
    assert idx.stats["demoted"] == 1
    assert idx.snapshot()["sources"][SRC]["demoted_for_s"] == DEMOTE_S
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(OTHER, 2)
    clock.now += DEMOTE_S - 1
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(OTHER, 2)
    clock.now += 1
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 4)
    idx.missed("http://unknown:1", "ignored")  # not a source: nothing to count


def test_best_is_the_longest_leading_run_beyond_this_instances_own_hit():
    k = keys()
    idx = HolderIndex([SRC, OTHER], BS)
    idx.apply(SRC, page([k[0], k[1], k[3], k[4]]))  # a hole at the third block
    idx.apply(OTHER, page(k[:3]))
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(OTHER, 3)
    assert idx.best(PROMPT, None, None, 2) == HeldPrefix(OTHER, 3)
    assert idx.best(PROMPT, None, None, 3) is None  # no source holds more than D
    assert idx.best(PROMPT[: 3 * BS], None, None, 3) is None
    assert idx.best(PROMPT[: 2 * BS + 1], None, None, 0) == HeldPrefix(SRC, 2)
    assert idx.best(list(range(7, 7 + 5 * BS)), None, None, 0) is None


def test_sources_with_different_none_hashes_match_only_their_own_hashes():
    idx = HolderIndex([SRC, OTHER], BS)
    idx.apply(SRC, page(keys(cfg=CFG)[:3], cfg=CFG))
    # OTHER lists the prompt's hashes under SRC's NONE_HASH: not its own blocks
    idx.apply(OTHER, page(keys(cfg=CFG), cfg=CFG_B))
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 3)
    idx.apply(OTHER, page(keys(cfg=CFG_B)[:4], cfg=CFG_B, epoch="e9"))
    assert idx.best(PROMPT, None, None, 0) == HeldPrefix(OTHER, 4)


# ---- FeedFollower over HTTP ---------------------------------------------------------


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a follower that went away mid-answer: nothing to report


class FeedServer:
    """A source's POST /hashsync/feed on 127.0.0.1: ``answer(body)`` gives
    (status, body) for each call; every call's body is kept."""

    def __init__(self, answer):
        self.bodies: list[bytes] = []
        self.arrived = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                assert self.path == FEED_PATH
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.bodies.append(body)
                outer.arrived.set()
                status, data = answer(body)
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.05,), daemon=True
        )
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def table_of(cfg=CFG, held=3) -> BlockHashTable:
    t = BlockHashTable()
    t.apply(
        HashDelta(
            events=[
                (HashEventKind.STORED, key, 30 + i)
                for i, key in enumerate(keys()[:held])
            ],
            hash_config=cfg,
        )
    )
    return t


def answering_from(t: BlockHashTable, first=None):
    """Answers ``first`` (status, body) to the first call, then ``t``'s pages."""
    calls = []

    def answer(body):
        calls.append(body)
        if first is not None and len(calls) == 1:
            return first
        req = FeedRequest.model_validate_json(body)
        p = t.feed_page(req.epoch, req.since, BS)
        if not (p.reset or p.events):
            time.sleep(0.05)  # a short wait, as the route does
        return 200, p.model_dump_json().encode()

    return answer


@contextlib.contextmanager
def following(url: str):
    idx = HolderIndex([url], BS)
    follower = FeedFollower(idx, ExtConfig())
    try:
        yield idx, follower
    finally:
        follower.shutdown()


def store(sync: WorkerHashSync, *events) -> None:
    sync.on_metadata(HashDelta(events=list(events)))
    sync.after_step()


def test_the_follower_applies_a_real_sources_feed_as_it_changes(monkeypatch):
    monkeypatch.setattr(decode_index, "FEED_WAIT_MS", 300)
    k = keys()
    sync = WorkerHashSync(BS)
    sync.on_metadata(
        HashDelta(
            events=[(HashEventKind.STORED, key, 30 + i) for i, key in enumerate(k[:3])],
            hash_config=CFG,
        )
    )
    sync.after_step()
    url, stop = serve_routes(ExtConfig(bootstrap_host="127.0.0.1"), hashsync=sync)
    try:
        with following(url) as (idx, _):
            assert wait_until(lambda: blocks_of(idx, url) == 3)
            assert idx.best(PROMPT, None, None, 0) == HeldPrefix(url, 3)
            store(sync, (HashEventKind.STORED, k[3], 33))
            assert wait_until(
                lambda: idx.best(PROMPT, None, None, 0) == HeldPrefix(url, 4)
            )
            store(sync, (HashEventKind.REMOVED, k[1], 31))
            assert wait_until(
                lambda: idx.best(PROMPT, None, None, 0) == HeldPrefix(url, 1)
            )
            epoch = sync.table.feed_epoch
            assert wait_until(lambda: idx.position(url) == (epoch, 5))
            assert idx.stats["pages_malformed"] == idx.stats["feed_failures"] == 0
    finally:
        stop()


@pytest.mark.parametrize(
    "first,malformed",
    [
        ((200, b"{not json"), 1),
        ((200, b'{"epoch": "e", "seq": 1}'), 1),  # fields missing
        ((500, b'{"detail": "boom"}'), 0),
    ],
    ids=["garbage", "incomplete", "500"],
)
def test_a_bad_answer_is_counted_and_the_follower_keeps_following(first, malformed):
    server = FeedServer(answering_from(table_of(), first))
    try:
        with following(server.url) as (idx, _):
            # after one backoff (1 s) it asks again and gets a page it can use
            assert wait_until(lambda: blocks_of(idx, server.url) == 3, timeout=5)
            assert idx.stats["pages_malformed"] == malformed
            assert idx.stats["feed_failures"] == 1
            assert json.loads(server.bodies[1]) == {
                "epoch": None,
                "since": 0,
                "wait_ms": decode_index.FEED_WAIT_MS,
            }
    finally:
        server.close()


def test_a_source_that_has_not_run_a_step_holds_nothing_and_is_asked_again_quietly():
    """503: the source has just started. Its old blocks are gone with its old
    process; it is asked again within NOT_READY_RETRY_S, without a warning or a
    failure counted."""
    server = FeedServer(answering_from(table_of(), (503, b'{"detail": "retry"}')))
    try:
        with following(server.url) as (idx, _):
            idx._sources[server.url].keys = {1, 2, 3, 4, 5}  # what it held before
            # asked again within NOT_READY_RETRY_S, well before a failure's backoff
            assert wait_until(lambda: blocks_of(idx, server.url) == 3, timeout=2.5)
            assert idx.stats["feed_failures"] == 0
    finally:
        server.close()


def test_the_follower_stops_following_this_instance_itself():
    server = FeedServer(
        answering_from(table_of(cfg=HashConfig("sha256", b"\x05" * 32, SCHEDULER_ID)))
    )
    try:
        with following(server.url) as (idx, _):
            assert wait_until(lambda: idx.is_itself(server.url))
            time.sleep(0.3)  # several feed intervals
            assert len(server.bodies) == 1
            assert idx.best(PROMPT, None, None, 0) is None
    finally:
        server.close()


def test_a_refused_source_is_asked_again_only_rarely_and_counts_no_failure():
    """A source whose block size differs answers every call the same: it is not
    asked again within the second a failing source would be (its snapshot each
    time), nor counted as failing."""
    bad = page(keys(), block_size=2 * BS).model_dump_json().encode()
    server = FeedServer(lambda body: (200, bad))
    try:
        with following(server.url) as (idx, _):
            assert server.arrived.wait(5)
            time.sleep(2.5)  # a failure's backoff asks again after 1 s, then 2 s
            assert len(server.bodies) == 1
            assert idx.stats["feed_failures"] == 0
            assert "block size" in idx.snapshot()["sources"][server.url]["refused"]
    finally:
        server.close()


def test_a_source_answering_more_at_once_is_asked_at_most_k_times_in_t_seconds():
    """A source that always says ``more`` (hostile, or buggy) is asked again no
    sooner than FEED_MIN_INTERVAL_S after the call before: it cannot spin the
    follower's thread (and the GIL D's scheduler needs)."""
    spin = page(reset=False, more=True).model_dump_json().encode()
    server = FeedServer(lambda body: (200, spin))
    try:
        with following(server.url) as (idx, _):
            assert server.arrived.wait(5)
            began, seen = time.monotonic(), len(server.bodies)
            time.sleep(1.0)
            asked = len(server.bodies) - seen
            took = time.monotonic() - began
            assert idx.stats["pages"] >= 2  # it is followed all the same
    finally:
        server.close()
    at_most = int(took / decode_index.FEED_MIN_INTERVAL_S) + 2  # +1: scheduling jitter
    assert 2 <= asked <= at_most, f"asked {asked} times in {took:.2f} s"


def test_a_source_whose_pages_cost_time_here_is_asked_again_after_a_longer_pause(
    monkeypatch,
):
    """Each page costing D 0.1 s to apply: the source is asked again only
    FEED_WORK_PAUSE times that later, so it takes at most 1 / (1 + FEED_WORK_PAUSE)
    of the thread's time."""
    spin = page(reset=False, more=True).model_dump_json().encode()
    server = FeedServer(lambda body: (200, spin))
    apply = HolderIndex.apply

    def costly(self, origin, p):
        time.sleep(0.1)
        return apply(self, origin, p)

    monkeypatch.setattr(HolderIndex, "apply", costly)
    try:
        with following(server.url):
            assert server.arrived.wait(5)
            began, seen = time.monotonic(), len(server.bodies)
            time.sleep(1.5)
            asked = len(server.bodies) - seen
            took = time.monotonic() - began
    finally:
        server.close()
    per_call = 0.1 * (1 + decode_index.FEED_WORK_PAUSE)
    assert 1 <= asked <= int(took / per_call) + 2, f"asked {asked} in {took:.2f} s"


def test_shutdown_returns_at_once_while_a_long_poll_is_in_flight():
    release = threading.Event()

    def hang(body):
        release.wait(15)  # a source that holds the poll (longer than its wait)
        return 200, b"{}"

    server = FeedServer(hang)
    try:
        idx = HolderIndex([server.url], BS)
        follower = FeedFollower(idx, ExtConfig())
        threads = [t for lane in follower._lanes._lanes.values() for t in lane._threads]
        assert threads and server.arrived.wait(5)
        time.sleep(0.1)
        began = time.monotonic()
        follower.shutdown()
        took = time.monotonic() - began
        # the poll's own deadline is FEED_WAIT_MS + FEED_CALL_SLACK_S (10 s) away
        assert took < 2.0, f"shutdown took {took:.2f} s"
        assert not any(t.is_alive() for t in threads)
        assert idx.stats["feed_failures"] == 0  # a stop, not a failure
    finally:
        release.set()
        server.close()


# ---- PushScheduler: push_from "auto" -----------------------------------------------------


def auto_request(rid="r1", tokens=PROMPT, params=None, salt=None):
    return d_request(rid, source="auto", tokens=tokens, params=params, salt=salt)


def auto_scheduler(held=4, config=AUTO_CONFIG) -> PushScheduler:
    """A scheduler whose index (no follower) says SRC holds ``held`` blocks of PROMPT."""
    s = PushScheduler(BS, config, FP)
    s.index = HolderIndex([SRC], BS)
    s.index.apply(SRC, page(keys()[:held]))
    return s


class MatchStub:
    """SRC's /match_blocks (s._lanes.post): answers ``blocks`` held blocks."""

    def __init__(self, blocks):
        self.blocks = blocks
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, source, path, content, headers, deadline):
        self.calls.append((source + path, json.loads(content)))
        body = {
            "matched_blocks": self.blocks,
            "matched_tokens": self.blocks * BS,
            "total_full_blocks": len(PROMPT) // BS,
            "fingerprint": C_FP.model_dump(),
            "engine_timeout_s": 30,
            "source_id": C_SOURCE,
            "now_unix_ms": int(time.time() * 1000),
        }
        return Answer(200, json.dumps(body).encode(), {})


def asked(s: PushScheduler, r, local_tokens=0):
    """get_num_new_matched_tokens until the match is in (it is asked on a lane)."""
    first = s.get_num_new_matched_tokens(r, local_tokens)
    if first != (None, False):
        return first
    fut = s._matches[r.request_id]
    assert wait_until(fut.done)
    return s.get_num_new_matched_tokens(r, local_tokens)


def test_auto_asks_the_source_the_index_names_and_pushes_what_it_holds():
    s = auto_scheduler(held=4)
    s._lanes.post = stub = MatchStub(4)
    r = auto_request()
    assert s.handles(r)
    assert asked(s, r) == (4 * BS, True)
    assert stub.calls == [
        (
            SRC + "/match_blocks",
            {"token_ids": PROMPT, "cache_salt": None, "lora_name": None},
        )
    ]
    s.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 4 * BS)
    (job,) = s.take_jobs()
    assert job.source == SRC and job.dst_block_ids == (40, 41, 42, 43)
    assert (s.stats["auto_asked"], s.stats["auto_picked"]) == (1, 1)
    assert s.stats["auto_no_holder"] == s.stats["auto_missed"] == 0
    s.shutdown()


def test_auto_with_nobody_holding_the_prompt_prefills_locally_without_a_call():
    s = auto_scheduler(held=4)
    calls = []
    s._lanes.post = lambda *a: calls.append(a)
    other = auto_request("r2", tokens=range(7, 7 + 5 * BS))
    assert s.get_num_new_matched_tokens(other, 0) == (0, False)
    # the index says SRC holds 4 blocks, this instance's own hit is 4 already
    mine = auto_request("r3")
    assert s.get_num_new_matched_tokens(mine, 4 * BS) == (0, False)
    salted = auto_request("r4", salt="tenant")
    assert s.get_num_new_matched_tokens(salted, 0) == (0, False)
    assert s.get_num_new_matched_tokens(other, 0) == (0, False)  # asked again
    assert calls == [] and s._matches == {} and s._lanes.sources() == []
    assert s.stats["auto_no_holder"] == 3 and s.stats["auto_picked"] == 0
    s.shutdown()


def test_a_source_holding_less_than_advertised_counts_a_miss_and_is_demoted():
    s = auto_scheduler(held=4)
    s._lanes.post = MatchStub(2)
    for i in range(DEMOTE_AFTER):
        r = auto_request(f"m{i}")
        assert asked(s, r) == (2 * BS, True)  # what the source really holds
        assert s.stats["auto_missed"] == i + 1
        assert s.get_num_new_matched_tokens(r, 0) == (2 * BS, True)  # judged once
        assert s.stats["auto_missed"] == i + 1
        s.request_finished(r)
    assert s.index.stats["demoted"] == 1
    # demoted: the next request is prefilled locally, SRC is not asked
    s._lanes.post = stub = MatchStub(4)
    assert s.get_num_new_matched_tokens(auto_request("after"), 0) == (0, False)
    assert stub.calls == [] and s.stats["auto_no_holder"] == 1
    s.shutdown()


def push_auto(s: PushScheduler, rid: str, landed: int) -> None:
    r = auto_request(rid)
    assert asked(s, r) == (4 * BS, True)
    s.update_state_after_alloc(r, Blocks([50, 51, 52, 53, 54]), 4 * BS)
    s.take_jobs()
    r.num_computed_tokens = r.num_external_computed_tokens = 4 * BS
    s.on_worker_meta(PushOutcome({rid: landed}))
    s.request_finished(r)


def test_what_a_push_lands_confirms_or_misses_the_source():
    s = auto_scheduler(held=4)
    s._lanes.post = MatchStub(4)
    seen = []
    missed, confirmed = s.index.missed, s.index.confirmed
    s.index.missed = lambda o, why: (seen.append(("missed", o)), missed(o, why))
    s.index.confirmed = lambda o: (seen.append(("confirmed", o)), confirmed(o))
    push_auto(s, "p1", landed=2)
    assert seen == [("missed", SRC)] and s.stats["auto_missed"] == 1
    assert s.stats["fallback_blocks"] == 2
    push_auto(s, "p2", landed=4)
    assert seen[-1] == ("confirmed", SRC) and s.stats["auto_missed"] == 1
    # the full landing started the count over: DEMOTE_AFTER - 1 more misses keep it
    for i in range(DEMOTE_AFTER - 1):
        push_auto(s, f"q{i}", landed=0)
    assert s.index.stats["demoted"] == 0
    assert s.index.best(PROMPT, None, None, 0) == HeldPrefix(SRC, 4)
    push_auto(s, "last", landed=3)
    assert s.index.stats["demoted"] == 1
    assert s.index.best(PROMPT, None, None, 0) is None
    s.shutdown()


def test_a_named_source_is_not_judged_by_the_index():
    s = auto_scheduler(held=4)
    s._lanes.post = MatchStub(1)
    r = auto_request(params={"push_from": SRC})
    assert asked(s, r) == (BS, True)
    s.update_state_after_alloc(r, Blocks([60, 61]), BS)
    s.take_jobs()
    s.on_worker_meta(PushOutcome({"r1": 0}))
    assert s.stats["auto_missed"] == 0 and s.stats["auto_asked"] == 0
    s.shutdown()


class StartedFollower:
    started: list = []

    def __init__(self, index, config):
        StartedFollower.started.append(index)

    def shutdown(self):
        pass


def test_with_push_auto_every_request_but_upstreams_pd_is_handled(monkeypatch):
    monkeypatch.setattr(decode_scheduler, "FeedFollower", StartedFollower)
    StartedFollower.started = []
    s = PushScheduler(
        BS,
        ExtConfig(
            push_min_tokens=0,
            push_auto=True,
            push_match_timeout_s=1,
            push_sources=(SRC,),
        ),
        FP,
    )
    # the feeds are followed from the start
    assert StartedFollower.started == [s.index] and s.index.origins == [SRC]
    assert s.handles(auto_request(params={}))
    assert s.handles(auto_request(params=None))
    assert s.source_of(auto_request(params={})) == decode_scheduler.AUTO
    assert not s.handles(auto_request(params={"do_remote_prefill": True}))
    assert not s.handles(auto_request(params={"do_remote_decode": True}))
    assert not s.handles(
        auto_request(params={"push_from": "auto", "do_remote_decode": True})
    )
    s.index.apply(SRC, page(keys()[:3]))
    s._lanes.post = MatchStub(3)
    assert asked(s, auto_request(params={})) == (3 * BS, True)
    s.shutdown()


class Recorded(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_push_auto_without_sources_warns_once_and_prefills_locally(monkeypatch):
    monkeypatch.setattr(decode_scheduler, "FeedFollower", StartedFollower)
    StartedFollower.started = []
    rec = Recorded()
    decode_scheduler.logger.addHandler(rec)
    try:
        s = PushScheduler(
            BS, ExtConfig(push_min_tokens=0, push_auto=True, push_match_timeout_s=1), FP
        )
        at_start = [r for r in rec.records if r.levelno == logging.WARNING]
        calls = []
        s._lanes.post = lambda *a: calls.append(a)
        results = [
            s.get_num_new_matched_tokens(auto_request(f"r{i}", params={}), 0)
            for i in range(3)
        ]
    finally:
        decode_scheduler.logger.removeHandler(rec)
    assert len(at_start) == 1
    assert "MOONCAKE_PUSH_SOURCES" in at_start[0].getMessage()
    assert results == [(0, False)] * 3
    assert calls == [] and s.index is None and StartedFollower.started == []
    assert s.stats["auto_no_holder"] == 3
    s.shutdown()


# ---- PushScheduler: push only when it pays, every decision counted ---------------------


def decided(s: PushScheduler) -> dict[str, int]:
    return {k: v for k, v in s.decisions.items() if v}


def test_a_push_below_the_minimum_is_not_asked_for():
    s = auto_scheduler(held=4, config=replace(AUTO_CONFIG, push_min_tokens=5 * BS))
    calls = []
    s._lanes.post = lambda *a: calls.append(a)
    assert s.get_num_new_matched_tokens(auto_request(), 0) == (0, False)
    assert calls == [] and decided(s) == {"below_minimum": 1}
    s.shutdown()


def test_a_push_dearer_than_the_measured_local_prefill_is_not_asked_for():
    s = auto_scheduler(held=4)
    s.cost.observe_round_trip(SRC, 0.01)
    s.cost.observe_push(SRC, 4, 1.0)  # 4 blocks took a second
    s.cost.observe_prefill(4 * BS, 0.001)  # their prefill a millisecond
    calls = []
    s._lanes.post = lambda *a: calls.append(a)
    r = auto_request()
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # asked again: once
    assert calls == [] and decided(s) == {"not_worth_it": 1}
    s.cost.observe_prefill(4 * BS, 10.0)  # the prefill is dear after all
    s.cost.observe_prefill(4 * BS, 10.0)
    s._lanes.post = MatchStub(4)
    assert asked(s, auto_request("r2")) == (4 * BS, True)
    s.shutdown()


def test_every_request_is_counted_once_by_what_became_of_its_push():
    s = auto_scheduler(held=4)
    s._lanes.post = MatchStub(4)
    reqs = [auto_request(f"r{i}") for i in range(3)]
    outcomes = [PushOutcome({"r0": 4}), PushOutcome({"r1": 1}), PushOutcome({"r2": 0})]
    outcomes[2].refused = frozenset({"r2"})
    for i, r in enumerate(reqs):  # one after the other (else they coalesce)
        assert asked(s, r) == (4 * BS, True)
        s.update_state_after_alloc(r, Blocks([10 * i + b for b in range(5)]), 4 * BS)
        s.take_jobs()
        s.on_worker_meta(outcomes[i])
    nobody = auto_request("r9", tokens=range(7, 7 + 5 * BS))
    assert s.get_num_new_matched_tokens(nobody, 0) == (0, False)
    assert decided(s) == {"pushed": 1, "fell_back": 1, "refused": 1, "no_holder": 1}
    assert s.decisions_changed() == s.decisions
    assert s.decisions_changed() is None  # sent once until it changes
    # a pushed request measured the source: round trip and time per block
    assert s.cost.transfer_s(SRC, 4) is not None
    s.shutdown()


def test_a_probe_granted_before_the_match_is_not_refused_on_its_answer():
    """A source judged not worth it is tried again after PROBE_AFTER_S: the grant
    made before asking the source holds when its answer comes."""
    s = auto_scheduler(held=4)
    s.cost.observe_round_trip(SRC, 0.01)
    s.cost.observe_push(SRC, 4, 1.0)
    s.cost.observe_prefill(4 * BS, 0.001)
    s._lanes.post = MatchStub(4)
    assert s.get_num_new_matched_tokens(auto_request("r1"), 0) == (0, False)
    s.cost._pushes[SRC, False].at -= PROBE_AFTER_S  # measured long ago
    assert asked(s, auto_request("r2")) == (4 * BS, True)
    assert decided(s) == {"not_worth_it": 1}
    s.shutdown()


def test_spellings_of_one_source_share_its_figures():
    s = PushScheduler(BS, replace(AUTO_CONFIG, push_auto=False), FP)
    s._lanes.post = MatchStub(4)
    s.cost.observe_round_trip(SRC, 0.01)
    s.cost.observe_push(SRC, 4, 1.0)  # SRC measured slow
    s.cost.observe_prefill(4 * BS, 0.001)
    for k, spelling in enumerate((SRC.upper(), SRC + "/", SRC.replace("http", "HTTP"))):
        r = d_request(f"r{k}", source=spelling, tokens=PROMPT)
        assert asked(s, r) == (0, False), spelling
    assert decided(s) == {"not_worth_it": 3}
    assert list(s.cost._round_trip) == [SRC]  # no entry per spelling
    s.shutdown()


def test_a_source_refusing_the_match_is_counted_as_refused():
    s = auto_scheduler(held=4)
    s._lanes.post = lambda *a: Answer(429, b"busy", {})
    assert asked(s, auto_request()) == (0, False)
    assert decided(s) == {"refused": 1}
    s.shutdown()
