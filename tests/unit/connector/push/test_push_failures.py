"""D's push gate learns from pushes that do not land (push/decode_cost.py,
push/decode_scheduler.py): a failed or late push costs its source, a source
failing a few in a row is not pushed from (named or picked, whatever the
policy) until its probe, and a push's budget follows what D expects of its
source, so a late source starts no write and the push's hold ends sooner.

Pure logic with fake clocks and stubbed answers, except where C is a real
PushServer on 127.0.0.1 (helpers.CServer)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import wait
from dataclasses import replace

import pytest
from helpers import (
    BLEN,
    BS,
    C_SOURCE,
    D_SESSION,
    FP,
    NBLK,
    SCHED_FP,
    TOKENS,
    Blocks,
    Clock,
    ask,
    d_request,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.peer_client import (
    Answer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.feed_protocol import (
    FeedPage,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    hash_prompt_blocks,
    to_pool_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push import (
    decode_cost,
    decode_scheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_cost import (
    FAILURES_TO_DEMOTE,
    PROBE_AFTER_S,
    Decision,
    PushCostModel,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_index import (
    HolderIndex,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    PushOutcome,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.scheduler_extension import (
    SchedulerExtension,
)

SRC = "http://c:9000"

# ---- the cost model ------------------------------------------------------------------


def cost_model(always=False) -> tuple[PushCostModel, Clock]:
    clock = Clock()
    return PushCostModel(0, clock, always=always), clock


def test_a_push_that_landed_nothing_costs_its_wait_and_the_local_prefill_after_it():
    m, _ = cost_model()
    m.observe_round_trip(SRC, 0.01)
    m.observe_prefill(8 * 128, 0.2)  # D prefills these 8 blocks in 0.2 s
    m.observe_shortfall(SRC, 8, 0, 3.0, 128)  # waited 3 s, then prefilled all 8
    est = m.decide(SRC, 8, 128)
    assert est.transfer_s == pytest.approx(3.0 + 0.2)
    assert est.decision is Decision.NOT_WORTH_IT


def test_a_push_that_landed_nothing_costs_at_least_its_wait_while_prefill_is_unmeasured():
    m, _ = cost_model()
    m.observe_round_trip(SRC, 0.01)
    m.observe_shortfall(SRC, 4, 0, 275.0, 128)
    assert m.transfer_s(SRC, 4) == pytest.approx(275.0)


def test_a_source_whose_pushes_land_nothing_a_few_times_in_a_row_waits_for_its_probe():
    m, clock = cost_model()
    for _ in range(FAILURES_TO_DEMOTE - 1):
        m.failed(SRC)
        assert m.decide(SRC, 8, 128).decision is None  # unmeasured: pushed
    m.failed(SRC)
    assert m.failing(SRC)
    assert m.decide(SRC, 8, 128).decision is Decision.NOT_WORTH_IT
    clock.now += PROBE_AFTER_S - 1
    assert m.decide(SRC, 8, 128).decision is Decision.NOT_WORTH_IT
    clock.now += 1
    assert not m.failing(SRC)
    assert m.decide(SRC, 8, 128).decision is None  # one probe
    assert m.decide(SRC, 8, 128).decision is Decision.NOT_WORTH_IT  # not two
    assert m.decide(SRC, 8, 128, judge=False).decision is None  # granted already
    m.observe_push(SRC, 8, 0.05)  # the probe landed: pushed again
    assert not m.failing(SRC) and m.decide(SRC, 8, 128).decision is None


def test_a_push_that_landed_some_blocks_ends_the_failures():
    m, _ = cost_model()
    for _ in range(FAILURES_TO_DEMOTE - 1):
        m.failed(SRC)
    m.observe_shortfall(SRC, 8, 3, 0.1, 128)
    m.failed(SRC)
    assert not m.failing(SRC)


def test_under_always_a_failing_source_is_not_pushed_from_but_a_slow_one_is():
    m, _ = cost_model(always=True)
    slow = "http://slow:9000"
    m.observe_round_trip(slow, 0.01)
    m.observe_push(slow, 8, 50.0)  # lands, but far slower than the prefill
    m.observe_prefill(8 * 128, 0.2)
    assert m.decide(slow, 8, 128).decision is None
    for _ in range(FAILURES_TO_DEMOTE):
        m.failed(SRC)
    assert m.decide(SRC, 8, 128).decision is Decision.NOT_WORTH_IT


def test_a_pushs_budget_follows_its_expected_transfer_within_the_push_timeout():
    m, _ = cost_model()
    assert m.budget_s(SRC, 4, 30.0) == 30.0  # unmeasured: the push timeout
    m.observe_round_trip(SRC, 0.01)
    m.observe_push(SRC, 4, 0.41)  # 0.1 s a block beyond the round trip
    expected = 0.01 + 4 * 0.1
    assert m.budget_s(SRC, 4, 30.0) == pytest.approx(
        decode_cost.BUDGET_FACTOR * expected + 0.01 + decode_cost.BUDGET_FLOOR_S
    )
    assert m.budget_s(SRC, 400, 30.0) == 30.0  # never above the push timeout


# ---- the scheduler: sources that never land --------------------------------------------

PROMPT = list(range(1000, 1000 + 5 * BS + 3))  # 5 full blocks and 3 tokens
FEED_CFG = HashConfig("sha256", b"\x05" * 32, scheduler_id="source-sched")


def held_page(blocks: int) -> FeedPage:
    """SRC's feed: it holds PROMPT's first ``blocks`` blocks."""
    hashes = hash_prompt_blocks(PROMPT, BS, FEED_CFG.hash_algo, FEED_CFG.none_hash)
    return FeedPage(
        epoch="e1",
        seq=1,
        reset=True,
        events=["+" + to_pool_key(h).hex() for h in hashes[:blocks]],
        more=False,
        hash_algo=FEED_CFG.hash_algo,
        none_hash=FEED_CFG.none_hash.hex(),
        scheduler_id=FEED_CFG.scheduler_id,
        block_size=BS,
    )


class MatchStub:
    """SRC's /match_blocks (the scheduler's lanes' post): ``blocks`` held."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self.calls: list[str] = []

    def __call__(self, source, path, content, headers, deadline):
        self.calls.append(source + path)
        body = {
            "matched_blocks": self.blocks,
            "matched_tokens": self.blocks * BS,
            "total_full_blocks": len(PROMPT) // BS,
            "fingerprint": FP.model_dump(),
            "engine_timeout_s": 30,
            "source_id": C_SOURCE,
            "now_unix_ms": int(time.time() * 1000),
        }
        return Answer(200, json.dumps(body).encode(), {})


