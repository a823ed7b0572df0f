"""connector/push/decode_scheduler.py and push/receiver.py: D's side of a prefix push.
Pure logic (C's /match_blocks and /push_blocks answers are stubbed); the real
path runs in tests/integration/test_push.py."""

import json
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import C_SOURCE, Blocks, d_request

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.peer_client import (
    Answer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_cost import (
    SourceLoad,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    SOURCE_REFUSAL,
    KVFingerprint,
    PushJob,
    PushOutcome,
)

BS = 16
SRC = "http://c:9000"
# what D's scheduler knows of its KV cache, and C's (worker side: also bytes per block)
FP = KVFingerprint(
    model="Arch:0123456789abcdef", dtype="bfloat16/auto", block_size=BS, tp_size=1
)
C_FP = FP.model_copy(update={"block_len": 64, "num_kv_tensors": 2})
SCHED_CONFIG = ExtConfig(push_min_tokens=0, push_match_timeout_s=1, push_sources=(SRC,))


def scheduler():
    return PushScheduler(BS, SCHED_CONFIG, FP)


def req(rid="r1", n_tokens=5 * BS + 3, params=None, salt=None):
    return d_request(rid, n_tokens, SRC + "/", params=params, salt=salt)


def http_answer(code, body, headers=None):
    """What D's client returns (client.py): the status, the raw JSON body and the
    headers (C's refusals carry SOURCE_REFUSAL)."""
    return Answer(code, json.dumps(body).encode(), dict(headers or {}))


def matched(sched, r, local_tokens=0, answer=4, load=None):
    """C's /match_blocks answers `answer` held blocks (or raises it), and its
    `load` (MatchBlocksResponse's load fields) if given."""

    def post(source, path, content, headers, deadline):
        assert source + path == SRC + "/match_blocks"
        assert json.loads(content) == {
            "token_ids": r.prompt_token_ids,
            "cache_salt": r.cache_salt,
            "lora_name": None,
        }
        if isinstance(answer, Exception):
            raise answer
        full = len(r.prompt_token_ids) // BS
        return http_answer(
            200,
            {
                "matched_blocks": answer,
                "matched_tokens": answer * BS,
                "total_full_blocks": full,
                "fingerprint": C_FP.model_dump(),
                "engine_timeout_s": 30,
                "source_id": C_SOURCE,
                "now_unix_ms": int(time.time() * 1000),
                **(load or {}),
            },
        )

    sched._lanes.post = post
    first = sched.get_num_new_matched_tokens(r, local_tokens)
    if first != (None, False):  # answered within the step's inline wait
        return first
    deadline = time.monotonic() + 5
    while not sched._matches[r.request_id].done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return sched.get_num_new_matched_tokens(r, local_tokens)


def test_only_requests_naming_a_source_are_handled():
    s = scheduler()
    assert s.handles(req())
    assert not s.handles(req(params={}))
    assert not s.handles(req(params={"push_from": SRC, "do_remote_prefill": True}))


def test_held_blocks_become_async_external_tokens():
    s = scheduler()
    r = req()
    assert matched(s, r) == (4 * BS, True)
    s.update_state_after_alloc(r, Blocks([30, 31, 32, 33, 34]), 4 * BS)
    (job,) = s.take_jobs()
    assert (
        job.source == SRC
        and job.source_id == C_SOURCE  # the match answer's, sent back in the push
        and job.first_block == 0
        and job.dst_block_ids == (30, 31, 32, 33)
    )
    assert s.take_jobs() == []


def test_local_prefix_hit_is_not_pushed_again():
    s = scheduler()
    r = req()
    assert matched(s, r, local_tokens=2 * BS) == (2 * BS, True)
    s.update_state_after_alloc(r, Blocks([7, 8, 30, 31]), 2 * BS)
    (job,) = s.take_jobs()
    assert job.first_block == 2 and job.dst_block_ids == (30, 31)


def test_nothing_beyond_the_local_hit_means_no_push():
    s = scheduler()
    assert matched(s, req(), local_tokens=4 * BS) == (0, False)


def test_unreachable_source_falls_back_to_local_prefill():
    s = scheduler()
    assert matched(s, req(), answer=ConnectionError("refused")) == (0, False)
    assert s.stats["match_failed"] == 1


def test_blocks_that_did_not_land_are_prefilled_locally():
    s = scheduler()
    r = req()
    matched(s, r, local_tokens=BS, answer=5)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 4 * BS)
    s.take_jobs()
    r.num_computed_tokens = 5 * BS  # as vLLM sets it for an async load
    r.num_external_computed_tokens = 4 * BS
    assert s.request_finished(r) is True  # C may still be writing: keep the blocks
    s.on_worker_meta(PushOutcome({"r1": 1}))
    assert r.num_computed_tokens == 2 * BS and r.num_external_computed_tokens == BS
    # vLLM asks again when nothing landed: never a second push (found looping)
    assert s.get_num_new_matched_tokens(r, BS) == (0, False)
    assert s.take_jobs() == []
    assert s.request_finished(r) is False
    assert s.stats == {
        "requests": 1,
        "pushed_blocks": 1,
        "fallback_blocks": 3,
        "match_failed": 0,
        "slow_matches": 0,
        "refused_sources": 0,
        "refused_clock_skew": 0,
        "auto_asked": 0,
        "auto_no_holder": 0,
        "auto_picked": 0,
        "auto_missed": 0,
        "failed_pushes": 0,
        "late_pushes": 0,
        "released_pushes": 0,
        "coalesced": 0,
        "source_full": 0,
        "held_for_landing": 0,
    }


