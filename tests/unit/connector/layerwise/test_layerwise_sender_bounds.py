"""Bounded state and work of layer-wise push, and ids only P's scheduler hands over.

P's sender (connector/layerwise/prefill_sender.py) serves D's requests on an
unauthenticated ZMQ socket and runs part of its work on the forward thread:
- a transfer id P never scheduled, once given up, leaves nothing that a
  request P schedules later under the same id could inherit, and only P
  request ids the scheduler handed over are ever reported in finished_sending
  (vLLM's scheduler asserts it knows each one: EngineCore would die);
- forged requests, however many, leave the sender at its baseline;
- the per-step calls do not touch every known transfer;
- writer threads retire when idle, so sessions seen once do not use up the cap.
D's PullOutcomes (pulls.py) prunes the pulls it remembers in O(1) amortized.
"""

from __future__ import annotations

import threading
import time

from helpers import (
    LW_D_BASES,
    LW_TENSOR,
    LayerwiseEngine,
    lw_dest,
    lw_finished,
    lw_step,
    make_layerwise_sender,
    poll_finished_sending,
    sender_idle,
    wait_until,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise import (
    decode_pulls,
    prefill_sender,
    prefill_tracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (
    LayerwiseMetadata,
)

WRITER_PREFIX = "vllm-mooncake-layerwise-"


def state_sizes(sender) -> dict[str, int]:
    """Everything the sender keeps per transfer id."""
    return {
        "transfers": len(sender.tracker.transfers),
        "pending": sender.tracker.num_unannounced(),
        "waiters": len(sender._waiters),
        "results": len(sender._results),
        "deadlines": len(sender._deadlines),
        "stats": len(sender.log),
    }


BASELINE = {
    "transfers": 0,
    "pending": 0,
    "waiters": 0,
    "results": 0,
    "deadlines": 0,
    "stats": 0,
}


# ---- ids P's scheduler never handed over ------------------------------------------


def test_an_unknown_id_that_timed_out_is_later_reported_under_the_real_request_id(loop):
    """D's request (or a forged one) names transfer X long before P schedules it
    and is answered with an error after the unknown timeout. When P then runs X
    and D never asks again, X expires the normal way and its blocks are freed
    under X's real P request id; the empty id never reaches vLLM's scheduler."""
    sender = make_layerwise_sender(timeout_s=0.5, unknown_s=0.2)
    err = loop.submit(sender.push("X", lw_dest())).result(5)
    assert err and "never scheduled" in err
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("X", "req-X")]))
    sender.layer_saved("l0", LW_TENSOR)
    sender.on_metadata(LayerwiseMetadata(finished=[lw_finished("X", "req-X")]))
    reported = poll_finished_sending(sender, {"req-X"})
    assert "" not in reported, "an empty request id reached finished_sending"
    assert reported == {"req-X"}
    assert wait_until(lambda: state_sizes(sender)["transfers"] == 0)
    sender.shutdown()


def test_a_pull_for_a_request_queued_on_p_waits_past_the_unknown_timeout(loop):
    """P's scheduler received X's request (queued behind others, not scheduled):
    D's pull for X waits for X's prefill however long that takes past the
    unknown timeout, and is served; a pull for an id P never received is still
    refused at the unknown timeout."""
    sender = make_layerwise_sender(timeout_s=30.0, unknown_s=0.2)
    sender.on_metadata(LayerwiseMetadata(received=["X"]))
    queued = loop.submit(sender.push("X", lw_dest("d:1", 100)))
    err = loop.submit(sender.push("Y", lw_dest("d:1", 200))).result(5)
    assert err and "never scheduled" in err
    time.sleep(0.6)  # three unknown timeouts
    assert not queued.done()
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("X", "req-X")]))
    sender.layer_saved("l0", LW_TENSOR)
    assert queued.result(5) is None
    assert sender.write_fn.writes == {"d:1": 1}
    sender.on_metadata(LayerwiseMetadata(finished=[lw_finished("X", "req-X")]))
    assert poll_finished_sending(sender, {"req-X"}) == {"req-X"}
    assert sender.tracker.num_unannounced() == 0
    sender.shutdown()