def request(rid: str, mode: str = "named"):
    return d_request(rid, source="auto" if mode == "auto" else SRC, tokens=PROMPT)


def failing_scheduler(mode: str, policy: str, clock: Clock) -> PushScheduler:
    config = ExtConfig(
        push_min_tokens=0,
        push_match_timeout_s=1,
        push_sources=(SRC,),
        push_timeout_s=2.0,
        push_policy=policy,
    )
    s = PushScheduler(BS, config, SCHED_FP, clock=clock)
    if mode == "auto":
        s.index = HolderIndex([SRC], BS)
        s.index.apply(SRC, held_page(4))
    return s


@pytest.mark.parametrize("policy", ["measured", "always"])
@pytest.mark.parametrize("how", ["answered", "hanging"])
@pytest.mark.parametrize("mode", ["named", "auto"])
def test_twenty_pushes_that_never_land_stop_being_granted_after_a_few(
    mode, how, policy
):
    """C answers every /match_blocks; its pushes land nothing, either answered
    ("failed") or never (the push is late: not ended within twice its budget,
    while its blocks stay held). After FAILURES_TO_DEMOTE of them, D prefills
    locally without asking C, until the probe."""
    clock = Clock()
    s = failing_scheduler(mode, policy, clock)
    s._lanes.post = stub = MatchStub(4)
    granted, held = [], []
    for i in range(20):
        r = request(f"r{i}", mode)
        got = ask(s, r)
        if got == (0, False):
            clock.now += 0.1
            continue
        assert got == (4 * BS, True)
        granted.append(r.request_id)
        s.update_state_after_alloc(r, Blocks([10, 11, 12, 13, 14]), 4 * BS)
        (job,) = s.take_jobs()
        assert job.timeout_s == 2.0  # unmeasured: the push timeout
        r.num_computed_tokens = r.num_external_computed_tokens = 4 * BS
        if how == "answered":
            s.on_worker_meta(PushOutcome({r.request_id: 0}))
            assert s.request_finished(r) is False
        else:
            clock.now += 2 * 2.0 + 0.1  # past twice its budget, far from its hold
            s.take_jobs()
            held.append(r)
    assert len(granted) == FAILURES_TO_DEMOTE, granted
    # the index demoted an auto source that answered too (decode_index.py), and
    # is asked first; a hanging push is counted once it ends
    skipped = "no_holder" if (mode, how) == ("auto", "answered") else "not_worth_it"
    expected = {skipped: 20 - FAILURES_TO_DEMOTE}
    if how == "answered":
        expected["fell_back"] = FAILURES_TO_DEMOTE
    assert {k: v for k, v in s.decisions.items() if v} == expected
    assert len(stub.calls) == FAILURES_TO_DEMOTE  # nothing asked of C after them
    if how == "hanging":
        assert s.stats["late_pushes"] == FAILURES_TO_DEMOTE
        for r in held:  # C may still write into their blocks: kept
            assert s.request_finished(r) is True
    else:
        assert s.stats["failed_pushes"] == FAILURES_TO_DEMOTE
    if mode == "named":
        clock.now += PROBE_AFTER_S
        probe = request("probe")
        assert ask(s, probe) == (4 * BS, True)
        s.request_finished(probe)  # else the next one waits for its push
        assert ask(s, request("next")) == (0, False)
    s.shutdown()