def test_full_landing_changes_nothing():
    s = scheduler()
    r = req()
    matched(s, r)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 4 * BS)
    r.num_computed_tokens, r.num_external_computed_tokens = 4 * BS, 4 * BS
    s.on_worker_meta(PushOutcome({"r1": 4}))
    assert (r.num_computed_tokens, r.num_external_computed_tokens) == (4 * BS, 4 * BS)
    s.on_worker_meta(None)  # other connectors' steps carry no outcome


def test_outcomes_of_several_workers_keep_the_minimum():
    agg = PushOutcome({"a": 3, "b": 2}).aggregate(PushOutcome({"a": 1}))
    assert agg.landed == {"a": 1, "b": 2}
    assert (agg.workers_of("a"), agg.workers_of("b")) == (2, 1)
    three = agg.aggregate(PushOutcome({"a": 2, "c": 0}))
    assert three.landed == {"a": 1, "b": 2, "c": 0}
    assert [three.workers_of(r) for r in "abc"] == [3, 1, 1]


def two_worker_push(rid="r1"):
    """A push of 4 blocks on a D of two workers (TP 2), its job taken."""
    s = PushScheduler(BS, SCHED_CONFIG, FP, workers=2)
    r = req(rid)
    matched(s, r)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 4 * BS)
    s.take_jobs()
    r.num_computed_tokens, r.num_external_computed_tokens = 4 * BS, 4 * BS
    return s, r


def test_a_push_ends_only_when_every_worker_ended_its_write():
    s, r = two_worker_push()
    # rank 0 landed all its shard in one step; rank 1's write may still land
    s.on_worker_meta(PushOutcome({"r1": 4}))
    assert s.request_finished(r) is True  # its blocks are kept
    assert s.decisions["pushed"] == 0 and s.stats["pushed_blocks"] == 0
    # rank 1 ends in a later step with 2 of its 4: the whole push has 2
    s.on_worker_meta(PushOutcome({"r1": 2}))
    assert (r.num_computed_tokens, r.num_external_computed_tokens) == (2 * BS, 2 * BS)
    assert s.stats["pushed_blocks"] == 2 and s.stats["fallback_blocks"] == 2
    assert s.request_finished(r) is False


def test_one_step_holding_both_workers_ends_the_push():
    s, r = two_worker_push()
    s.on_worker_meta(PushOutcome({"r1": 4}).aggregate(PushOutcome({"r1": 4})))
    assert s.decisions["pushed"] == 1 and s.stats["pushed_blocks"] == 4


