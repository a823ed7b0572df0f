"""connector/push/source_server.py: what POST /push_blocks writes where.

The transfer engine is replaced by a memmove between real buffers, so the
address arithmetic (KV tensor bases, block_len, first_block, runs of
contiguous blocks) is checked byte for byte; the real engine and two real
instances are in tests/integration/test_push.py."""

import ctypes
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import C_SOURCE, KV, filled_mirror

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashDelta,
    HashEventKind,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.worker_sync import (
    WorkerHashSync,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.metadata import (
    ExtMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_server import (
    BytesByDestination,
    PushServer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.scheduler_extension import (
    PrefillBacklog,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.worker_extension import (
    PushSourceStep,
)

BS, SLOTS, NBLK, BLEN = 4, 3, 16, 64
CFG = HashConfig("sha256", b"\x01" * 32)
TOKENS = list(range(100, 100 + 3 * BS + 2))  # 3 full blocks + 2 tokens
C_BLOCKS = [5, 2, 9]
NOW_MS = 1_700_000_000_000  # C's wall clock (ms), fixed
DEADLINE_MS = NOW_MS + 30_000  # the push's deadline: not reached
# C's and D's KV caches are alike (the fingerprint each sends / checks)
FP = KVFingerprint(
    model="Arch:0123456789abcdef",
    dtype="float32/auto",
    block_size=BS,
    tp_size=1,
    block_len=BLEN,
    num_kv_tensors=SLOTS,
)
C_SESSION = "127.0.0.1:4321"  # C's own transfer engine (never a destination)


def instance(fill: bool) -> KV:
    """C's or D's KV cache in this module's layout."""
    return KV(fill, slots=SLOTS, nblk=NBLK, blen=BLEN)


def memmove_write(log):
    def write(session, src, dst, lens, layout=None):
        log.append((session, list(src), list(dst), list(lens)))
        for s, d, n in zip(src, dst, lens):
            ctypes.memmove(d, s, n)
        return 0

    return write


def make(held=C_BLOCKS, salt=None, write=None, log=None):
    c, d = instance(True), instance(False)
    sync = filled_mirror(BS, TOKENS, held, CFG, cache_salt=salt)
    log = [] if log is None else log
    server = PushServer(
        sync,
        write or memmove_write(log),
        c.bases,
        BLEN,
        FP,
        C_SESSION,
        config=ExtConfig(),
        wall_clock_ms=lambda: NOW_MS,
        source_id=C_SOURCE,
    )
    return server, c, d, log


def body(d, **over):
    b = {
        "token_ids": TOKENS,
        "block_size": BS,
        "dst_session": "127.0.0.1:1234",
        "dst_kv_base_addrs": d.bases,
        "dst_block_ids": [0, 1, 2],
        "block_len": BLEN,
        "request_id": "r1",
        "deadline_unix_ms": DEADLINE_MS,
        "dst_num_blocks": NBLK,
        "source_id": C_SOURCE,
        "fingerprint": FP.model_dump(),
    }
    b.update(over)
    return b


def test_full_push_lands_every_slot_byte_exact():
    server, c, d, log = make()
    code, resp = server.push(body(d, dst_block_ids=[7, 8, 3]))
    assert code == 200 and resp["status"] == "ok", resp
    assert resp["pushed_blocks"] == 3 and resp["matched_blocks"] == 3
    assert resp["matched_tokens"] == 3 * BS and resp["bytes"] == 3 * SLOTS * BLEN
    for s in range(SLOTS):
        for cb, db in zip(C_BLOCKS, [7, 8, 3]):
            assert (d.block(s, db) == c.block(s, cb)).all()
    assert {e for e in np.concatenate(d.kv)} - {0}  # something was written
    assert len(log) == 1  # one batch


def test_contiguous_blocks_become_one_entry_per_tensor():
    server, c, d, log = make(held=[4, 5, 6])
    server.push(body(d, dst_block_ids=[10, 11, 12]))
    _, src, dst, lens = log[0]
    assert lens == [3 * BLEN] * SLOTS
    assert src == [base + 4 * BLEN for base in c.bases]


def test_first_block_skips_what_d_already_holds():
    server, c, d, _ = make()
    code, resp = server.push(body(d, first_block=1, dst_block_ids=[8, 9]))
    assert resp["status"] == "ok" and resp["pushed_blocks"] == 2
    for s in range(SLOTS):
        assert (d.block(s, 8) == c.block(s, 2)).all() and (
            d.block(s, 9) == c.block(s, 9)
        ).all()
        assert not d.block(s, 0).any()


def test_shorter_held_prefix_pushes_what_is_held():
    server, c, d, _ = make(held=C_BLOCKS[:2])
    code, resp = server.push(body(d))
    assert (
        resp["status"] == "ok"
        and resp["pushed_blocks"] == 2
        and resp["matched_blocks"] == 2
    )
    assert "2 of 3" in resp["message"]
    for s in range(SLOTS):
        assert not d.block(s, 2).any()


@pytest.mark.parametrize(
    "over", [{"cache_salt": "other-tenant"}, {"token_ids": [1] * 20}]
)
def test_no_match_writes_nothing(over):
    server, c, d, log = make()
    code, resp = server.push(body(d, **over))
    assert code == 200 and resp["status"] == "no_match" and resp["pushed_blocks"] == 0
    assert log == [] and not any(t.any() for t in d.kv)


@pytest.mark.parametrize(
    "over,field",
    [
        ({"block_len": BLEN * 2}, "block_len"),
        ({"block_size": BS * 2}, "block_size"),
        ({"dst_kv_base_addrs": [1, 2]}, "dst_kv_base_addrs"),
        ({"dst_block_ids": [0, 1, 2, 3]}, "dst_block_ids"),
        ({"dst_session": "nohost"}, "dst_session"),
        ({"token_ids": "abc"}, "token_ids"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_bad_request_is_422_naming_the_field_and_writes_nothing(over, field):
    server, c, d, log = make()
    code, resp = server.push(body(d, **over))
    assert code == 422 and resp["detail"]["field"] == field, resp
    assert log == []


def test_engine_failure_reports_failed():
    server, c, d, _ = make(write=lambda *a: -1)
    code, resp = server.push(body(d))
    assert (
        code == 200 and resp["status"] == "failed" and "returned -1" in resp["message"]
    )
    assert resp["pushed_blocks"] == 0


def test_engine_raising_reports_failed():
    def boom(*a):
        raise RuntimeError("segment gone")

    server, c, d, _ = make(write=boom)
    assert server.push(body(d))[1]["status"] == "failed"


def test_block_evicted_during_the_write_reports_failed():
    holder = {}

    def evict_while_writing(session, src, dst, lens):
        sync = holder["server"].sync
        key = sync.table._by_block[C_BLOCKS[1]]
        sync.on_metadata(HashDelta(events=[(HashEventKind.REMOVED, key, C_BLOCKS[1])]))
        return 0

    server, c, d, _ = make(write=evict_while_writing)
    holder["server"] = server
    code, resp = server.push(body(d))
    assert resp["status"] == "failed" and "evicted" in resp["message"]


def test_before_the_first_step_is_503():
    c, d = instance(True), instance(False)
    server = PushServer(
        WorkerHashSync(BS),
        memmove_write([]),
        c.bases,
        BLEN,
        FP,
        C_SESSION,
        wall_clock_ms=lambda: NOW_MS,
        source_id=C_SOURCE,
    )
    assert server.push(body(d))[0] == 503


def test_write_runs_on_a_thread_at_nice_19_and_the_caller_keeps_its_priority():
    """A write polls the engine on its calling thread (push/writer.py):
    C's write must poll at nice 19, not at the bootstrap thread's priority."""
    seen = []
    inner = memmove_write([])

    def write(session, src, dst, lens, layout=None):
        seen.append(
            (
                threading.get_native_id(),
                os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
            )
        )
        return inner(session, src, dst, lens)

    server, c, d, _ = make(write=write)
    caller_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    code, resp = server.push(body(d))
    assert code == 200 and resp["status"] == "ok", resp
    [(tid, nice)] = seen
    assert tid != threading.get_native_id() and nice == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller_nice
    for s in range(SLOTS):  # the write still landed before the answer
        assert (d.block(s, 2) == c.block(s, C_BLOCKS[2])).all()


def test_engine_raising_on_the_writer_thread_fails_the_push():
    def write(session, src, dst, lens, layout=None):
        raise RuntimeError("engine gone")

    server, _, d, _ = make(write=write)
    code, resp = server.push(body(d))
    assert (
        code == 200 and resp["status"] == "failed" and "engine gone" in resp["message"]
    )
    assert server.stats["failed"] == 1 and server.stats["entries"] == 0


def test_stats_count_entries_and_write_seconds_of_ok_pushes():
    """microbench/push reads these around each push (C's write seconds and layout)."""
    server, _, d, _ = make(held=[4, 5, 6])
    server.push(body(d, dst_block_ids=[10, 11, 12]))  # one run: one entry per KV tensor
    server.push(body(d, dst_block_ids=[10, 12, 14]))  # three runs
    assert server.stats["ok"] == 2 and server.stats["bytes"] == 2 * 3 * SLOTS * BLEN
    assert server.stats["entries"] == SLOTS + 3 * SLOTS
    assert server.stats["write_seconds"] > 0


@pytest.mark.parametrize(
    "now_ms,received_ago_s,budget_ms,writes",
    [
        (NOW_MS, 0.4, 500, True),  # within both
        (
            NOW_MS,
            0.6,
            500,
            False,
        ),  # the budget passed, the deadline (C's clock) far ahead
        (DEADLINE_MS + 1, 0.0, 500, False),  # the deadline passed, the budget not
        (NOW_MS, 100.0, None, True),  # no budget sent: the deadline alone
    ],
)
def test_the_write_starts_only_within_both_the_deadline_and_the_budget(
    now_ms, received_ago_s, budget_ms, writes
):
    server, c, d, log = make()
    server._now_ms = lambda: now_ms
    server.clock = lambda: 500.0
    over = {} if budget_ms is None else {"budget_ms": budget_ms}
    code, resp = server.push(body(d, **over), received=500.0 - received_ago_s)
    assert code == 200 and (resp["status"] == "ok") == writes, resp
    assert bool(log) == writes and any(t.any() for t in d.kv) == writes
    if not writes:
        what = "budget of 500 ms" if received_ago_s else "deadline"
        assert (
            f"the push's {what} passed" in resp["message"]
            and "nothing written" in resp["message"]
        )
        assert server.stats["past_deadline"] == 1


def test_match_reports_the_engine_timeout_and_the_clock():
    server, _, _, _ = make()
    code, out = server.match({"token_ids": TOKENS})
    assert code == 200 and out["now_unix_ms"] == NOW_MS
    assert out["engine_timeout_s"] == ExtConfig().engine_transfer_timeout_s


def test_match_reports_the_sources_load():
    """Pushes in progress within their bound (the slots), the limit, and the
    scheduler's prefill backlog as the last step's metadata gave it."""
    server, _, _, _ = make()
    _, out = server.match({"token_ids": TOKENS})
    limit = ExtConfig().push_max_concurrent
    assert (out["pushes_in_flight"], out["push_slots"]) == (0, limit)
    assert out["prefill_backlog_tokens"] is None  # no step yet
    token = server.try_begin()
    assert token is not None
    PushSourceStep(server).before_forward(ExtMetadata(prefill_backlog_tokens=7000))
    _, out = server.match({"token_ids": TOKENS})
    assert (out["pushes_in_flight"], out["prefill_backlog_tokens"]) == (1, 7000)
    server.end(token)
    PushSourceStep(server).before_forward(ExtMetadata())  # a D-only step says nothing
    _, out = server.match({"token_ids": TOKENS})
    assert (out["pushes_in_flight"], out["prefill_backlog_tokens"]) == (0, 7000)


def test_the_prefill_backlog_counts_admitted_prompt_tokens_not_computed():
    backlog = PrefillBacklog()
    a = SimpleNamespace(request_id="a", num_prompt_tokens=1000, num_computed_tokens=0)
    b = SimpleNamespace(request_id="b", num_prompt_tokens=500, num_computed_tokens=0)
    backlog.added(a)
    backlog.added(b)
    assert backlog.tokens({}) == 1500
    # the step schedules 600 of a's: counted as computed (vLLM advances
    # num_computed_tokens after the metadata is built)
    assert backlog.tokens({"a": 600}) == 900
    a.num_computed_tokens = 600
    b.num_computed_tokens = 520  # b decodes
    assert backlog.tokens({}) == 400
    assert backlog.tokens({"a": 400, "b": 1}) == 0  # a's last chunk
    backlog.finished(a)
    backlog.finished(a)  # twice: nothing more
    assert backlog.tokens({}) == 0


def test_the_backlog_counts_the_requests_a_local_prefill_would_delay():
    backlog = PrefillBacklog()
    reqs = {
        rid: SimpleNamespace(
            request_id=rid, num_prompt_tokens=1000, num_computed_tokens=computed
        )
        for rid, computed in (("new", 0), ("a", 0), ("b", 600), ("decoding", 1000))
    }
    for r in reqs.values():
        backlog.added(r)
    # a waits, b prefills, "decoding" has its prompt computed; "new" is the one judged
    assert backlog.queued("new") == 2
    backlog.finished(reqs["a"])
    assert backlog.queued("new") == 1 and backlog.queued("b") == 1


def test_bytes_by_destination_are_kept_for_a_bounded_number_of_destinations():
    """GET /push/stats gives the bytes written to each destination; a source
    serving ever new peers forgets the one it wrote to least recently."""
    kept = BytesByDestination(kept=2)
    kept.add("d1:1", 10)
    kept.add("d2:1", 20)
    kept.add("d1:1", 5)  # d1 is now the most recent
    kept.add("d3:1", 1)
    assert kept.snapshot() == {"d1:1": 15, "d3:1": 1}