def test_a_busy_source_is_measured_but_not_made_failing():
    """C's refusals (busy, say) are answered at once and hold nothing: they cost
    the round trip, never a demotion of the source."""
    clock = Clock()
    s = failing_scheduler("named", "always", clock)
    s._lanes.post = MatchStub(4)
    for i in range(2 * FAILURES_TO_DEMOTE):
        r = request(f"r{i}")
        assert ask(s, r) == (4 * BS, True)
        s.update_state_after_alloc(r, Blocks([10, 11, 12, 13, 14]), 4 * BS)
        s.take_jobs()
        s.on_worker_meta(PushOutcome({r.request_id: 0}, frozenset({r.request_id})))
    assert not s.cost.failing(SRC) and s.cost.transfer_s(SRC, 4) is not None
    assert s.decisions["refused"] == 2 * FAILURES_TO_DEMOTE
    s.shutdown()


# ---- a late push: its budget, its hold, its blocks --------------------------------------

WALL = 1_700_000_000.0


def test_a_late_push_counts_as_failed_at_once_and_keeps_its_blocks_until_its_shorter_hold():
    """A measured source (a push of 4 blocks takes 0.1 s) gets a budget of
    BUDGET_FACTOR x that + a round trip + BUDGET_FLOOR_S, not the push timeout's
    30 s. Its push is not answered: after twice the budget the scheduler counts
    it as a failure of the source; the blocks stay with the request until the
    hold computed with that budget has passed, then the request prefills them
    locally."""
    clock = Clock()
    cfg = ExtConfig(push_min_tokens=0, push_match_timeout_s=1, push_sources=(SRC,))
    assert cfg.push_timeout_s == 30.0
    s = PushScheduler(BS, cfg, SCHED_FP, clock=clock)
    s._lanes.post = MatchStub(4)
    s.cost.observe_round_trip(SRC, 0.01)
    s.cost.observe_push(SRC, 4, 0.1)
    r = request("r1")
    assert ask(s, r) == (4 * BS, True)
    s.update_state_after_alloc(r, Blocks([10, 11, 12, 13, 14]), 4 * BS)
    (job,) = s.take_jobs()
    budget = job.timeout_s
    expected = s.cost.transfer_s(SRC, 4)
    rtt = s.cost._round_trip[SRC].value
    assert budget == pytest.approx(
        decode_cost.BUDGET_FACTOR * expected + rtt + decode_cost.BUDGET_FLOOR_S
    )
    assert budget < 6.0
    r.num_computed_tokens = r.num_external_computed_tokens = 4 * BS

    posted, gate = threading.Event(), threading.Event()
    sent = {}

    def hanging(source, path, content, headers, deadline):
        sent.update(json.loads(content))
        posted.set()
        gate.wait(10)
        raise TimeoutError("no answer")

    rec = PushReceiver(
        D_SESSION,
        [100, 200],
        BLEN,
        BS,
        NBLK,
        FP,
        cfg,
        clock=clock,
        wall_clock=lambda: WALL,
    )
    rec._lanes.post = hanging
    try:
        rec.start([job])
        assert posted.wait(5)
        # C is told to start no write past the budget
        assert sent["budget_ms"] == int(budget * 1000)
        assert sent["deadline_unix_ms"] == int((WALL + budget) * 1000)
        nbytes = 4 * BLEN * 2
        hold = rec.hold_s(job)
        assert hold == pytest.approx(
            replace(cfg, push_timeout_s=budget).push_hold_for_s(nbytes, 30)
        )
        assert hold < cfg.push_hold_for_s(nbytes, 30) - 20

        clock.now += 2 * budget + 0.1
        s.take_jobs()
        assert s.stats["late_pushes"] == 1
        assert s.cost._failures[SRC].in_a_row == 1
        # the request waits for its push's end, on its own blocks
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        assert rec.merge_finished(None) is None, "the push ended before its hold"
        clock.now = 1000.0 + hold - 0.1
        assert rec.merge_finished(None) is None, "the push ended before its hold"
        clock.now += 0.2
        assert rec.merge_finished(None) == {"r1"}
        outcome = rec.take_outcome()
        assert outcome.landed == {"r1": 0}
        s.on_worker_meta(outcome)
        # prefilled locally, in the blocks it kept; counted as one failure, not two
        assert (r.num_computed_tokens, r.num_external_computed_tokens) == (0, 0)
        assert s.decisions["fell_back"] == 1 and s.stats["failed_pushes"] == 1
        assert s.cost._failures[SRC].in_a_row == 1
        assert s.request_finished(r) is False
    finally:
        gate.set()
        rec.shutdown()
        s.shutdown()