def test_a_refusal_on_one_worker_refuses_the_push():
    s, r = two_worker_push()
    s.on_worker_meta(PushOutcome({"r1": 0}, frozenset({"r1"})))
    s.on_worker_meta(PushOutcome({"r1": 4}))
    assert s.decisions["refused"] == 1 and s.stats["failed_pushes"] == 0
    assert r.num_computed_tokens == 0


class Clock:
    """An injected monotonic clock: time passes only when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


WALL = 1_700_000_000.0  # D's wall clock (s), fixed
CONFIG = ExtConfig(push_timeout_s=1.0)


@pytest.mark.parametrize(
    "answer,landed",
    [
        ((200, {"status": "ok", "pushed_blocks": 3, "bytes": 3 * 64 * 2}), 3),
        ((200, {"status": "failed", "pushed_blocks": 0, "message": "x"}), 0),
        ((422, {"detail": {"field": "block_len"}}, SOURCE_REFUSAL), 0),
        (TimeoutError("slow"), 0),
        ((502, {"detail": "bad gateway"}), 0),  # a proxy's: C may still write
    ],
)
def test_receiver_reports_every_push_once_with_what_landed(monkeypatch, answer, landed):
    posted = threading.Event()

    def post(source, path, content, headers, deadline):
        body = json.loads(content)
        assert source + path == SRC + "/push_blocks" and body["dst_session"] == "d:1"
        assert body["first_block"] == 1 and body["dst_block_ids"] == [5, 6, 7]
        assert body["deadline_unix_ms"] == int((WALL + CONFIG.push_timeout_s) * 1000)
        assert body["dst_num_blocks"] == 16 and body["fingerprint"] == C_FP.model_dump()
        assert body["source_id"] == C_SOURCE  # the job's (its match answer's)
        posted.set()
        if isinstance(answer, Exception):
            raise answer
        return http_answer(*answer)

    clock = Clock()
    rec = PushReceiver(
        "d:1",
        [100, 200],
        64,
        BS,
        16,
        C_FP,
        CONFIG,
        clock=clock,
        wall_clock=lambda: WALL,
    )
    monkeypatch.setattr(rec._lanes, "post", post)
    job = PushJob(
        "r1", SRC, tuple(range(80)), None, None, 1, (5, 6, 7), source_id=C_SOURCE
    )
    rec.start([job])
    assert posted.wait(5)
    if isinstance(answer, Exception) or (answer[0] != 200 and len(answer) < 3):
        # No answer from C's own code: it may still write until the hold has
        # passed; the push must not end before that, however long the test waits.
        time.sleep(0.2)
        clock.now += rec.hold_s(job) - 0.5
        assert rec.merge_finished({"other"}) == {"other"}
        # past its budget with no answer: told once, so the request can take
        # other blocks (decode_scheduler.py); the push has not ended
        assert rec.take_outcome() == PushOutcome(due=frozenset({"r1"}))
        assert rec.merge_finished(None) is None and rec.take_outcome() is None
        clock.now += 1.0  # the hold has passed
    deadline = time.monotonic() + 5
    finished = None
    while time.monotonic() < deadline and not finished:
        finished = rec.merge_finished({"other"})
        finished = finished if finished != {"other"} else None
        time.sleep(0.01)
    assert finished == {"other", "r1"}
    assert rec.take_outcome().landed == {"r1": landed}
    assert rec.take_outcome() is None and rec.merge_finished(None) is None


def test_a_push_whose_request_finished_keeps_no_state_once_it_ended():
    """An aborted request's push ends later (its outcome): nothing of it may stay
    in the scheduler, or every aborted push would be kept for ever."""
    s = scheduler()
    r = req()
    matched(s, r)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 4 * BS)
    s.take_jobs()
    assert s.request_finished(r) is True  # C may still be writing: keep the blocks
    s.on_worker_meta(PushOutcome({"r1": 0}))
    s.take_jobs()  # the next step
    assert (s._ended, s._inflight, s._matches, s._times, s._planned) == (
        set(),
        {},
        {},
        {},
        {},
    )


def test_a_request_finished_before_its_job_reached_the_worker_frees_its_blocks_at_once():
    s = scheduler()
    r = req()
    matched(s, r)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 4 * BS)
    assert s.request_finished(r) is False  # C was never asked: nothing can land
    assert s.take_jobs() == [], "the worker would post a push for a finished request"
    assert s._inflight == {} and s._ended == set()


class Manager:
    """The scheduler's KV cache manager as a released push uses it: freeing a
    request drops its reference to each of its blocks; the pool takes back
    blocks whose last reference is dropped."""

    def __init__(self, blocks, free=100):
        self.blocks = blocks  # the request's, as vLLM holds them
        self.freed_requests = []
        self.block_pool = self
        self.free_queue = []
        self.spare = free  # blocks free in the pool besides

    def get_num_free_blocks(self):
        return self.spare + len(self.free_queue)

    def free(self, request):
        self.freed_requests.append(request.request_id)
        self.free_blocks(self.blocks.blocks[0])

    def free_blocks(self, blocks):
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b.block_id)


class Output:
    """vLLM's KVConnectorOutput, as the scheduler's connector sees it."""

    def __init__(self, meta=None, finished_recving=None):
        self.kv_connector_worker_meta = meta
        self.finished_recving = finished_recving


def released_push(bind=True, free=100, workers=1):
    """r1 (a local hit of 1 block, 4 pushed into 31-34) waits for its push; the
    worker says the push is past its budget with no answer."""
    from vllm.v1.request import RequestStatus

    s = PushScheduler(BS, SCHED_CONFIG, FP, workers=workers)
    r = req(n_tokens=5 * BS + 3)
    matched(s, r, local_tokens=BS, answer=5)
    blocks = Blocks([30, 31, 32, 33, 34, 35])
    manager = Manager(blocks, free)
    if bind:
        s.bind_kv_cache_manager(manager)
    s.update_state_after_alloc(r, blocks, 4 * BS)
    s.take_jobs()
    r.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    r.num_computed_tokens, r.num_external_computed_tokens = 5 * BS, 4 * BS
    out = Output(PushOutcome(due=frozenset({"r1"})))
    s.on_connector_output(out)
    return s, r, blocks, manager, out


def test_a_push_past_its_budget_releases_its_request_into_other_blocks():
    """Before, the request waited for the push's whole hold (about 245-275 s
    with a source that never answers), then was prefilled in the same blocks."""
    s, r, blocks, manager, out = released_push()
    # back to waiting at once, with nothing computed: vLLM allocates anew
    assert out.finished_recving == {"r1"}
    assert manager.freed_requests == ["r1"]
    assert (r.num_computed_tokens, r.num_external_computed_tokens) == (0, 0)
    # the blocks the source may write into are not given to anyone
    assert [b.ref_cnt for b in blocks.blocks[0]] == [0, 1, 1, 1, 1, 0]
    assert manager.free_queue == [30, 35]
    # vLLM asks again: no second push
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.stats["released_pushes"] == 1 and s.stats["fallback_blocks"] == 4


def test_a_released_request_that_finished_is_kept_by_vllm_until_the_push_ended():
    s, r, blocks, manager, _ = released_push()
    # vLLM keeps the finished request (and so keeps stepping) until the push
    # ended; its own blocks are vLLM's to free (0.32.0 frees them only once the
    # step that last wrote them completed)
    assert s.request_finished(r) is True
    assert manager.freed_requests == ["r1"]
    end = Output(PushOutcome({"r1": 0}), {"r1"})
    s.on_connector_output(end)
    assert end.finished_recving == {"r1"}  # vLLM lets it go now
    assert manager.free_queue == [30, 35, 31, 32, 33, 34]


def test_a_push_past_its_budget_is_released_only_once_its_prompt_fits():
    """Released with too few free blocks for its prompt, the request would wait
    at the head of vLLM's queue and hold back every request behind it."""
    s, r, blocks, manager, out = released_push(free=5)  # 6 blocks needed
    assert out.finished_recving is None and manager.freed_requests == []
    manager.spare = 6
    later = Output(None, None)  # any later output
    s.on_connector_output(later)
    assert later.finished_recving == {"r1"} and manager.freed_requests == ["r1"]


