"""connector/hashsync/scheduler_recorder.py, and recorder + table against a real vLLM BlockPool."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    RESET_KEY,
    SCHEDULER_ID,
    HashConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    hash_prompt_blocks,
    to_pool_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashEventKind,
    HashRecorder,
    get_recorder,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.worker_sync import (
    WorkerHashSync,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.worker_table import (
    BlockHashTable,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

S, R, C = HashEventKind.STORED, HashEventKind.REMOVED, HashEventKind.CLEARED


def switch_off(r) -> None:
    """The process-wide recorder as a fresh process has it: off, nothing pending
    (the product never turns it off once a connector enabled it)."""
    r.enabled = False
    r._events = []
    r._overflowed = False


@pytest.fixture
def recorder():
    r = get_recorder()
    switch_off(r)
    listeners, resets = r._reset_listeners[:], r.resets
    r._reset_listeners.clear()
    yield r
    switch_off(r)
    r.hash_config = None
    r._reset_listeners[:], r.resets = listeners, resets


def test_disabled_is_noop(recorder):
    recorder.record_stored(b"k", 1)
    recorder.record_removed(b"k", 1)
    recorder.record_cleared()
    assert len(recorder.drain()) == 0


def test_drain_in_order_and_resets(recorder):
    cfg = HashConfig("sha256", b"\x01" * 32)
    recorder.enable(cfg)
    recorder.record_stored(b"a", 1)
    recorder.record_stored(b"b", 2)
    recorder.record_removed(b"a", 1)
    d = recorder.drain()
    assert d.events == [(S, b"a", 1), (S, b"b", 2), (R, b"a", 1)]
    assert d.hash_config == cfg
    assert recorder.drain().events == []
    switch_off(recorder)
    recorder.record_stored(b"c", 3)
    assert recorder.drain().events == []


def test_cleared_supersedes_earlier_events(recorder):
    recorder.enable()
    recorder.record_stored(b"a", 1)
    recorder.record_cleared()
    recorder.record_stored(b"b", 2)
    assert recorder.drain().events == [(C, b"", -1), (S, b"b", 2)]


def test_a_reset_is_told_to_listeners_before_it_returns_and_counted_in_deltas(
    recorder,
):
    recorder.enable()
    heard = []
    recorder.add_reset_listener(heard.append)
    assert recorder.drain().resets == 0
    recorder.record_cleared()
    assert heard == [1]
    assert recorder.drain().resets == 1
    recorder.remove_reset_listener(heard.append)
    recorder.record_cleared()
    assert heard == [1] and recorder.drain().resets == 2


def test_a_failing_listener_does_not_fail_the_reset(recorder):
    recorder.enable()
    heard = []

    def broken(resets):
        raise RuntimeError("listener bug")

    recorder.add_reset_listener(broken)
    recorder.add_reset_listener(heard.append)
    recorder.record_cleared()
    assert heard == [1]
    assert recorder.drain().events == [(C, b"", -1)]


def test_the_worker_notifier_is_told_only_when_no_listener_is_in_this_process(
    recorder,
):
    recorder.enable()
    told, heard = [], []
    recorder.worker_notifier = told.append
    try:
        recorder.record_cleared()
        assert told == [1]
        recorder.add_reset_listener(heard.append)
        recorder.record_cleared()
        assert told == [1] and heard == [2]
    finally:
        recorder.worker_notifier = None


def test_overflow_degrades_to_clear():
    r = HashRecorder(max_pending=3)
    r.enable()
    for i in range(5):
        r.record_stored(b"x%d" % i, i)
    events = r.drain().events
    assert events[0] == (C, b"", -1)
    assert events[-1] == (S, b"x4", 4)
    assert len(events) <= 4


# ---- against the real BlockPool --------------------------------------------
BS = 4


@pytest.fixture
def observed(monkeypatch):
    """The real BlockPool with the recorder installed as its observer (patch 0008)."""
    from vllm.v1.core import block_pool

    monkeypatch.setattr(block_pool, "block_hash_observer", get_recorder())
    yield


def HookedPool(*args, **kwargs):  # noqa: N802 - the real class, observed through the patch hook
    from vllm.v1.core import block_pool

    assert block_pool.block_hash_observer is not None, "use the `observed` fixture"
    return BlockPool(*args, **kwargs)


def make_request(rid, tokens, salt=None):
    sp = SamplingParams(max_tokens=4)
    sp.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=sp,
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BS, get_hash_fn_by_name("sha256")),
    )


def run_request(pool, req):
    """Allocate fresh blocks, cache the full ones, free them (as a finished request)."""
    n = len(req.all_token_ids) // BS
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, blocks, 0, n, BS, 0)
    pool.free_blocks(reversed(blocks))
    return [b.block_id for b in blocks]


def assert_mirrors(pool, table):
    pool_map = {}
    for key, v in pool.cached_block_hash_to_block._cache.items():
        pool_map[key] = sorted([v.block_id] if hasattr(v, "block_id") else v)
    assert table.size() == sum(len(v) for v in pool_map.values())
    for key, ids in pool_map.items():
        assert sorted(table.lookup(key)) == ids


@pytest.fixture
def none_hash(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", b"", raising=False)
    init_none_hash(get_hash_fn_by_name("sha256"))
    return bytes(kv_cache_utils.NONE_HASH)


def test_table_mirrors_block_pool(recorder, none_hash, observed):
    cfg = HashConfig("sha256", none_hash)
    recorder.enable(cfg)
    pool = HookedPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=BS)
    table = BlockHashTable()

    a_tokens = list(range(1, 1 + 2 * BS))
    a_ids = run_request(pool, make_request("a", a_tokens))
    table.apply(recorder.drain())
    assert_mirrors(pool, table)
    a_hashes = hash_prompt_blocks(a_tokens, BS, cfg.hash_algo, cfg.none_hash)
    assert table.match_prefix(a_hashes) == a_ids
    ids, gens = table.match_and_snapshot(a_hashes)

    # Same tokens, other salt: nothing served.
    salted = hash_prompt_blocks(
        a_tokens, BS, cfg.hash_algo, cfg.none_hash, cache_salt="x"
    )
    assert table.match_prefix(salted) == []

    # A was freed tail-first, so the free queue is [never-used x3, A1, A0]: B's 4
    # blocks take the 3 unused ones and evict + reuse A's second block.
    b_tokens = list(range(500, 500 + 4 * BS))
    b_ids = run_request(pool, make_request("b", b_tokens))
    assert a_ids[1] in b_ids and a_ids[0] not in b_ids
    events = recorder.drain()
    assert (R, to_pool_key(a_hashes[1]), a_ids[1]) in events.events
    table.apply(events)
    assert_mirrors(pool, table)
    assert table.match_prefix(a_hashes) == [a_ids[0]]
    assert table.lookup(to_pool_key(a_hashes[1])) == []
    assert not table.generations_unchanged(ids, gens)
    assert table.generations_unchanged(ids[:1], gens[:1])
    b_hashes = hash_prompt_blocks(b_tokens, BS, cfg.hash_algo, cfg.none_hash)
    assert table.match_prefix(b_hashes) == b_ids

    assert pool.reset_prefix_cache()
    table.apply(recorder.drain())
    assert table.size() == 0
    assert_mirrors(pool, table)


def test_blocks_cached_before_the_first_build_reach_the_worker(
    recorder, none_hash, monkeypatch
):
    """The first request's blocks are cached in schedule(), before the first
    build_connector_meta: SchedulerHashSync must record from construction on
    (found by tests/integration/test_push.py: C's first prompt matched nothing)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_sync import (
        SchedulerHashSync,
    )
    from vllm.v1.core import block_pool

    monkeypatch.setattr(block_pool, "block_hash_observer", None)
    sync = SchedulerHashSync("sha256")
    assert block_pool.block_hash_observer is recorder
    pool = HookedPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=BS)
    tokens = list(range(1, 1 + 2 * BS))
    ids = run_request(pool, make_request("first", tokens))
    delta = sync.build()
    assert delta.hash_config == HashConfig("sha256", none_hash, SCHEDULER_ID, RESET_KEY)
    table = BlockHashTable()
    table.apply(delta)
    assert (
        table.match_prefix(hash_prompt_blocks(tokens, BS, "sha256", none_hash)) == ids
    )