def test_a_source_that_does_not_start_within_the_push_budget_writes_nothing(
    c_server, monkeypatch
):
    """C is measured fast, then takes 1.5 s to get to a push (its match is slow):
    past the push's budget (well under the 30 s push timeout), C writes nothing
    and answers at once, and the request prefills locally right away."""
    monkeypatch.setattr(decode_cost, "BUDGET_FLOOR_S", 0.2)
    c = c_server()
    d = c.destination()
    cfg = ExtConfig(push_min_tokens=0, push_sources=(c.url,))
    s = PushScheduler(BS, cfg, SCHED_FP)
    r = d_request("r1", source=c.url, tokens=TOKENS)
    try:
        assert ask(s, r) == (3 * BS, True)
        s.cost.observe_push(c.url, 3, s.cost._round_trip[c.url].value + 0.03)
        s.update_state_after_alloc(r, Blocks([3, 4, 7]), 3 * BS)
        (job,) = s.take_jobs()
        assert job.timeout_s < 1.0
        match = c.server.sync.match

        def slow_match(*args):
            time.sleep(1.5)
            return match(*args)

        c.server.sync.match = slow_match
        rec = PushReceiver(D_SESSION, d.bases, BLEN, BS, NBLK, FP, cfg)
        started = time.monotonic()
        rec.start([job])
        end = started + 10
        while not rec.merge_finished(None) and time.monotonic() < end:
            time.sleep(0.01)
        assert time.monotonic() - started < 5, "the push waited for its hold"
        assert c.engine.log == [] and d.untouched(), "C wrote past the push's budget"
        assert c.server.stats["past_deadline"] == 1
        outcome = rec.take_outcome()
        assert outcome.landed == {"r1": 0}
        r.num_computed_tokens = r.num_external_computed_tokens = 3 * BS
        s.on_worker_meta(outcome)
        assert r.num_computed_tokens == 0 and s.decisions["fell_back"] == 1
        rec.shutdown()
    finally:
        s.shutdown()


