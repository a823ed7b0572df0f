"""A prefix-cache reset reaching the worker's mirror: the notice POST
/hashsync/reset (routes.py, hashsync/worker_sync.py), taken only from the
instance's own scheduler (its proof, feed_protocol.reset_proof) and only for the
next reset, and the reset count every delta carries (hashsync/worker_table.py),
which only moves the mirror forward."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from helpers import READ, TOKEN, serve_routes

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    EndpointGuard,
    request_headers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync import (
    feed_protocol,
    hash_config,
    scheduler_sync,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.feed_protocol import (
    FEED_PATH,
    RESET_PATH,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    hash_prompt_blocks,
    scheduler_hash_config,
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
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.routes import (
    Served,
    add_routes,
)
from vllm.v1.core import kv_cache_utils

S, C = HashEventKind.STORED, HashEventKind.CLEARED
BS = 4
PROMPT = list(range(100, 100 + 2 * BS))  # two full blocks
CONFIG = ExtConfig(bootstrap_host="0.0.0.0", bootstrap_token=TOKEN)


@pytest.fixture
def cfg(monkeypatch):
    """The hash configuration this process's scheduler ships to its worker."""
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", b"\x01" * 32, raising=False)
    return scheduler_hash_config("sha256")


def keys(cfg) -> list[bytes]:
    hashes = hash_prompt_blocks(PROMPT, BS, cfg.hash_algo, cfg.none_hash)
    return [to_pool_key(h) for h in hashes]


def step(sync: WorkerHashSync, resets: int, *events, cfg=None) -> None:
    """One scheduler step reaching the mirror: its delta, then its forward."""
    sync.on_metadata(HashDelta(events=list(events), hash_config=cfg, resets=resets))
    sync.after_step()


@pytest.fixture
def sync(cfg):
    """A mirror whose scheduler's first step cached the prompt's first block (3)."""
    s = WorkerHashSync(BS)
    step(s, 0, (S, keys(cfg)[0], 3), cfg=cfg)
    yield s
    s.close()


def client_of(sync: WorkerHashSync) -> TestClient:
    app = FastAPI()
    served = Served(hashsync=lambda: sync, push=lambda: None, layerwise=lambda: None)
    add_routes(app, EndpointGuard(CONFIG), CONFIG, served)
    return TestClient(app)


def post(client: TestClient, path: str, body: bytes):
    """A POST signed with the bootstrap token: what any instance can send."""
    return client.post(
        path, content=body, headers=request_headers(CONFIG, "POST", path, body)
    )


def notice(resets: int) -> bytes:
    """The scheduler's own notice of its ``resets``-th reset."""
    sid = hash_config.SCHEDULER_ID
    proof = feed_protocol.reset_proof(hash_config.RESET_KEY, sid, resets)
    return json.dumps({"scheduler_id": sid, "resets": resets, "proof": proof}).encode()


def test_a_forged_notice_far_ahead_neither_empties_nor_silences_the_mirror(sync, cfg):
    """A holder of the token reads the scheduler's id from the feed and posts a
    notice 1024 resets ahead: refused, and the scheduler's later deltas still
    reach the mirror (before, the mirror dropped every one of them until restart)."""
    client = client_of(sync)
    page = post(client, FEED_PATH, b'{"epoch": null, "since": 0, "wait_ms": 0}')
    assert page.status_code == 200
    sid, applied = page.json()["scheduler_id"], sync.table.resets_applied()
    forged = [
        {"scheduler_id": sid, "resets": applied + 1024},
        {"scheduler_id": sid, "resets": applied + 1024, "proof": "ab" * 32},
        {"scheduler_id": sid, "resets": applied + 1, "proof": "ab" * 32},
    ]
    for body in forged:
        r = post(client, RESET_PATH, json.dumps(body).encode())
        assert r.status_code in (403, 422), (body, r.status_code, r.text)
        assert sync.table.size() == 1, body
    step(sync, applied, (S, keys(cfg)[1], 4))  # the scheduler's next step
    block_ids, _, full = sync.match(PROMPT)
    assert (block_ids, full) == ([3, 4], 2)