def test_a_pull_for_a_queued_request_p_never_computes_ends_at_the_transfer_timeout(
    loop,
):
    """X's request stays queued on P: D's pull for it waits past the unknown
    timeout but not past the transfer timeout, nothing was written, and nothing
    of X stays but its result."""
    sender = make_layerwise_sender(timeout_s=0.8, unknown_s=0.2)
    sender.on_metadata(LayerwiseMetadata(received=["X"]))
    started = time.monotonic()
    err = loop.submit(sender.push("X", lw_dest())).result(5)
    waited = time.monotonic() - started
    assert err and "timed out" in err and 0.7 < waited < 3, (err, waited)
    assert sender.write_fn.writes == {}
    assert sender.tracker.num_unannounced() == 0 and not sender._waiters
    sender.shutdown()


def test_pulls_for_requests_queued_on_p_are_capped_like_pulls_for_unknown_ids(
    loop, monkeypatch
):
    """Pulls for received (queued) ids wait up to the transfer timeout, so they
    have a bound of their own: beyond it a pull is refused at once, naming the
    bound, by their number or by the block ids they name; the ones within it
    are served once P computes them."""
    monkeypatch.setattr(prefill_sender, "MAX_WAITING_QUEUED", 3, raising=False)
    monkeypatch.setattr(
        prefill_sender, "MAX_WAITING_QUEUED_BLOCK_IDS", 7, raising=False
    )
    sender = make_layerwise_sender(timeout_s=30.0, unknown_s=0.2)
    ids = [f"Q{i}" for i in range(5)]
    sender.on_metadata(LayerwiseMetadata(received=ids))
    futs = [
        loop.submit(sender.push(t, lw_dest("d:1", 100 + 2 * i)))
        for i, t in enumerate(ids)
    ]
    time.sleep(0.5)  # past the unknown timeout
    done = [t for t, f in zip(ids, futs) if f.done()]
    assert done == ["Q3", "Q4"], f"pulls answered: {done} (expected the two past 3)"
    for f in futs[3:]:
        assert "already wait for requests queued" in f.result(), f.result()
        assert "at most 3 requests" in f.result()
    totals = sender.snapshot()["totals"]
    assert (totals["waiting_queued"], totals["waiting_unknown"]) == (3, 0), totals
    # by block ids: 3 x 2 waiting, a fourth pull naming 2 more would pass 7
    monkeypatch.setattr(prefill_sender, "MAX_WAITING_QUEUED", 10)
    sender.on_metadata(LayerwiseMetadata(received=["Q5"]))
    err = loop.submit(sender.push("Q5", lw_dest("d:1", 300))).result(5)
    assert err and "6 blocks already wait" in err, err
    for t in ids[:3]:
        sender.on_metadata(LayerwiseMetadata(steps=[lw_step(t, blocks=(1, 2))]))
        sender.layer_saved("l0", LW_TENSOR)
    assert [f.result(5) for f in futs[:3]] == [None, None, None]
    sender.shutdown()


def test_pulls_for_queued_requests_leave_the_unknown_ids_room_and_count_apart(
    loop, monkeypatch
):
    """Pulls waiting for queued requests are not pulls for unknown ids: they are
    reported as waiting_queued, and do not use up MAX_UNKNOWN, so a pull D sent
    before P's scheduler received its request still waits."""
    monkeypatch.setattr(prefill_sender, "MAX_UNKNOWN", 2)
    sender = make_layerwise_sender(timeout_s=30.0, unknown_s=5.0)
    sender.on_metadata(LayerwiseMetadata(received=["Q0", "Q1"]))
    queued = [loop.submit(sender.push(t, lw_dest("d:1", 100))) for t in ("Q0", "Q1")]
    assert wait_until(lambda: sender.tracker.num_unannounced() == 2)
    totals = sender.snapshot()["totals"]
    assert totals["waiting_unknown"] == 0, totals
    assert totals.get("waiting_queued") == 2, totals
    early = loop.submit(sender.push("U", lw_dest("d:2", 100)))
    time.sleep(0.2)
    assert not early.done(), f"a pull for an unknown id was refused: {early.result()}"
    assert sender.snapshot()["totals"]["waiting_unknown"] == 1
    sender.on_metadata(LayerwiseMetadata(received=["U"]))  # P receives it now
    totals = sender.snapshot()["totals"]
    assert (totals["waiting_unknown"], totals["waiting_queued"]) == (0, 3), totals
    sender.on_metadata(LayerwiseMetadata(aborted=["Q0", "Q1", "U"]))
    assert all("aborted" in f.result(5) for f in [*queued, early])
    totals = sender.snapshot()["totals"]
    assert (totals["waiting_unknown"], totals["waiting_queued"]) == (0, 0), totals
    sender.shutdown()


