"""connector/push/decode_scheduler.py and push/receiver.py: D's side of a prefix push.
Pure logic (C's /match_blocks and /push_blocks answers are stubbed); the real
path runs in tests/integration/test_push.py."""

import json
import threading
import time

import pytest
from helpers import C_SOURCE, Blocks, d_request

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_client import (
    Answer,
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


def matched(sched, r, local_tokens=0, answer=4):
    """C's /match_blocks answers `answer` held blocks (or raises it)."""

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
            },
        )

    sched._lanes.post = post
    assert sched.get_num_new_matched_tokens(r, local_tokens) == (None, False)
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
        "refused_sources": 0,
        "refused_clock_skew": 0,
        "auto_asked": 0,
        "auto_no_holder": 0,
        "auto_picked": 0,
        "auto_missed": 0,
        "failed_pushes": 0,
        "late_pushes": 0,
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
        assert rec.take_outcome() is None
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
