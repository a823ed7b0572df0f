"""connector/hashsync/worker_table.py: the worker-side hash -> block id mirror."""

import pickle

import pytest
from helpers import commit_pending

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
    HashConfigMismatchError,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    to_pool_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashDelta,
    HashEventKind,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.worker_table import (
    BlockHashTable,
)

S, R, C = HashEventKind.STORED, HashEventKind.REMOVED, HashEventKind.CLEARED


def h(i: int) -> bytes:
    return bytes([i]) * 32


def k(i: int, group: int = 0) -> bytes:
    return to_pool_key(h(i), group)


def delta(*events, cfg=None) -> HashDelta:
    return HashDelta(events=list(events), hash_config=cfg)


def test_caching_and_prefix_match():
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10), (S, k(2), 11), (S, k(3), 12)))
    assert t.size() == 3
    assert t.match_prefix([h(1), h(2), h(3)]) == [10, 11, 12]
    assert t.match_prefix([h(1), h(2)]) == [10, 11]
    assert t.match_prefix([h(1), h(2), h(3), h(4)]) == [10, 11, 12]
    assert t.match_prefix([h(9), h(1)]) == []
    assert t.match_prefix([]) == []


def test_longest_prefix_stops_at_hole():
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10), (S, k(3), 12), (S, k(4), 13)))
    assert t.match_prefix([h(1), h(2), h(3), h(4)]) == [10]


def test_group_id_is_part_of_key():
    t = BlockHashTable()
    t.apply(delta((S, k(1, group=1), 10)))
    assert t.match_prefix([h(1)]) == []
    assert t.match_prefix([h(1)], group_id=1) == [10]


def test_eviction():
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10), (S, k(2), 11)))
    t.apply(delta((R, k(1), 10)))
    assert t.size() == 1
    assert t.match_prefix([h(1), h(2)]) == []
    assert t.lookup(k(1)) == []
    assert t.lookup(k(2)) == [11]


def test_reuse_for_other_content_with_removal():
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10)))
    t.apply(delta((R, k(1), 10), (S, k(7), 10)))
    assert t.match_prefix([h(1)]) == []
    assert t.match_prefix([h(7)]) == [10]
    assert t.size() == 1


def test_restore_under_new_hash_drops_old_hash():
    # No removal event in between: the old hash must still never be served.
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10), (S, k(7), 10)))
    assert t.match_prefix([h(1)]) == []
    assert t.lookup(k(1)) == []
    assert t.match_prefix([h(7)]) == [10]
    assert t.size() == 1


def test_stale_removal_ignored():
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10), (S, k(7), 10)))  # block 10 now holds hash 7
    gens = t.generations([10])
    t.apply(delta((R, k(1), 10)))  # stale: block 10 no longer holds hash 1
    assert t.match_prefix([h(7)]) == [10]
    assert t.generations([10]) == gens
    t.apply(delta((R, k(7), 99)))  # hash 7 not held by block 99
    assert t.match_prefix([h(7)]) == [10]
    t.apply(delta((R, k(5), 42)))  # unknown entirely
    assert t.size() == 1


def test_duplicate_key_in_two_blocks():
    # vLLM does not de-duplicate cached blocks: one hash may live in two blocks.
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10), (S, k(1), 20)))
    assert t.size() == 2
    assert t.lookup(k(1)) == [10, 20]
    t.apply(delta((R, k(1), 10)))
    assert t.match_prefix([h(1)]) == [20]
    t.apply(delta((R, k(1), 20)))
    assert t.match_prefix([h(1)]) == []


def test_store_is_idempotent():
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10)))
    g = t.generations([10])
    t.apply(delta((S, k(1), 10)))
    assert t.size() == 1 and t.generations([10]) == g


def test_generation_check():
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10), (S, k(2), 11), (S, k(3), 12)))
    ids, gens = t.match_and_snapshot([h(1), h(2), h(3)])
    assert ids == [10, 11, 12]
    assert t.generations_unchanged(ids, gens)
    t.apply(delta((S, k(4), 13)))  # unrelated block cached: push still fine
    assert t.generations_unchanged(ids, gens)
    t.apply(delta((R, k(2), 11), (S, k(9), 11)))  # evicted and reused mid-push
    assert not t.generations_unchanged(ids, gens)
    # Even if it comes back with the same content, the push must fail.
    t.apply(delta((R, k(9), 11), (S, k(2), 11)))
    assert t.match_prefix([h(1), h(2), h(3)]) == ids
    assert not t.generations_unchanged(ids, gens)
    with pytest.raises(ValueError):
        t.generations_unchanged(ids, gens[:1])


def test_generation_bumped_by_reuse_without_removal():
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10)))
    ids, gens = t.match_and_snapshot([h(1)])
    t.apply(delta((S, k(2), 10)))
    assert not t.generations_unchanged(ids, gens)


def test_cleared():
    t = BlockHashTable()
    t.apply(delta((S, k(1), 10), (S, k(2), 11)))
    ids, gens = t.match_and_snapshot([h(1), h(2)])
    t.apply(delta((C, b"", -1), (S, k(5), 12)))
    assert t.match_prefix([h(1)]) == []
    assert t.size() == 1
    assert not t.generations_unchanged(ids, gens)


def test_deferred_stores_visible_after_commit():
    t = BlockHashTable(defer_stores=True)
    t.apply(delta((S, k(1), 10), (S, k(2), 11)))
    assert t.match_prefix([h(1)]) == [] and t.size() == 0 and t.num_pending() == 2
    assert commit_pending(t) == 2
    assert t.match_prefix([h(1), h(2)]) == [10, 11]
    # Removal before commit: never becomes visible.
    t.apply(delta((S, k(3), 12), (R, k(3), 12)))
    assert commit_pending(t) == 0
    assert t.match_prefix([h(3)]) == []
    # Reuse of a committed block hides its old hash at once.
    t.apply(delta((S, k(8), 10)))
    assert t.match_prefix([h(1)]) == []
    commit_pending(t)
    assert t.match_prefix([h(8)]) == [10]


def test_hash_config_mismatch_fails_loudly():
    t = BlockHashTable()
    cfg = HashConfig("sha256", b"\x01" * 32)
    t.apply(delta(cfg=cfg))
    t.apply(delta((S, k(1), 10), cfg=cfg))
    assert t.hash_config == cfg
    with pytest.raises(HashConfigMismatchError):
        t.apply(delta(cfg=HashConfig("sha256", b"\x02" * 32)))


def test_size_and_sample():
    t = BlockHashTable()
    t.apply(delta(*[(S, k(i, group=1), 100 + i) for i in range(5)]))
    assert t.size() == 5
    s = t.sample(2)
    assert len(s) == 2
    assert s[0] == {"block_id": 100, "group_id": 1, "block_hash": h(0).hex()}
    assert len(t.sample(50)) == 5
    assert t.sample(0) == []


def test_delta_pickles():
    d = delta((S, k(1), 10), cfg=HashConfig("sha256", b"\x01" * 32))
    d2 = pickle.loads(pickle.dumps(d))
    assert d2 == d
    t = BlockHashTable()
    t.apply(d2)
    assert t.match_prefix([h(1)]) == [10]