def test_a_pull_for_a_queued_request_aborted_on_p_is_answered_at_once(loop):
    """X's request was queued on P and aborted there before it was scheduled
    (no blocks): D's pull waiting for it is answered with the abort, and no
    trace of X stays."""
    sender = make_layerwise_sender(timeout_s=30.0, unknown_s=0.2)
    sender.on_metadata(LayerwiseMetadata(received=["X"]))
    fut = loop.submit(sender.push("X", lw_dest()))
    time.sleep(0.4)
    assert not fut.done()
    sender.on_metadata(LayerwiseMetadata(aborted=["X"]))
    assert "aborted" in fut.result(5)
    assert poll_finished_sending(sender, set(), timeout=0.3) == set()
    assert "X" not in sender.tracker._received
    sender.shutdown()


def test_a_request_whose_decode_was_told_never_scheduled_frees_its_blocks_early(loop):
    """D asked for X before P scheduled it and was answered "never scheduled"
    (D gave up and prefills locally). When P later runs X and nobody asks again,
    its blocks are freed after the unknown timeout, not the transfer timeout."""
    sender = make_layerwise_sender(timeout_s=30.0, unknown_s=0.3)
    err = loop.submit(sender.push("X", lw_dest())).result(5)
    assert err and "never scheduled" in err
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("X", "req-X")]))
    sender.layer_saved("l0", LW_TENSOR)
    sender.on_metadata(LayerwiseMetadata(finished=[lw_finished("X", "req-X")]))
    assert poll_finished_sending(sender, {"req-X"}, timeout=3) == {"req-X"}
    assert "never scheduled" in sender._results["X"][1]
    # an id nobody was refused keeps the whole transfer timeout
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("Y", "req-Y")]))
    sender.layer_saved("l0", LW_TENSOR)
    sender.on_metadata(LayerwiseMetadata(finished=[lw_finished("Y", "req-Y")]))
    assert poll_finished_sending(sender, {"req-Y"}, timeout=1) == set()
    sender.shutdown()


def test_refused_ids_are_remembered_up_to_a_bound(loop, monkeypatch):
    monkeypatch.setattr(prefill_sender, "MAX_REFUSED_IDS", 3)
    sender = make_layerwise_sender(unknown_s=0.05)
    for i in range(5):
        assert "never scheduled" in loop.submit(sender.push(f"X{i}", lw_dest())).result(
            5
        )
    assert list(sender._refused_ids) == ["X2", "X3", "X4"]
    sender.shutdown()


def test_a_refused_id_does_not_stop_the_real_decode_from_pulling_it_later(loop):
    sender = make_layerwise_sender(unknown_s=0.2)
    assert "never scheduled" in loop.submit(
        sender.push("X", lw_dest("forged:1", 500))
    ).result(5)
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("X", "req-X")]))
    real = loop.submit(sender.push("X", lw_dest("d:1", 100)))  # the real D asks now
    sender.layer_saved("l0", LW_TENSOR)
    assert real.result(5) is None
    assert sender.write_fn.writes == {"d:1": 1}
    sender.on_metadata(LayerwiseMetadata(finished=[lw_finished("X", "req-X")]))
    assert poll_finished_sending(sender, {"req-X"}) == {"req-X"}
    sender.shutdown()


def test_an_aborted_request_whose_decode_asked_early_is_released_under_its_id(loop):
    """A post-hoc request (never stepped) is aborted on P while D's request for
    it waits: D hears of the abort, and P frees the blocks under the request's
    own id."""
    sender = make_layerwise_sender()
    fut = loop.submit(sender.push("X", lw_dest()))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    sender.on_metadata(
        LayerwiseMetadata(finished=[lw_finished("X", "req-X", aborted=True)])
    )
    assert "aborted" in fut.result(5)
    reported = poll_finished_sending(sender, {"req-X"}, timeout=1)
    assert reported == {"req-X"}, reported
    sender.shutdown()