def test_a_released_push_gives_its_blocks_back_only_when_it_ended():
    s, r, blocks, manager, _ = released_push()
    s.on_connector_output(Output(None, None))
    assert manager.free_queue == [30, 35]
    r.num_computed_tokens = 2 * BS  # the local prefill goes on meanwhile
    end = Output(PushOutcome({"r1": 4}), {"r1", "other"})
    s.on_connector_output(end)
    # the request no longer waits for it: vLLM is not told (it would look for
    # the request among those waiting, or free its new blocks)
    assert end.finished_recving == {"other"}
    assert manager.free_queue == [30, 35, 31, 32, 33, 34]
    assert r.num_computed_tokens == 2 * BS


def test_without_the_cache_manager_a_push_past_its_budget_keeps_waiting():
    s, r, blocks, manager, out = released_push(bind=False)
    assert out.finished_recving is None and manager.freed_requests == []
    assert r.num_computed_tokens == 5 * BS


def test_a_finished_request_is_not_released():
    from vllm.v1.request import RequestStatus

    s = scheduler()
    r = req()
    matched(s, r)
    blocks = Blocks([1, 2, 3, 4, 5])
    manager = Manager(blocks)
    s.bind_kv_cache_manager(manager)
    s.update_state_after_alloc(r, blocks, 4 * BS)
    s.take_jobs()
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r) is True  # C may still be writing
    out = Output(PushOutcome(due=frozenset({"r1"})))
    s.on_connector_output(out)
    assert out.finished_recving is None and manager.freed_requests == []