def test_the_worker_is_told_of_resets_only_once_a_delta_has_been_built_for_it(
    recorder, none_hash, monkeypatch
):
    """Before the first delta the worker's mirror holds nothing and has no key to
    check a notice with: a reset then is told to nobody; from the first build on,
    every reset is."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_sync import (
        SchedulerHashSync,
    )
    from vllm.v1.core import block_pool

    monkeypatch.setattr(block_pool, "block_hash_observer", None)
    monkeypatch.setattr(recorder, "worker_notifier", None)
    told: list[int] = []
    sync = SchedulerHashSync("sha256", told.append)
    recorder.record_cleared()
    assert told == []
    sync.build()
    recorder.record_cleared()
    assert told == [recorder.resets]


def test_a_reset_empties_the_mirror_before_it_returns_and_a_stale_delta_is_dropped(
    recorder, none_hash, observed
):
    """An idle instance takes no step after a reset: the worker's mirror (same
    process) must forget at once; a delta drained before the reset and applied
    after it (a step in flight) must not bring the forgotten blocks back."""
    cfg = HashConfig("sha256", none_hash)
    recorder.enable(cfg)
    pool = HookedPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS)
    sync = WorkerHashSync(BS)
    try:
        a_tokens = list(range(1, 1 + 2 * BS))
        a_ids = run_request(pool, make_request("a", a_tokens))
        sync.on_metadata(recorder.drain())
        sync.after_step()
        a_hashes = hash_prompt_blocks(a_tokens, BS, cfg.hash_algo, cfg.none_hash)
        assert sync.table.match_prefix(a_hashes) == a_ids

        b_tokens = list(range(300, 300 + 2 * BS))
        run_request(pool, make_request("b", b_tokens))
        in_flight = recorder.drain()  # B's stores, not applied yet
        assert pool.reset_prefix_cache()
        assert sync.table.match_prefix(a_hashes) == []  # no step in between
        assert sync.table.size() == 0

        sync.on_metadata(in_flight)
        sync.after_step()
        b_hashes = hash_prompt_blocks(b_tokens, BS, cfg.hash_algo, cfg.none_hash)
        assert sync.table.match_prefix(b_hashes) == []

        c_ids = run_request(pool, make_request("c", a_tokens))  # after the reset
        sync.on_metadata(recorder.drain())
        sync.after_step()
        assert sync.table.match_prefix(a_hashes) == c_ids
        assert_mirrors(pool, sync.table)
    finally:
        sync.close()
    assert sync.table.clear not in recorder._reset_listeners