def test_a_wrong_proof_is_403_and_names_who_may_reset(sync):
    body = json.loads(notice(1))
    body["proof"] = feed_protocol.reset_proof("another key", body["scheduler_id"], 1)
    r = post(client_of(sync), RESET_PATH, json.dumps(body).encode())
    assert r.status_code == 403 and "only the scheduler" in r.text
    assert sync.table.size() == 1


def test_the_schedulers_notice_of_its_next_reset_empties_the_mirror_at_once(sync, cfg):
    client = client_of(sync)
    r = post(client, RESET_PATH, notice(1))
    assert (r.status_code, r.json()) == (200, {"resets": 1, "size": 0})
    assert sync.table.resets_applied() == 1
    # a step in flight, drained before the reset, brings nothing back
    step(sync, 0, (S, keys(cfg)[1], 4))
    assert sync.table.size() == 0
    # the step after the reset counts it: the mirror follows the cache again
    step(sync, 1, (C, b"", -1), (S, keys(cfg)[0], 7))
    assert sync.match(PROMPT)[0] == [7]


def test_a_notice_that_is_not_the_next_reset_is_409_and_silences_nothing(sync, cfg):
    """Even the scheduler's own proof: only the next reset (one more than applied)
    is taken; the deltas bring the mirror up to date otherwise."""
    client = client_of(sync)
    for resets in (1024, 2):
        r = post(client, RESET_PATH, notice(resets))
        assert r.status_code == 409 and "not the next one" in r.text, r.text
        assert sync.table.size() == 1 and sync.table.resets_applied() == 0
    step(sync, 0, (S, keys(cfg)[1], 4))
    assert sync.match(PROMPT)[0] == [3, 4]


def test_a_notice_that_changes_nothing_is_409(sync, cfg):
    client = client_of(sync)
    step(sync, 1, (C, b"", -1), (S, keys(cfg)[0], 5))  # the reset came by the delta
    r = post(client, RESET_PATH, notice(1))
    assert r.status_code == 409 and "applied already" in r.text, r.text
    assert sync.match(PROMPT)[0] == [5]
    fresh = WorkerHashSync(BS)  # no step has reached it: nothing to forget
    try:
        r = post(client_of(fresh), RESET_PATH, notice(1))
        assert r.status_code == 409 and "holds nothing" in r.text, r.text
        assert fresh.table.resets_applied() == 0
    finally:
        fresh.close()


def test_a_delta_counting_resets_the_mirror_missed_forgets_what_it_held():
    """A delta drained after N resets carries resets=N: a mirror that applied fewer
    (a notice failed) forgets its blocks before the delta's own events, and then
    drops deltas drained before the N-th reset."""
    t = BlockHashTable()
    a, b, c = (to_pool_key(bytes([i]) * 32) for i in (1, 2, 3))
    t.apply(HashDelta(events=[(S, a, 3)], resets=0))
    t.apply(HashDelta(events=[(S, b, 4)], resets=2))
    assert (t.lookup(a), t.lookup(b), t.resets_applied()) == ([], [4], 2)
    t.apply(HashDelta(events=[(S, c, 5)], resets=1))  # drained before the 2nd
    assert t.lookup(c) == [] and t.resets_applied() == 2


def test_the_reset_key_is_in_no_page_no_answer_and_no_repr(sync, cfg):
    key = hash_config.RESET_KEY
    assert cfg.reset_key == key and key not in repr(cfg)
    client = client_of(sync)
    answers = [
        post(client, FEED_PATH, b'{"epoch": null, "since": 0, "wait_ms": 0}').text,
        client.get("/hashsync", headers={"authorization": f"Bearer {READ}"}).text,
        post(client, RESET_PATH, notice(5)).text,
    ]
    assert all(key not in a for a in answers), answers


def test_the_schedulers_notifier_is_taken_by_its_own_mirror(sync, monkeypatch):
    """Over HTTP, as the scheduler in another process sends it: accepted, no warning."""
    warned: list[str] = []
    monkeypatch.setattr(
        scheduler_sync.logger, "warning", lambda msg, *a: warned.append(msg % a)
    )
    url, stop = serve_routes(CONFIG, hashsync=sync)
    try:
        scheduler_sync.WorkerResetNotifier(url, CONFIG)(1)
    finally:
        stop()
    assert warned == [] and sync.table.size() == 0
    assert sync.table.resets_applied() == 1
