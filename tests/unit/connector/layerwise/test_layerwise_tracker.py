"""connector/layerwise/prefill_tracker.py: chunked prefill, late/early decode metadata,
concurrent transfers, abort, exactly-once completion. Pure logic, no engine."""

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise import (
    prefill_tracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_tracker import (
    Destination,
    LayerwiseTracker,
    TransferState,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (
    ComputedStep,
)

BS = 4  # block size
SLOTS = 4  # two layers, K and V each
LAYERS = [[0, 1], [2, 3]]


def dest(n_blocks, first=100, session="d:1"):
    return Destination(
        session,
        [1000 * (s + 1) for s in range(SLOTS)],
        list(range(first, first + n_blocks)),
    )


def run_layers(tr):
    ops = []
    for slots in LAYERS:
        ops += tr.layer_computed(slots)
    return ops


def blocks_written(ops):
    """{slot: [(src, dst), ...]} in issue order."""
    out = {}
    for op in ops:
        out.setdefault(op.slot, []).extend(zip(op.src_blocks, op.dst_blocks))
    return out


def step(transfer_id, p_req_id, block_ids, computed_tokens, prompt_len):
    return ComputedStep(
        transfer_id, p_req_id, tuple(block_ids), computed_tokens, prompt_len
    )


def start(tr, ops):
    """The writer picks the ops up: all of them must be admitted."""
    admitted, dropped = tr.start_writes(ops)
    assert admitted == list(ops) and dropped == []
    return admitted


def finish_all(tr, ops):
    tr.writes_done(start(tr, ops), ok=True)


def test_chunked_prefill_ships_only_computed_blocks_partial_last_block_with_final_chunk():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("t", dest(3))  # D first: waits for the scheduler
    # prompt of 10 tokens = 3 blocks (last one partial); chunks of 6 and 4 tokens
    ops = tr.begin_step([step("t", "p", [7, 8], 6, 10)])
    assert ops == []
    ops1 = run_layers(tr)
    # after 6 tokens only block 0 is complete (block 1 holds tokens 4-5 of 4-7)
    assert blocks_written(ops1) == {s: [(7, 100)] for s in range(SLOTS)}
    finish_all(tr, ops1)
    tr.begin_step([step("t", "p", [7, 8, 9], 10, 10)])
    ops2 = run_layers(tr)
    assert blocks_written(ops2) == {s: [(8, 101), (9, 102)] for s in range(SLOTS)}
    assert tr.pop_finished() == []
    finish_all(tr, ops2)
    [t] = tr.pop_finished()
    assert t.state is TransferState.COMPLETED
    assert tr.pop_finished() == []  # exactly once


def test_layers_computed_before_decode_metadata_are_sent_when_it_arrives():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.begin_step([step("t", "p", [1, 2], 8, 8)])
    assert tr.layer_computed(LAYERS[0]) == []  # no destination yet
    late = tr.set_destination("t", dest(2))
    assert {op.slot for op in late} == {0, 1}  # layer 0 at once
    rest = tr.layer_computed(LAYERS[1])
    assert {op.slot for op in rest} == {2, 3}  # layer 1 as computed
    finish_all(tr, late + rest)
    assert [t.state for t in tr.pop_finished()] == [TransferState.COMPLETED]


def test_decode_prefix_hit_skips_blocks_decode_already_has():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.begin_step([step("t", "p", [1, 2, 3], 12, 12)])
    ops = tr.set_destination("t", dest(1, first=50)) + run_layers(tr)
    assert blocks_written(ops) == {s: [(3, 50)] for s in range(SLOTS)}
    finish_all(tr, ops)
    assert tr.pop_finished()[0].state is TransferState.COMPLETED


def test_concurrent_transfers_keep_separate_state():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("a", dest(2, first=10, session="d:1"))
    tr.set_destination("b", dest(1, first=20, session="d:2"))
    tr.begin_step([step("a", "pa", [1, 2], 5, 8), step("b", "pb", [5], 4, 4)])
    ops = run_layers(tr)
    by = {}
    for op in ops:
        by.setdefault(op.transfer_id, []).append(op)
    assert blocks_written(by["a"]) == {s: [(1, 10)] for s in range(SLOTS)}
    assert blocks_written(by["b"]) == {s: [(5, 20)] for s in range(SLOTS)}
    assert all(op.session == "d:2" for op in by["b"])
    finish_all(tr, by["b"])
    assert [t.transfer_id for t in tr.pop_finished()] == ["b"]
    # a transfer not scheduled in a step does not advance
    tr.begin_step([step("a", "pa", [1, 2], 8, 8)])
    more = run_layers(tr)
    assert blocks_written(more) == {s: [(2, 11)] for s in range(SLOTS)}
    finish_all(tr, by["a"] + more)
    assert [t.transfer_id for t in tr.pop_finished()] == ["a"]


def test_abort_mid_transfer_ends_once_and_stops_issuing():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("t", dest(2))
    tr.begin_step([step("t", "p", [1, 2], 4, 8)])
    ops = start(tr, run_layers(tr))
    tr.fail("t", "aborted")
    tr.writes_done(ops, ok=True)  # in-flight writes finishing later change nothing
    tr.fail("t", "aborted again")
    [t] = tr.pop_finished()
    assert t.state is TransferState.FAILED and t.error == "aborted"
    tr.begin_step([step("t", "p", [1, 2], 8, 8)])  # later chunks of the request
    assert run_layers(tr) == []
    assert tr.pop_finished() == []


def test_write_error_fails_the_transfer():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("t", dest(1))
    tr.begin_step([step("t", "p", [1], 4, 4)])
    ops = run_layers(tr)
    tr.writes_done(start(tr, ops[:1]), ok=False, error="engine returned -1")
    [t] = tr.pop_finished()
    assert t.state is TransferState.FAILED and "-1" in t.error


def test_short_prompt_posthoc_path_sends_everything_at_request_finish():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("t", dest(2))
    ops = tr.request_finished("t", "p", [4, 5], 6)
    assert blocks_written(ops) == {s: [(4, 100), (5, 101)] for s in range(SLOTS)}
    finish_all(tr, ops)
    [t] = tr.pop_finished()
    assert t.state is TransferState.COMPLETED and t.request_finished


def test_destination_inconsistent_with_the_prompt_fails_without_writing():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.begin_step([step("t", "p", [1], 4, 4)])
    assert tr.set_destination("t", dest(5)) == []
    assert tr.pop_finished()[0].state is TransferState.FAILED
    tr2 = LayerwiseTracker(SLOTS, BS)
    tr2.begin_step([step("t", "p", [1], 4, 4)])
    bad = Destination("d:1", [1, 2], [100])  # other model: 2 KV tensors instead of 4
    assert tr2.set_destination("t", bad) == []
    assert "same model" in tr2.pop_finished()[0].error


def test_preemption_restarts_progress_with_new_blocks():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("t", dest(2))
    tr.begin_step([step("t", "p", [1, 2], 4, 8)])
    first = start(tr, run_layers(tr))
    # P preempted the request and re-allocated other blocks: everything is resent
    tr.begin_step([step("t", "p", [9, 10], 8, 8)])
    again = run_layers(tr)
    assert blocks_written(again) == {s: [(9, 100), (10, 101)] for s in range(SLOTS)}
    tr.writes_done(first, ok=True)  # stale epoch: ignored
    assert tr.pop_finished() == []
    finish_all(tr, again)
    assert tr.pop_finished()[0].state is TransferState.COMPLETED


def test_abort_on_prefill_releases_blocks_and_answers_a_waiting_decode():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("t", dest(2))  # D waits; P aborted before scheduling it
    tr.release("t", "", 0, holds_blocks=False, reason="aborted")
    [t] = tr.pop_finished()
    assert (
        t.state is TransferState.FAILED and t.error == "aborted" and not t.holds_blocks
    )
    assert tr.num_unannounced() == 0
    tr2 = LayerwiseTracker(SLOTS, BS)
    tr2.begin_step([step("t", "p", [1, 2], 4, 8)])
    tr2.release("t", "p", 8)  # aborted mid-prefill, blocks held until released
    [t2] = tr2.pop_finished()
    assert t2.state is TransferState.FAILED and t2.request_finished


def test_a_given_up_destination_leaves_nothing_a_later_request_could_inherit():
    """D's destination for an id P never scheduled is given up (unknown timeout,
    or forged): the request P schedules later under that id is a transfer of its
    own, reported under its own P request id."""
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("x", dest(2))
    tr.fail("x", "never scheduled")  # only the scheduler creates transfers
    assert tr.get("x") is None and tr.num_unannounced() == 1
    assert tr.drop_pending("x") and not tr.drop_pending("x")
    assert tr.get("x") is None and tr.num_unannounced() == 0 and tr.pop_finished() == []
    tr.begin_step([step("x", "px", [1, 2], 8, 8)])
    run_layers(tr)  # no destination: nothing to write
    tr.request_finished("x", "px", [1, 2], 8)
    tr.fail("x", "expired: the decode instance never asked")
    [t] = tr.pop_finished()
    assert t.p_req_id == "px"
    assert [r.p_req_id for r in tr.pop_releasable()] == ["px"]


def test_an_aborted_request_whose_decode_already_asked_is_released_under_its_own_id():
    """A post-hoc request (never stepped) whose D asked during its prefill is
    aborted on P: the transfer P reports is the request's, never an anonymous one."""
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("t", dest(2))
    tr.fail("t", "aborted")
    tr.release("t", "p", 8, reason="aborted")
    [t] = tr.pop_finished()
    assert (t.p_req_id, t.error, t.holds_blocks) == ("p", "aborted", True)
    assert [r.p_req_id for r in tr.pop_releasable()] == ["p"]


def test_releasable_transfers_are_collected_without_scanning_every_transfer():
    """Only ended transfers whose request is done are handed out, each once,
    while thousands of others are in progress."""
    tr = LayerwiseTracker(SLOTS, BS)
    tr.begin_step([step(f"a{i}", f"pa{i}", [i], 4, 4) for i in range(3000)])
    tr.set_destination("done", dest(1))
    tr.begin_step([step("done", "pd", [7], 4, 4)])
    finish_all(tr, run_layers(tr))
    assert [t.transfer_id for t in tr.pop_finished()] == ["done"]
    assert tr.pop_releasable() == []  # P's request still runs
    tr.request_finished("done", "pd", [7], 4)
    assert [t.p_req_id for t in tr.pop_releasable()] == ["pd"]
    assert tr.pop_releasable() == []
    assert tr.inflight == 0


def test_two_live_requests_with_one_transfer_id_send_neither_and_both_are_freed():
    """A client gives two requests on P the same transfer_id. In one step their
    blocks would be written into D's blocks for that id, a mix of both: the id's
    transfer fails instead, naming both requests, the second is never sent, and
    each request's blocks are released when it ends."""
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("x", dest(2))
    ops = tr.begin_step([step("x", "pa", [1, 2], 8, 8), step("x", "pb", [5, 6], 8, 8)])
    ops += run_layers(tr)
    admitted, _ = tr.start_writes(ops)
    assert all(op.src_blocks[0] in (1, 2) for op in admitted), "pb's blocks sent"
    tr.writes_done(admitted, ok=True)
    [t] = tr.pop_finished()
    assert t.state is TransferState.FAILED and t.p_req_id == "pa"
    assert "transfer_id x (pa and pb)" in t.error and "neither is sent" in t.error
    assert tr.num_duplicates() == 1
    # later steps and the ends of both requests
    tr.begin_step([step("x", "pb", [5, 6], 8, 8)])
    assert run_layers(tr) == []
    assert tr.request_finished("x", "pb", [5, 6], 8) == []
    assert tr.pop_released_duplicates() == ["pb"] and tr.num_duplicates() == 0
    assert tr.request_finished("x", "pa", [1, 2], 8) == []
    assert [r.p_req_id for r in tr.pop_releasable()] == ["pa"]
    assert tr.pop_released_duplicates() == []


def test_a_duplicate_that_is_aborted_is_released_and_one_without_blocks_is_not():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.begin_step([step("x", "pa", [1], 4, 4), step("x", "pb", [5], 4, 4)])
    tr.begin_step([step("x", "pc", [7], 4, 4)])
    tr.release("x", "pb", 4, reason="aborted")
    tr.release("x", "pc", 4, holds_blocks=False, reason="aborted")
    assert tr.pop_released_duplicates() == ["pb"]
    assert tr.num_duplicates() == 0


def test_a_transfer_id_reused_after_its_transfer_was_forgotten_is_a_new_transfer():
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("x", dest(1))
    finish_all(tr, tr.request_finished("x", "pa", [1], 4))  # post-hoc: all at once
    [t] = tr.pop_finished()
    assert t.state is TransferState.COMPLETED
    assert [r.p_req_id for r in tr.pop_releasable()] == ["pa"]
    tr.forget("x")
    tr.begin_step([step("x", "pb", [5], 4, 4)])
    assert tr.num_duplicates() == 0 and tr.get("x").p_req_id == "pb"


def test_a_later_range_written_first_does_not_end_the_transfer_before_the_earlier():
    """Writes of one slot can reach the writer out of issue order (issued on
    different threads, queued after the lock is released). A later range written
    first must not make the transfer look complete: the earlier range, still
    queued, would then be dropped and D would read blocks nobody wrote."""
    tr = LayerwiseTracker(SLOTS, BS)
    tr.set_destination("t", dest(2))
    tr.begin_step([step("t", "p", [7], 4, 8)])
    first = run_layers(tr)  # block 0 of every slot
    tr.begin_step([step("t", "p", [7, 8], 8, 8)])
    second = run_layers(tr)  # block 1 of every slot: the last
    finish_all(tr, second)  # the later range lands first
    assert tr.pop_finished() == [], (
        "the transfer ended with block 0 of every slot not written yet"
    )
    finish_all(tr, first)
    [t] = tr.pop_finished()
    assert t.state is TransferState.COMPLETED


def test_a_received_request_is_not_unknown_until_its_transfer_is_announced():
    """P's scheduler received X's request: a destination for X is not unknown;
    the mark ends when a step (or the request's end) announces X."""
    tr = LayerwiseTracker(num_slots=2, block_size=4)
    assert tr.unknown("X")
    tr.received(["X"])
    tr.set_destination("X", Destination("d:1", [0, 0], [7, 8]))
    assert not tr.unknown("X") and tr.num_unannounced() == 1
    tr.begin_step([ComputedStep("X", "req-X", (1, 2), 8, 8)])
    assert "X" not in tr._received and tr.num_unannounced() == 0
    assert not tr.unknown("X")  # announced now


def test_received_marks_are_bounded_and_ids_already_known_are_not_marked(monkeypatch):
    monkeypatch.setattr(prefill_tracker, "MAX_RECEIVED", 3)
    tr = LayerwiseTracker(num_slots=2, block_size=4)
    tr.begin_step([ComputedStep("K", "req-K", (1, 2), 8, 8)])
    tr.received(["K", "a", "b", "c", "d"])
    assert list(tr._received) == ["b", "c", "d"]  # the oldest forgotten
    assert tr.unknown("a") and not tr.unknown("d")


def test_waiting_destinations_are_counted_by_whether_their_request_is_queued_on_p(
    monkeypatch,
):
    """A destination waiting for an unannounced transfer counts as waiting for a
    queued request while P's scheduler holds the request (received), else as
    waiting for an unknown id; it moves between the two as the mark comes and
    goes, and leaves both when the transfer is announced or it is given up."""
    monkeypatch.setattr(prefill_tracker, "MAX_RECEIVED", 2)
    tr = LayerwiseTracker(SLOTS, BS)
    tr.received(["Q"])
    tr.set_destination("Q", dest(2))
    tr.set_destination("U", dest(3))
    assert tr.queued("Q") and not tr.queued("U")
    assert tr.waiting(queued=True) == (1, 2) and tr.waiting(queued=False) == (1, 3)
    tr.received(["U"])  # P's scheduler received U after D's pull for it
    assert tr.waiting(queued=True) == (2, 5) and tr.waiting(queued=False) == (0, 0)
    tr.received(["R"])  # Q's mark is the oldest of three: forgotten
    assert tr.waiting(queued=True) == (1, 3) and tr.waiting(queued=False) == (1, 2)
    tr.begin_step([ComputedStep("U", "req-U", (1, 2, 3), 12, 12)])  # attached
    assert tr.waiting(queued=True) == (0, 0) and tr.get("U").destination is not None
    assert tr.drop_pending("Q")
    assert tr.waiting(queued=False) == (0, 0)
    assert (tr.num_unannounced(), tr.num_unannounced_block_ids()) == (0, 0)