def test_a_late_push_that_lands_after_all_ends_the_failures():
    clock = Clock()
    s = failing_scheduler("named", "measured", clock)
    s._lanes.post = MatchStub(4)
    r = request("r1")
    assert ask(s, r) == (4 * BS, True)
    s.update_state_after_alloc(r, Blocks([10, 11, 12, 13, 14]), 4 * BS)
    s.take_jobs()
    clock.now += 5.0
    s.take_jobs()
    assert s.stats["late_pushes"] == 1 and s.cost._failures[SRC].in_a_row == 1
    s.on_worker_meta(PushOutcome({"r1": 4}))
    assert SRC not in s.cost._failures and s.decisions["pushed"] == 1
    s.shutdown()


def test_a_push_never_sent_for_its_lane_was_busy_past_its_budget_is_no_failure():
    """Its source's earlier pushes kept D's lane busy until the push's budget had
    passed: C was never asked, so the push is reported as refused (busy) and
    counts no failure against C."""
    clock = Clock()
    s = failing_scheduler("named", "always", clock)
    s._lanes.post = MatchStub(4)
    rec = PushReceiver(D_SESSION, [100, 200], BLEN, BS, NBLK, FP, s.config, clock=clock)
    queued = []
    rec._lanes.submit = lambda source, fn, t: queued.append(t)  # the lane is busy
    try:
        for i in range(FAILURES_TO_DEMOTE):
            r = request(f"r{i}")
            assert ask(s, r) == (4 * BS, True)
            s.update_state_after_alloc(r, Blocks([10, 11, 12, 13, 14]), 4 * BS)
            rec.start(s.take_jobs())
            clock.now += 2.1  # past the budget (the push timeout: unmeasured)
            rec._run(queued.pop())  # the lane is free at last: too late to send
            assert rec.merge_finished(None) == {r.request_id}
            outcome = rec.take_outcome()
            assert outcome.refused == {r.request_id}
            s.on_worker_meta(outcome)
        assert s.decisions["refused"] == FAILURES_TO_DEMOTE
        assert not s.cost.failing(SRC) and s.stats["failed_pushes"] == 0
    finally:
        rec.shutdown()
        s.shutdown()


def test_an_unanswered_match_is_not_a_push_failure():
    clock = Clock()
    s = failing_scheduler("named", "measured", clock)
    s._lanes.post = lambda *a: Answer(503, b"not ready", {})
    for i in range(2 * FAILURES_TO_DEMOTE):
        assert ask(s, request(f"r{i}")) == (0, False)
    assert not s.cost.failing(SRC)
    s.shutdown()


# ---- a source that answers its match late ----------------------------------------------


class HangingMatch:
    """SRC's /match_blocks that answers only when released (a busy source)."""

    def __init__(self):
        self.release = threading.Event()
        self.answer = MatchStub(4)

    def __call__(self, source, path, content, headers, deadline):
        self.release.wait(10)
        return self.answer(source, path, content, headers, deadline)


