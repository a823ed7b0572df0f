"""peer_refusal.py and its use: a peer whose writes keep failing is refused for a
while, the refusal submits nothing, and it is counted and said.

The engine is a stand-in with Mooncake's per-task answers; the real engine is in
tests/integration/test_engine_failure_semantics.py."""

from __future__ import annotations

import logging

from helpers import (
    BLEN,
    BS,
    C_BLOCKS,
    C_SESSION,
    C_SOURCE,
    D_SESSION,
    FP,
    HCFG,
    KV,
    TOKENS,
    RecordedFence,
    filled_mirror,
    push_body,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.engine_write import (
    TerminalWriter,
    write_refusal,
    write_stats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.peer_refusal import (
    RefusedPeers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_server import (
    PushServer,
)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def peers(**kw) -> tuple[RefusedPeers, Clock]:
    clock = Clock()
    return RefusedPeers(clock=clock, **kw), clock


def test_three_failed_writes_in_a_row_refuse_the_peer_for_a_while(caplog):
    p, clock = peers(refuse_after=3, first_s=30)
    for _ in range(2):
        p.record("d:1", ok=False)
        assert p.refusal("d:1") is None
    with caplog.at_level(logging.WARNING):
        p.record("d:1", ok=False)
    why = p.refusal("d:1")
    assert why is not None and "d:1" in why and "last 3 writes failed" in why
    assert "nothing written" in why and "another 30 s" in why
    said = [
        r.getMessage() for r in caplog.records if "refused for 30 s" in r.getMessage()
    ]
    assert (
        len(said) == 1 and "the last 3 transfer-engine writes to d:1 failed" in said[0]
    )
    assert p.refusal("d:2") is None  # only that peer
    assert p.num_refused() == 1 and p.refusals == 1 and p.refused_writes == 1
    clock.now += 29.9
    assert p.refusal("d:1") is not None
    clock.now += 0.2
    assert p.refusal("d:1") is None and p.num_refused() == 0  # tried again


def test_a_success_between_failures_starts_the_count_again():
    p, _ = peers(refuse_after=3)
    for ok in (False, False, True, False, False):
        p.record("d:1", ok=ok)
    assert p.refusal("d:1") is None


def test_each_failure_after_a_refusal_refuses_twice_as_long_up_to_the_cap():
    p, clock = peers(refuse_after=2, first_s=10, max_s=35)
    lengths = []
    for _ in range(2):
        p.record("d:1", ok=False)
    for _ in range(4):
        start = clock.now
        while p.refusal("d:1") is not None:
            clock.now += 1
        lengths.append(clock.now - start)
        p.record("d:1", ok=False)  # the write after the refusal fails too
    assert lengths == [10, 20, 35, 35]
    p.record("d:1", ok=True)  # one success ends it all
    p.record("d:1", ok=False)
    assert p.refusal("d:1") is None


def test_a_failure_of_a_write_started_before_the_refusal_does_not_extend_it():
    p, clock = peers(refuse_after=1, first_s=10)
    p.record("d:1", ok=False)
    clock.now += 5
    p.record("d:1", ok=False)  # in flight when the refusal started
    clock.now += 5.1
    assert p.refusal("d:1") is None


def test_zero_never_refuses_and_the_peers_kept_are_bounded():
    p, _ = peers(refuse_after=0)
    for _ in range(10):
        p.record("d:1", ok=False)
    assert p.refusal("d:1") is None
    p, _ = peers(refuse_after=1, kept=3)
    for i in range(10):
        p.record(f"d:{i}", ok=False)
    assert p.num_refused() == 3 and len(p._peers) == 3


class FailingEngine:
    """Mooncake's per-task calls: every task it accepts ends FAILED (-1)."""

    def __init__(self):
        self.submitted: list[str] = []

    def transfer_submit_write(self, session, src, dst, length):
        self.submitted.append(session)
        return len(self.submitted)  # a batch id, never 0

    def transfer_check_status(self, batch_id):
        return -1


def failing_writer(**peer_kw) -> tuple[TerminalWriter, FailingEngine]:
    eng = FailingEngine()
    w = TerminalWriter(
        eng,
        ExtConfig(),
        sleep=lambda s: None,
        fence=RecordedFence(),
        peers=RefusedPeers(**peer_kw),
    )
    return w, eng


def test_a_refused_write_submits_nothing_and_other_peers_are_written_to():
    w, eng = failing_writer(refuse_after=3)
    for _ in range(3):
        assert w("d:1", [1], [2], [8]) == -1
    assert len(eng.submitted) == 3
    assert w("d:1", [1], [2], [8]) == -1
    assert len(eng.submitted) == 3, "a refused peer was written to"
    assert w.fence.waited == ["d:1"] * 3  # nothing to fence for the refused one
    assert write_refusal(w, "d:1") is not None and write_refusal(w, "d:2") is None
    assert w("d:2", [1], [2], [8]) == -1 and len(eng.submitted) == 4
    stats = write_stats(w)
    assert stats["refused_peers_now"] == 1 and stats["peer_refusals"] == 1
    assert stats["refused_writes"] == 2  # the write and the question
    assert write_refusal(lambda *a: 0, "d:1") is None  # another write function
    assert write_stats(lambda *a: 0)["refused_peers_now"] == 0


def source_server(w: TerminalWriter, c: KV) -> PushServer:
    """C with the blocks of TOKENS cached, writing with ``w``."""
    return PushServer(
        filled_mirror(BS, TOKENS, C_BLOCKS, HCFG),
        w,
        c.bases,
        BLEN,
        FP,
        C_SESSION,
        ExtConfig(),
        source_id=C_SOURCE,
    )


def test_a_push_to_a_destination_whose_writes_keep_failing_is_answered_at_once():
    """C: three pushes whose writes fail, then a fourth is answered ``failed`` with
    the refusal, without a write (D frees its blocks and prefills locally)."""
    c, d = KV(fill=True), KV(fill=False)
    w, eng = failing_writer(refuse_after=3)
    server = source_server(w, c)
    body = push_body(d)
    for _ in range(3):
        code, resp = server.push(body)
        assert code == 200 and resp["status"] == "failed", resp
    submitted = len(eng.submitted)
    assert submitted >= 3
    code, resp = server.push(body)
    assert code == 200 and resp["status"] == "failed", resp
    assert f"writes to {D_SESSION} are refused" in resp["message"]
    assert "nothing written" in resp["message"]
    assert len(eng.submitted) == submitted, "written to a refused destination"
    assert server.stats["peer_refused"] == 1
    assert server.write_stats()["refused_peers_now"] == 1


def test_failures_for_one_layout_do_not_refuse_the_same_session_with_another():
    peers = RefusedPeers(refuse_after=2)
    for _ in range(2):
        peers.record("d:1", False, (100, 200))
    assert peers.refusal("d:1", (100, 200)) is not None
    assert peers.refusal("d:1", (300, 400)) is None
    assert peers.refusal("d:1") is None  # a caller that does not know the layout


class RangeEngine(FailingEngine):
    """Writes land only inside ``ranges`` (the destination's registered memory):
    a task to any other address ends FAILED, as Mooncake's does."""

    def __init__(self, ranges):
        super().__init__()
        self.ranges = ranges
        self.dst: dict[int, int] = {}

    def transfer_submit_write(self, session, src, dst, length):
        batch_id = super().transfer_submit_write(session, src, dst, length)
        self.dst[batch_id] = dst
        return batch_id

    def transfer_check_status(self, batch_id):
        d = self.dst[batch_id]
        return 1 if any(lo <= d < hi for lo, hi in self.ranges) else -1


def test_pushes_that_re_register_a_victims_session_with_another_layout_do_not_refuse_it():
    """A token holder names D's session with a layout of its own (C re-registers
    it), and its writes fail: before, three of them refused D's session on every
    path, D's own pushes (with its real layout) included."""
    c, d, forged = KV(fill=True), KV(fill=False), KV(fill=False)
    eng = RangeEngine([(b, b + t.nbytes) for b, t in zip(d.bases, d.kv)])
    w = TerminalWriter(
        eng,
        ExtConfig(),
        sleep=lambda s: None,
        fence=RecordedFence(),
        peers=RefusedPeers(refuse_after=3),
    )
    server = source_server(w, c)
    for i in range(3):
        body = push_body(forged, dst_kv_base_addrs=forged.bases, request_id=f"x{i}")
        code, resp = server.push(body)
        assert code == 200 and resp["status"] == "failed", resp
    code, resp = server.push(push_body(d, request_id="real"))
    assert code == 200 and resp["status"] == "ok", resp
    assert server.write_stats()["refused_peers_now"] == 1  # the forged layout only