def test_requests_for_a_prefix_another_is_pushing_wait_and_take_its_blocks():
    """A burst forked from one context: one match, one push. Before, each
    request asked the source and each push wrote the same blocks again."""
    s = scheduler()
    a, b, c = req("a"), req("b", n_tokens=5 * BS + 9), req("c")
    release = threading.Event()
    asked = []

    def post(source, path, content, headers, deadline):
        asked.append(json.loads(content)["token_ids"][:1])
        release.wait(5)
        return http_answer(
            200,
            {
                "matched_blocks": 4,
                "matched_tokens": 4 * BS,
                "total_full_blocks": 5,
                "fingerprint": C_FP.model_dump(),
                "engine_timeout_s": 30,
                "source_id": C_SOURCE,
                "now_unix_ms": int(time.time() * 1000),
            },
        )

    s._lanes.post = post
    assert s.get_num_new_matched_tokens(a, 0) == (None, False)  # a's match runs
    # b and c arrive meanwhile: they wait for a, asking the source nothing
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)
    assert s.get_num_new_matched_tokens(c, 0) == (None, False)
    release.set()
    deadline = time.monotonic() + 5
    while not s._matches["a"].done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.get_num_new_matched_tokens(a, 0) == (4 * BS, True)
    s.update_state_after_alloc(a, Blocks([10, 11, 12, 13, 14, 15]), 4 * BS)
    (job,) = s.take_jobs()
    assert job.dst_block_ids == (10, 11, 12, 13)
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)  # a's push runs
    s.on_worker_meta(PushOutcome({"a": 4}))
    # vLLM cached a's blocks: b's and c's prefix hits now cover them; b asks for
    # what lies beyond, and c (the same prompt) waits for that answer
    for r in (b, c):
        assert s.get_num_new_matched_tokens(r, 4 * BS) == (None, False)
    assert "b" in s._matches and "c" not in s._matches
    for r in (b, c):
        deadline = time.monotonic() + 5
        while r.request_id not in s._matches or not s._matches[r.request_id].done():
            assert time.monotonic() < deadline
            s.get_num_new_matched_tokens(r, 4 * BS)
            time.sleep(0.01)
        assert s.get_num_new_matched_tokens(r, 4 * BS) == (0, False)
    s.update_state_after_alloc(b, Blocks([10, 11, 12, 13, 20, 21]), 0)
    s.update_state_after_alloc(c, Blocks([10, 11, 12, 13, 22]), 0)
    assert s.take_jobs() == [] and len(asked) == 3  # a's match, then b's and c's
    assert s.stats["coalesced"] == 2 and s.stats["requests"] == 1