def test_poll_reports_only_requests_the_scheduler_handed_over():
    sender = make_layerwise_sender()
    sender.on_metadata(
        LayerwiseMetadata(finished=[lw_finished("A", "req-A", aborted=True)])
    )
    with sender._lock:  # an id nobody handed over, by whatever way
        sender._finished_sending |= {"", "req-stray"}
    assert sender.poll() == {"req-A"}
    assert sender.poll() == set()
    sender.shutdown()


def forged(prefix, n):
    """One of D's requests as a forger sends it: n transfer ids P never scheduled."""
    return {f"{prefix}-r{i}": (f"{prefix}-t{i}", [1, 2]) for i in range(n)}


class Replies:
    def __init__(self):
        self.answers: list[tuple[list[str], dict[str, str], bool]] = []

    async def __call__(self, ok, errs, last):
        self.answers.append((ok, errs, last))

    def answered(self) -> list[str]:
        return [d for ok, errs, _ in self.answers for d in [*ok, *errs]]


def test_ten_thousand_forged_transfer_ids_leave_the_sender_at_baseline(loop):
    """Ten thousand transfer ids P never scheduled, in ten requests (forged on
    P's unauthenticated socket): each is answered with an error, and once they
    are answered the sender holds nothing of them."""
    sender = make_layerwise_sender(unknown_s=0.3)
    replies = Replies()
    futs = [
        loop.submit(
            sender.serve("forged:1", LW_D_BASES, forged(f"m{k}", 1000), replies)
        )
        for k in range(10)
    ]
    for f in futs:
        f.result(10)
    answered = replies.answered()
    assert len(answered) == len(set(answered)) == 10_000
    assert all(not ok for ok, _, _ in replies.answers)
    assert sum(last for _, _, last in replies.answers) == 10  # one FINISH per request
    assert state_sizes(sender) == BASELINE
    sender.shutdown()


def test_one_request_holds_at_most_max_transfers_per_request_waiters(loop, monkeypatch):
    """The transfers of one request beyond MAX_TRANSFERS_PER_REQUEST are refused
    in its first reply, before anything is created for them."""
    monkeypatch.setattr(prefill_sender, "MAX_TRANSFERS_PER_REQUEST", 100, raising=False)
    sender = make_layerwise_sender(unknown_s=0.3)
    replies = Replies()
    fut = loop.submit(
        sender.serve("forged:1", LW_D_BASES, forged("big", 5000), replies)
    )
    assert wait_until(lambda: len(replies.answers) >= 1)
    first_ok, first_errs, last = replies.answers[0]
    assert (first_ok, len(first_errs), last) == ([], 4900, False)
    assert "at most 100 per request" in next(iter(first_errs.values()))
    assert sender.tracker.num_unannounced() <= 100 and len(sender._waiters) <= 100
    fut.result(10)
    assert sorted(replies.answered()) == sorted(forged("big", 5000))
    assert state_sizes(sender) == BASELINE
    sender.shutdown()


def test_waiting_pulls_are_bounded_by_the_block_ids_they_name(loop, monkeypatch):
    """Waiting pulls cost memory by the block ids they name, not by their number:
    a few pulls naming many blocks each are refused once the ids waiting in all
    would pass MAX_UNKNOWN_BLOCK_IDS."""
    monkeypatch.setattr(prefill_sender, "MAX_UNKNOWN_BLOCK_IDS", 10_000)
    sender = make_layerwise_sender(unknown_s=5.0)
    replies = Replies()
    big = {f"b-r{i}": (f"b-t{i}", list(range(3_000))) for i in range(5)}
    fut = loop.submit(sender.serve("forged:1", LW_D_BASES, big, replies))

    def errs():
        return {d: e for _, es, _ in list(replies.answers) for d, e in es.items()}

    assert wait_until(lambda: len(errs()) >= 2, 3)  # before the waiting ones time out
    assert len(errs()) == 2
    assert all("blocks already wait" in e for e in errs().values()), errs()
    assert sender.tracker.num_unannounced_block_ids() == 9_000
    fut.result(10)
    assert state_sizes(sender) == BASELINE
    sender.shutdown()