@pytest.mark.parametrize("mode", ["named", "auto"])
def test_a_match_slower_than_the_local_prefill_it_would_save_is_given_up(
    mode, monkeypatch
):
    """D has timed its local prefills (50 ms for these 4 blocks); C's match does
    not answer. Within MOONCAKE_PUSH_MATCH_TIMEOUT_S (5 s) D stops waiting once
    the wait passes the local prefill (here the floor, shortened to 0.1 s),
    prefills locally (not worth it), and the wait counts as one of C's round
    trips, which the next requests are judged with."""
    monkeypatch.setattr(decode_cost, "MATCH_WAIT_FLOOR_S", 0.1, raising=False)
    clock = Clock()
    config = ExtConfig(push_min_tokens=0, push_match_timeout_s=5, push_sources=(SRC,))
    s = PushScheduler(BS, config, SCHED_FP, clock=clock)
    if mode == "auto":
        s.index = HolderIndex([SRC], BS)
        s.index.apply(SRC, held_page(4))
    s._lanes.post = hanging = HangingMatch()
    s.cost.observe_prefill(4 * BS, 0.05)
    s.cost.observe_round_trip(SRC, 0.01)
    s.cost.observe_push(SRC, 4, 0.02)
    expected = s.cost.transfer_s(SRC, 4)
    r = request("slow", mode)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # asked
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # waits
    time.sleep(0.15)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert {k: v for k, v in s.decisions.items() if v} == {"slow_match": 1}
    assert s.stats["slow_matches"] == 1 and s.stats["match_failed"] == 0
    hanging.release.set()  # its late answer changes nothing
    time.sleep(0.05)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    # the wait (at least 0.1 s) is one more of C's round trips
    assert s.cost.transfer_s(SRC, 4) >= expected + decode_cost.ALPHA * (0.1 - 0.01)
    s.shutdown()


def a_step_of(s: PushScheduler, clock: Clock, seconds: float) -> None:
    """D's scheduler builds a step's metadata, ``seconds`` after the last."""
    s.take_jobs()
    clock.now += seconds
    s.take_jobs()


def test_a_match_answered_within_the_step_is_used_in_the_step_that_asked():
    """D's last step took 1 s. C answers at once: D waits for it inline (at most
    50 ms a step) and the request is pushed in the step that asked, not when a
    later step's token budget reaches it again."""
    clock = Clock()
    config = ExtConfig(push_min_tokens=0, push_match_timeout_s=5, push_sources=(SRC,))
    s = PushScheduler(BS, config, SCHED_FP, clock=clock)
    s._lanes.post = MatchStub(4)
    a_step_of(s, clock, 1.0)
    assert s.get_num_new_matched_tokens(request("inline"), 0) == (4 * BS, True)
    s.shutdown()


def test_the_inline_wait_is_bounded_by_the_step_and_spent_once_a_step(monkeypatch):
    """C does not answer. After a step of 0.1 s D waits at most a quarter of it
    (25 ms) in a step, whatever the number of requests asking (prompts of their
    own: one prefix's requests wait for the first's push); the next step waits
    again; a D that measured no step yet does not wait. The waits D asks for are
    checked, not the wall clock (a loaded host stretches a wait)."""
    asked: list[float] = []

    def recorded_wait(fs, timeout):
        asked.append(timeout)
        return wait(fs, timeout=timeout)

    monkeypatch.setattr(decode_scheduler, "wait", recorded_wait)
    clock = Clock()
    config = ExtConfig(push_min_tokens=0, push_match_timeout_s=5, push_sources=(SRC,))
    s = PushScheduler(BS, config, SCHED_FP, clock=clock)
    s._lanes.post = hanging = HangingMatch()
    assert s.get_num_new_matched_tokens(request("unmeasured"), 0) == (None, False)
    assert asked == []
    a_step_of(s, clock, 0.1)
    for i in range(3):
        r = d_request(f"r{i}", source=SRC, tokens=[i] + PROMPT[1:])
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert asked[0] == pytest.approx(0.025)
    # what a wait took is spent: the requests after it wait (about) nothing
    assert sum(asked) < 0.026, asked
    asked.clear()
    a_step_of(s, clock, 0.1)
    r = d_request("next", source=SRC, tokens=[9] + PROMPT[1:])
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert asked == [pytest.approx(0.025)]
    hanging.release.set()
    s.shutdown()