def test_a_request_waits_for_another_only_while_it_fetches_within_its_budget():
    clock = Clock()
    s = PushScheduler(BS, SCHED_CONFIG, FP, clock=clock)
    a, b = req("a"), req("b")
    matched(s, a)
    s.update_state_after_alloc(a, Blocks([1, 2, 3, 4, 5]), 4 * BS)
    s.take_jobs()
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)
    assert "b" not in s._matches  # waits for a's push
    # a's push is past its budget (the push timeout: unmeasured source)
    clock.now += SCHED_CONFIG.push_timeout_s
    s._lanes.post = lambda *args, **kwargs: http_answer(503, {})
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)
    assert "b" in s._matches  # its own match now
    assert s.stats["coalesced"] == 1 and s.decisions["coalesced"] == 1


def test_a_request_for_the_same_prefix_from_another_source_does_not_wait():
    other = "http://c2:9000"
    config = ExtConfig(
        push_min_tokens=0, push_match_timeout_s=1, push_sources=(SRC, other)
    )
    s = PushScheduler(BS, config, FP)
    a = req("a")
    matched(s, a)
    b = d_request("b", 5 * BS + 3, other + "/")
    s._lanes.post = lambda *args, **kwargs: http_answer(503, {})
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)
    assert "b" in s._matches and s.stats["coalesced"] == 0


# ---- the source's load (decode_cost.SourceLoad) -------------------------------------
def test_a_source_with_every_slot_taken_is_not_asked_to_push():
    """C serves 2 pushes at once and says so: with D's own 2 pushes from it in
    flight, a third request is prefilled here at once (refused: C would answer
    busy after D allocated the blocks), not sent into a 429."""
    s = scheduler()
    for rid, blocks in (("r1", [30, 31, 32, 33, 34]), ("r2", [40, 41, 42, 43, 44])):
        r = req(rid, salt=rid)  # other prompts: no coalescing
        assert matched(s, r, load={"push_slots": 2}) == (4 * BS, True)
        s.update_state_after_alloc(r, Blocks(blocks), 4 * BS)
    assert len(s.take_jobs()) == 2
    r3 = req("r3", salt="r3")
    assert matched(s, r3, load={"push_slots": 2, "pushes_in_flight": 1}) == (0, False)
    assert s.take_jobs() == []
    assert s.stats["source_full"] == 1
    assert s.decisions["refused"] == 1
    # one of D's pushes ended: a slot is free again
    s.on_worker_meta(PushOutcome({"r1": 4}))
    r4 = req("r4", salt="r4")
    assert matched(s, r4, load={"push_slots": 2, "pushes_in_flight": 1}) == (
        4 * BS,
        True,
    )
    s.shutdown()


def test_a_source_reporting_its_slots_taken_is_not_asked_either():
    """Other destinations' pushes count too: C says it serves its 4 of 4."""
    s = scheduler()
    r = req()
    assert matched(s, r, load={"push_slots": 4, "pushes_in_flight": 4}) == (0, False)
    assert s.decisions["refused"] == 1 and s.stats["source_full"] == 1
    s.shutdown()


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        ({}, (0, None, 0)),  # an older source: nothing said
        (
            {"pushes_in_flight": 3, "push_slots": 4, "prefill_backlog_tokens": 900},
            (3, 4, 900),
        ),
        (
            {"pushes_in_flight": -5, "push_slots": 0, "prefill_backlog_tokens": -1},
            (0, None, 0),
        ),
        ({"pushes_in_flight": 9, "push_slots": 4}, (0, 4, 0)),  # more than its slots
        ({"push_slots": 1 << 40, "prefill_backlog_tokens": 1 << 50}, (0, None, 0)),
    ],
)
def test_a_sources_reported_load_is_bounded(load, expected):
    """Never trust a peer: a number out of range counts as not said."""
    s = scheduler()
    r = req()
    matched(s, r, load=load)
    got = s._loads[SRC]
    assert (
        got[0].pushes_in_flight,
        got[0].push_slots,
        got[0].backlog_tokens,
    ) == expected
    s.shutdown()