def test_a_pull_naming_more_blocks_than_max_model_len_allows_is_refused(loop):
    sender = make_layerwise_sender(unknown_s=0.3)
    sender.max_blocks_per_request = 64
    replies = Replies()
    pulls = {"ok-r": ("ok-t", list(range(64))), "long-r": ("long-t", list(range(65)))}
    loop.submit(sender.serve("d:1", LW_D_BASES, pulls, replies)).result(10)
    first_ok, first_errs, _ = replies.answers[0]
    assert list(first_errs) == ["long-r"] and "at most 64" in first_errs["long-r"]
    assert sorted(replies.answered()) == ["long-r", "ok-r"]
    sender.shutdown()


# ---- no scan over every transfer on the forward thread -------------------------------


class _Touches:
    n = 0


class CountingTransfer(prefill_tracker.Transfer):
    """A Transfer that counts every attribute read (how many transfers a call touches)."""

    def __getattribute__(self, name):
        _Touches.n += 1
        return super().__getattribute__(name)


def test_per_step_calls_touch_only_the_transfers_they_concern():
    """30,000 transfers in progress (10,000 of them finished on P, waiting for D):
    a step with no layer-wise work and poll() touch none of them; a transfer
    that ends is collected without scanning the rest."""
    sender = make_layerwise_sender()
    n = 30_000
    sender.on_metadata(
        LayerwiseMetadata(
            steps=[lw_step(f"t{i}", blocks=(i,), tokens=4) for i in range(n)]
        )
    )
    sender.on_metadata(
        LayerwiseMetadata(
            finished=[
                lw_finished(f"t{i}", blocks=(i,), tokens=4) for i in range(10_000)
            ]
        )
    )
    assert sender.poll() == set()
    for t in sender.tracker.transfers.values():
        t.__class__ = CountingTransfer
    _Touches.n = 0
    rounds = 20
    for _ in range(rounds):
        sender.on_metadata(LayerwiseMetadata())
        sender.layer_saved("l0", LW_TENSOR)
        assert sender.poll() == set()
    idle_touches = _Touches.n
    # one request P finished (its transfer expires without D) is collected alone
    sender.on_metadata(
        LayerwiseMetadata(
            finished=[lw_finished(f"t{n - 1}", blocks=(n - 1,), tokens=4, aborted=True)]
        )
    )
    assert sender.poll() == {f"pt{n - 1}"}
    touches_one_end = _Touches.n - idle_touches
    assert idle_touches <= 10 * rounds, (
        f"{rounds} idle steps touched {idle_touches} transfers ({n} known)"
    )
    assert touches_one_end <= 200, (
        f"ending one transfer touched {touches_one_end} transfers"
    )
    assert len(sender.tracker.transfers) == n - 1
    sender.shutdown()


# ---- writers: one per decode session with work ---------------------------------------


def writer_threads() -> int:
    return sum(t.name.startswith(WRITER_PREFIX) for t in threading.enumerate())


def one_transfer(sender, loop, tid, session):
    fut = loop.submit(sender.push(tid, lw_dest(session)))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1 or fut.done())
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step(tid)]))
    sender.layer_saved("l0", LW_TENSOR)
    err = fut.result(5)
    sender.on_metadata(LayerwiseMetadata(finished=[lw_finished(tid)]))
    sender.poll()
    return err


def test_a_hundred_decode_sessions_one_after_another_all_succeed(loop):
    """Each restart of D has a new transfer-engine session: P must not count
    every session it ever served against MAX_PEERS."""
    sender = make_layerwise_sender()
    errors = [
        one_transfer(sender, loop, f"t{i}", f"d{i}:{9000 + i}") for i in range(100)
    ]
    failed = {i: e for i, e in enumerate(errors) if e is not None}
    assert not failed, (
        f"{len(failed)} of 100 transfers failed, first: {next(iter(failed.items()))}"
    )
    assert sender.snapshot()["writers"] <= sender.writers.max_peers
    sender.shutdown()


def test_a_transfer_to_a_refused_decode_session_fails_with_why_and_writes_nothing(
    loop,
):
    """A decode session whose writes keep failing is refused by the write function
    (peer_refusal.py): its transfer ends at once with that reason, which D is
    answered, and nothing is written; other sessions are served."""

    class RefusingEngine(LayerwiseEngine):
        def refusal(self, session, layout=None):
            if session == "d:bad":
                return "writes to d:bad are refused for another 30 s: ..."
            return None

    engine = RefusingEngine()
    sender = make_layerwise_sender(engine)
    err = one_transfer(sender, loop, "t1", "d:bad")
    assert err is not None and "d:bad are refused" in err, err
    assert engine.writes.get("d:bad", 0) == 0
    assert one_transfer(sender, loop, "t2", "d:good") is None
    assert engine.writes["d:good"] == 1
    sender.shutdown()