def test_a_match_within_the_local_prefills_time_is_waited_for():
    """The same, C answering after 0.05 s: D waits and pushes."""
    clock = Clock()
    config = ExtConfig(push_min_tokens=0, push_match_timeout_s=5, push_sources=(SRC,))
    s = PushScheduler(BS, config, SCHED_FP, clock=clock)
    s._lanes.post = hanging = HangingMatch()
    s.cost.observe_prefill(4 * BS, 0.05)
    r = request("quick")
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    time.sleep(0.05)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    hanging.release.set()
    assert ask(s, r) == (4 * BS, True)
    assert s.stats["slow_matches"] == 0
    s.shutdown()


# ---- a local prefill behind a push in flight ------------------------------------------


def extension_of(s: PushScheduler) -> SchedulerExtension:
    """The scheduler process's extension around ``s`` (what vLLM's scheduler asks)."""
    ext = object.__new__(SchedulerExtension)
    ext.push = s
    return ext


def pushing(s: PushScheduler, stub: MatchStub, rid: str, first_token: int):
    """A request of its own prompt that C holds 4 blocks of, pushed and in flight."""
    stub.blocks = 4
    r = d_request(rid, source=SRC, tokens=[first_token] + PROMPT[1:])
    assert ask(s, r) == (4 * BS, True)
    s.update_state_after_alloc(r, Blocks([10, 11, 12, 13, 14]), 4 * BS)
    s.take_jobs()
    return r


def local(s: PushScheduler, stub: MatchStub, rid: str, first_token: int):
    """A request C holds nothing of: a local prefill, once its match is in."""
    stub.blocks = 0
    r = d_request(rid, source=SRC, tokens=[first_token] + PROMPT[1:])
    s.get_num_new_matched_tokens(r, 0)
    s._matches[rid].result(timeout=10)
    return r


def test_a_local_prefill_behind_a_push_in_flight_starts_once_the_push_landed():
    """vLLM's scheduler skips a request whose push is in flight and starts the
    prefills behind it; once the push landed, those prefills take the step's
    token budget first, until they end. So a local prefill asked for after a
    push was allocated waits (asked again next step, without asking C again)
    until the push landed; a push allocated after it was held does not hold it."""
    clock = Clock()
    config = ExtConfig(push_min_tokens=0, push_match_timeout_s=5, push_sources=(SRC,))
    s = PushScheduler(BS, config, SCHED_FP, clock=clock)
    s._lanes.post = stub = MatchStub(4)
    ext = extension_of(s)
    ahead = pushing(s, stub, "ahead", 1)
    behind = local(s, stub, "behind", 2)
    asked = len(stub.calls)
    for _ in range(3):
        assert ext.get_num_new_matched_tokens(behind, 0) == (None, False)
        clock.now += 0.1
    assert len(stub.calls) == asked and s.stats["held_for_landing"] == 1
    later = pushing(s, stub, "later", 3)  # behind it: it does not hold it
    s.on_worker_meta(PushOutcome({ahead.request_id: 4}))
    assert ext.get_num_new_matched_tokens(behind, 0) == (0, False)
    assert s.decisions["no_holder"] == 1 and s.decisions["pushed"] == 1
    assert later.request_id in s._inflight
    s.shutdown()


def test_a_local_prefill_waits_for_a_push_ahead_at_most_the_prefill_it_saves():
    """The push ahead does not land: the local prefill behind it waits at most the
    local prefill of the pushed tokens (D measured 0.3 s), then starts."""
    clock = Clock()
    config = ExtConfig(push_min_tokens=0, push_match_timeout_s=5, push_sources=(SRC,))
    s = PushScheduler(BS, config, SCHED_FP, clock=clock)
    s.cost.observe_prefill(4 * BS, 0.3)
    s._lanes.post = stub = MatchStub(4)
    ext = extension_of(s)
    pushing(s, stub, "ahead", 1)
    behind = local(s, stub, "behind", 2)
    assert ext.get_num_new_matched_tokens(behind, 0) == (None, False)
    clock.now += 0.29
    assert ext.get_num_new_matched_tokens(behind, 0) == (None, False)
    clock.now += 0.02
    assert ext.get_num_new_matched_tokens(behind, 0) == (0, False)
    s.shutdown()