def test_a_push_is_measured_under_the_load_its_source_reported():
    """A push granted while C prefilled a backlog and served another push is
    measured as one push alone in that state: the next judgement of C idle is
    not charged for it."""
    s = scheduler()
    s.cost.observe_round_trip(SRC, 0.0)
    r = req()
    load = {"push_slots": 4, "pushes_in_flight": 1, "prefill_backlog_tokens": 5000}
    assert matched(s, r, load=load) == (4 * BS, True)
    s.update_state_after_alloc(r, Blocks([30, 31, 32, 33, 34]), 4 * BS)
    inf = s._inflight["r1"]
    assert (inf.load.pushes_in_flight, inf.load.backlog_tokens) == (1, 5000)
    inf.allocated -= 0.8  # it took 0.8 s
    s.on_worker_meta(PushOutcome({"r1": 4}))
    alone = SourceLoad(backlog_tokens=5000)
    assert s.cost.write_s(SRC, 4, alone) == pytest.approx(0.8 / 2, rel=0.05)
    assert (SRC, False) not in s.cost._pushes  # measured while C prefilled
    s.shutdown()


def test_a_landed_push_times_its_tail_to_the_first_token():
    s = scheduler()
    s.cost.observe_round_trip(SRC, 0.0)
    r = req()
    matched(s, r)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 4 * BS)
    s.on_worker_meta(PushOutcome({"r1": 4}))
    before = s.cost.transfer_s(SRC, 4)
    r.num_output_tokens = 1
    landed_at = s.prefill_timer._tails["r1"][1]
    s.prefill_timer._clock = lambda: landed_at + 0.05
    s.prefill_timer.step(SimpleNamespace(scheduled_new_reqs=[]))
    assert list(s.cost._tails) == [pytest.approx(0.05)]
    # one tail is not yet the median (decode_cost.TAIL_MIN_SAMPLES)
    assert s.cost.transfer_s(SRC, 4) == pytest.approx(before)
    s.shutdown()


def test_the_gate_weighs_the_requests_queued_on_d():
    s = scheduler()
    s.cost.observe_round_trip(SRC, 0.01)
    s.cost.observe_push(SRC, 4, 1.0)  # 4 blocks in 1 s: dearer than their prefill
    s.cost.observe_prefill(4 * BS, 0.3)
    assert not s.pays("r1", SRC, 4)
    s.own_queue = lambda rid: 3  # three requests of D's wait behind a local prefill
    assert s.pays("r2", SRC, 4)
    s.shutdown()


def test_a_released_push_of_two_workers_keeps_its_blocks_until_both_ended():
    """D at TP 2: one worker's push ended, the other's may still be written into the
    same blocks (each rank its own shard): they stay pinned, and vLLM, which counts
    both workers' ends, is told nothing of the request."""
    s, r, blocks, manager, _ = released_push(workers=2)
    first = Output(PushOutcome({"r1": 4}), None)  # vLLM waits for the other worker
    s.on_connector_output(first)
    assert manager.free_queue == [30, 35] and first.finished_recving is None
    last = Output(PushOutcome({"r1": 1}), {"r1", "other"})
    s.on_connector_output(last)
    assert last.finished_recving == {"other"}
    assert manager.free_queue == [30, 35, 31, 32, 33, 34]
    assert s.stats["pushed_blocks"] == 1