def test_two_live_requests_with_one_transfer_id_both_free_their_blocks(loop):
    """A client gave two requests on P one transfer_id: D's pull for it is
    answered with an error naming both, and P reports both requests in
    finished_sending (before, the second one's blocks were never freed)."""
    engine = LayerwiseEngine()
    sender = make_layerwise_sender(engine)
    fut = loop.submit(sender.push("x", lw_dest("d:1")))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    sender.on_metadata(
        LayerwiseMetadata(
            steps=[lw_step("x", "pa", (1, 2)), lw_step("x", "pb", (3, 4))],
        )
    )
    sender.layer_saved("l0", LW_TENSOR)
    err = fut.result(5)
    assert err is not None and "(pa and pb)" in err, err
    sender.on_metadata(
        LayerwiseMetadata(
            finished=[lw_finished("x", "pa", (1, 2)), lw_finished("x", "pb", (3, 4))]
        )
    )
    assert poll_finished_sending(sender, {"pa", "pb"}) == {"pa", "pb"}
    assert sender.snapshot()["duplicate_transfer_ids"] == 0
    sender.shutdown()


def test_idle_writers_retire_and_a_session_with_work_keeps_its_writer(
    loop, monkeypatch
):
    before = writer_threads()
    engine = LayerwiseEngine()
    sender = make_layerwise_sender(engine)
    sender.writer_idle_s = 0.1
    for i in range(5):
        assert one_transfer(sender, loop, f"t{i}", f"d{i}:1") is None
    assert wait_until(lambda: writer_threads() == before), (
        f"{writer_threads() - before} writer threads still alive after being idle"
    )
    assert sender.snapshot()["writers"] == 0
    # a writer busy in the engine is not retired, however long its write takes
    gate = engine.gate("slow:1")
    fut = loop.submit(sender.push("S", lw_dest("slow:1")))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("S")]))
    sender.layer_saved("l0", LW_TENSOR)
    assert engine.entered["slow:1"].wait(5)
    time.sleep(0.5)
    assert sender.snapshot()["writers"] == 1
    # at the cap, a new session is refused while every writer has work ...
    monkeypatch.setattr(sender.writers, "max_peers", 1)
    assert "decode peers" in one_transfer(sender, loop, "N1", "new:1")
    gate.set()
    assert fut.result(5) is None
    # ... and served as soon as one has none
    sender.writer_idle_s = 30.0
    assert wait_until(lambda: sender_idle(sender))
    assert one_transfer(sender, loop, "N2", "new:2") is None
    sender.shutdown()


# ---- D: each pull's end remembered, pruned in O(1) amortized -------------------------


class CountedId(str):
    """A request id that counts how often it is hashed (dict work per id)."""

    hashes = 0

    def __hash__(self):
        CountedId.hashes += 1
        return str.__hash__(self)


def test_remembering_ended_pulls_costs_constant_work_per_pull(monkeypatch):
    """Past 4096 remembered pulls, ending one more must not rebuild the table."""
    outcomes = decode_pulls.PullOutcomes()
    n = 4096 + 300
    ids = [CountedId(f"req-{i}") for i in range(n)]
    CountedId.hashes = 0
    for i, rid in enumerate(ids):
        if i % 2:
            assert outcomes.completed(rid, [1])
        else:
            outcomes.failed(rid, [i], "test")
    per_pull = CountedId.hashes / n
    assert per_pull <= 10, f"{per_pull:.0f} dict operations per pull ({n} pulls)"
    assert not outcomes.completed(ids[-1], [1])  # still remembered: reported once


def test_ended_pulls_are_forgotten_after_an_hour():
    now = [1000.0]
    outcomes = decode_pulls.PullOutcomes(clock=lambda: now[0])
    for i in range(5000):
        assert outcomes.completed(f"old-{i}", [1])
    now[0] += decode_pulls.ENDED_KEPT_S + 1
    for i in range(5000):
        assert outcomes.completed(f"new-{i}", [1])
    assert len(outcomes._ended) <= 5000 + 1
    assert not outcomes.completed("new-4999", [1])
