# SPDX-License-Identifier: Apache-2.0
"""D's judgement of whether a push pays (push/decode_cost.py): pure logic, a fake clock."""

import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_cost import (
    MAX_QUEUED,
    PROBE_AFTER_S,
    TAIL_MIN_SAMPLES,
    Decision,
    PrefillTimer,
    PushCostModel,
    SourceLoad,
    bucket,
)

SRC = "http://c:9000"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def model(min_tokens=0):
    clock = Clock()
    return PushCostModel(min_tokens, clock), clock


def measured(push_s=0.05, blocks=4, rtt_s=0.01, prefill_s=0.2, tokens=1024):
    m, clock = model()
    m.observe_round_trip(SRC, rtt_s)
    m.observe_push(SRC, blocks, push_s)
    m.observe_prefill(tokens, prefill_s)
    return m, clock


def test_fewer_tokens_than_the_minimum_are_never_pushed():
    m, _ = model(min_tokens=256)
    assert m.decide(SRC, 1, 128).decision is Decision.BELOW_MINIMUM
    assert m.decide(SRC, 2, 128).decision is None  # 256: pushed (unmeasured)


def test_unmeasured_sides_push_so_that_they_get_measured():
    m, _ = model()
    assert m.decide(SRC, 8, 128).decision is None
    m.observe_prefill(1024, 0.001)  # prefill measured, the source not
    assert m.decide(SRC, 8, 128).decision is None
    m.observe_round_trip("http://other:1", 10.0)  # another source's figures
    m.observe_push("http://other:1", 8, 100.0)
    assert m.decide(SRC, 8, 128).decision is None


def test_a_push_cheaper_than_the_local_prefill_goes_ahead():
    m, _ = measured(push_s=0.05, blocks=8, rtt_s=0.01, prefill_s=0.2, tokens=1024)
    est = m.decide(SRC, 8, 128)
    assert est.decision is None
    assert est.transfer_s == pytest.approx(0.05)  # rtt + 8 x (0.04 / 8)
    assert est.prefill_s == pytest.approx(0.2)


def test_a_push_dearer_than_the_local_prefill_is_not_worth_it():
    m, _ = measured(push_s=0.5, blocks=8, rtt_s=0.01, prefill_s=0.2, tokens=1024)
    est = m.decide(SRC, 8, 128)
    assert est.decision is Decision.NOT_WORTH_IT
    assert est.transfer_s == pytest.approx(0.5) and est.prefill_s == pytest.approx(0.2)
    # the round trip does not scale with blocks: 1 block costs 0.01 + 0.06125
    assert m.transfer_s(SRC, 1) == pytest.approx(0.01 + 0.49 / 8)


def test_a_source_judged_not_worth_it_is_tried_again_later():
    m, clock = measured(push_s=0.5, blocks=8, prefill_s=0.2)
    assert m.decide(SRC, 8, 128).decision is Decision.NOT_WORTH_IT
    clock.now += PROBE_AFTER_S
    assert m.decide(SRC, 8, 128).decision is None  # one probe
    assert m.decide(SRC, 8, 128).decision is Decision.NOT_WORTH_IT  # not two
    m.observe_push(SRC, 8, 0.02)  # the probe found a fast link
    for _ in range(20):
        m.observe_push(SRC, 8, 0.02)
    assert m.decide(SRC, 8, 128).decision is None


def test_prefill_cost_goes_in_a_line_between_the_lengths_measured():
    """Between two measured lengths a prefill's time goes in a straight line from
    one's to the other's; beyond them, a token costs what it did at the nearest."""
    m, _ = model()
    m.observe_prefill(128, 0.0128)  # 100 us a token
    m.observe_prefill(8192, 1.6384)  # 200 us a token
    assert m.prefill_s(100) == pytest.approx(100 * 1e-4)
    assert m.prefill_s(128) == pytest.approx(0.0128)
    # 1.6256 s over 8,064 tokens: 201.6 us a token between the two
    assert m.prefill_s(4160) == pytest.approx(0.0128 + 4032 * 1.6256 / 8064)
    assert m.prefill_s(8192) == pytest.approx(1.6384)
    assert m.prefill_s(16384) == pytest.approx(16384 * 2e-4)
    assert bucket(1) == bucket(64) and bucket(65) == 7


def test_tokens_after_a_long_prefix_cost_what_the_last_ones_do():
    """A fresh prefill's time grows faster than its length (attention). 512
    tokens after 24,576 held cost what a token costs between the measured 16,384
    and 32,768 (300 us), not a token's mean in a fresh 32k (200 us): the mean
    left 186 ms of a turn's own tokens on the CPU backend in a push's tail."""
    m, _ = model()
    m.observe_prefill(16384, 16384 * 1e-4)  # 1.6384 s
    m.observe_prefill(32768, 32768 * 2e-4)  # 6.5536 s
    slope = (6.5536 - 1.6384) / 16384  # 300 us a token between them
    assert m.span_s(24576, 512) == pytest.approx(512 * slope)


def test_one_long_tail_does_not_price_out_every_short_push():
    """A tail is what is left of a landed push's first token after D's estimate
    of its own tokens; for a long turn that estimate's error is seconds. The tail
    is the median of the last ones, so one such turn does not make every short
    push "not worth it" (an average took minutes to forget 4.2 s)."""
    m, clock = measured(push_s=0.02, blocks=4, rtt_s=0.005, prefill_s=0.1, tokens=512)
    timer = PrefillTimer(m, clock)
    for i, extra in enumerate((0.01, 4.2, 0.01)):
        if i == 2:  # two tails: their median would be their mean
            assert m.decide(SRC, 4, 128).decision is None
        r = req(f"turn-{i}", prompt=600)
        timer.landed(r)
        timer.step(scheduled((r, 512)))
        clock.now += 88 * 0.1 / 512 + extra  # its own 88 tokens and the tail
        r.num_output_tokens = 1
        timer.step(scheduled())
    assert m.decide(SRC, 4, 128).decision is None  # 30 ms against 100 ms
    assert m.tail_s == pytest.approx(0.01)


def test_observations_are_a_moving_average_not_the_last_one():
    m, _ = model()
    m.observe_prefill(1024, 1.024)
    m.observe_prefill(1024, 0.0)  # ignored: no time is not a measurement
    m.observe_prefill(1024, 10.24)
    assert 1024 * 1e-3 < m.prefill_s(1024) < 1024 * 1e-2


def test_a_short_push_held_by_its_step_does_not_price_out_long_ones():
    """A push's landing waits for the end of D's step: a push of 4 blocks whose
    landing waited 0.585 s does not make the next 48 dearer than their prefill
    (measured on the CPU backend: pushes of 44-96 blocks in 26-113 ms, one of 4
    in 585 ms, then 48 judged 1.44 s against 0.80 s when a push's time was a
    mean per block)."""
    m, _ = model()
    m.observe_round_trip(SRC, 0.005)
    m.observe_prefill(48 * 128, 0.8)
    for _ in range(5):
        m.observe_push(SRC, 48, 0.065)
    m.observe_push(SRC, 4, 0.585)
    est = m.decide(SRC, 48, 128)
    assert est.decision is None
    # the short push was no faster: no part per block, the moving average's time
    assert est.transfer_s == pytest.approx(0.005 + 0.8 * 0.06 + 0.2 * 0.58)


def test_a_short_push_costs_the_step_its_landing_waits_for():
    """Pushes of every size take about one of D's steps to be reported (on the
    CPU backend 2-8 blocks took 12-1,010 ms, 40-192 blocks 26-1,006 ms): a push of
    4 blocks costs that step, not 4 blocks' share of a long push's time. Priced
    per block, 4-8 blocks were judged at a few ms and took 0.29-2.37 s against
    0.16-1.72 s of the prefill they saved."""
    m, _ = model()
    m.observe_round_trip(SRC, 0.01)
    m.observe_prefill(512, 0.2)
    m.observe_prefill(12288, 6.0)
    for blocks in (96, 8, 64, 4, 128, 6):
        m.observe_push(SRC, blocks, 0.51)
    est = m.decide(SRC, 4, 128)
    assert est.transfer_s == pytest.approx(0.51)
    assert est.decision is Decision.NOT_WORTH_IT  # 0.51 s against 0.2 s
    # and a long push is no dearer than the step either
    assert m.decide(SRC, 96, 128).transfer_s == pytest.approx(0.51)


def test_a_push_costs_a_fixed_part_and_a_part_per_block():
    """Where longer pushes take longer (a link's bandwidth), the line through
    them has both parts: 40 ms of step and 1 ms a block, found again from pushes
    of 8 to 160 blocks, and a push of 4 costs 44 ms, not 4 blocks' share."""
    m, _ = model()
    m.observe_round_trip(SRC, 0.0)
    for blocks in (8, 160, 32, 96, 16, 128, 64):
        m.observe_push(SRC, blocks, 0.04 + 0.001 * blocks)
    assert m.write_s(SRC, 4, SourceLoad()) == pytest.approx(0.044)
    assert m.write_s(SRC, 400, SourceLoad()) == pytest.approx(0.44)
    # 3 pushes in flight: 4 times the blocks on the link, the step once
    shared = SourceLoad(pushes_in_flight=3, push_slots=8)
    assert m.write_s(SRC, 100, shared) == pytest.approx(0.04 + 0.4)


def test_pushes_of_one_size_average_a_blocks_time():
    m, _ = model()
    m.observe_round_trip(SRC, 0.0)
    m.observe_push(SRC, 8, 0.08)
    m.observe_push(SRC, 8, 0.16)
    assert m.write_s(SRC, 1, SourceLoad()) == pytest.approx(0.8 * 0.01 + 0.2 * 0.02)


def req(rid="r1", computed=0, prompt=1024, outputs=0):
    return SimpleNamespace(
        request_id=rid,
        num_computed_tokens=computed,
        prompt_token_ids=list(range(prompt)),
        num_output_tokens=outputs,
    )


def scheduled(*new):
    """A step's scheduler output: the new requests and their own hits."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, num_computed_tokens=hit)
            for r, hit in new
        ]
    )


def test_the_timer_measures_a_local_prefill_from_its_own_hit_to_its_first_token():
    m, clock = model()
    timer = PrefillTimer(m, clock)
    r = req()  # vLLM sets num_computed_tokens only after the allocation
    timer.allocated(r, 0)
    timer.step(scheduled((r, 256)))  # its own hit, from the scheduler output
    r.num_computed_tokens = 1024  # ahead of the forward (0.32's order)
    clock.now += 0.3
    timer.step(scheduled())  # still prefilling: no token yet
    assert m.prefill_s(768) is None
    r.num_output_tokens = 1
    clock.now += 0.1
    timer.step(scheduled())
    assert m.prefill_s(768) == pytest.approx(0.4)  # 768 tokens in 0.4 s


def test_the_timer_skips_loaded_resumed_preempted_and_short_requests():
    m, clock = model()
    timer = PrefillTimer(m, clock)
    loaded = req("pushed")
    timer.allocated(loaded, 512)  # KV came from elsewhere: not a local prefill
    resumed = req("resumed", outputs=3)  # preempted after its first token
    timer.allocated(resumed, 0)
    pre = req("preempted")
    timer.allocated(pre, 0)
    short = req("tail")  # the last tokens after a load: a step's overhead, mostly
    timer.allocated(short, 0)
    timer.step(scheduled((loaded, 512), (resumed, 0), (pre, 0), (short, 1000)))
    timer.allocated(pre, 0)  # preempted and allocated again before its token
    timer.step(scheduled((pre, 0)))
    clock.now += 1.0
    for r in (loaded, resumed, pre, short):
        r.num_output_tokens = max(1, r.num_output_tokens)
    timer.step(scheduled())
    timer.finished(pre)
    assert m.prefill_s(1024) is None


def test_a_request_not_scheduled_as_new_is_not_timed():
    m, clock = model()
    timer = PrefillTimer(m, clock)
    r = req()
    timer.allocated(r, 0)
    timer.step(scheduled())  # no own hit known: dropped
    r.num_output_tokens = 1
    clock.now += 1.0
    timer.step(scheduled())
    assert m.prefill_s(1024) is None


def test_the_timer_times_a_request_that_finished_at_its_first_token():
    m, clock = model()
    timer = PrefillTimer(m, clock)
    one = req("max_tokens=1")
    timer.allocated(one, 0)
    timer.step(scheduled((one, 0)))
    clock.now += 0.5
    one.num_output_tokens = 1
    timer.finished(one)  # finished at its first token, before any later step
    assert m.prefill_s(1024) == pytest.approx(0.5)


def test_a_granted_push_is_held_only_to_the_minimum():
    m, _ = measured(push_s=0.5, blocks=8, prefill_s=0.2)
    assert m.decide(SRC, 8, 128).decision is Decision.NOT_WORTH_IT
    assert m.decide(SRC, 8, 128, judge=False).decision is None
    m.min_tokens = 256
    assert m.decide(SRC, 1, 128, judge=False).decision is Decision.BELOW_MINIMUM


def test_the_always_policy_keeps_only_the_minimum():
    m, _ = measured(push_s=5.0, blocks=8, prefill_s=0.2)
    m.always = True
    assert m.decide(SRC, 8, 128).decision is None  # slower, pushed all the same
    m.min_tokens = 2048
    assert m.decide(SRC, 8, 128).decision is Decision.BELOW_MINIMUM


# ---- the source's load ----------------------------------------------------------------
def test_pushes_in_flight_at_the_source_share_its_link():
    """Alone, 8 blocks take 0.04 s beyond the round trip: with n pushes in flight
    each block is expected to take n + 1 times as long."""
    m, _ = measured(push_s=0.05, blocks=8, rtt_s=0.01, prefill_s=0.2, tokens=1024)
    three = SourceLoad(pushes_in_flight=3, push_slots=8)
    assert m.transfer_s(SRC, 8, three) == pytest.approx(0.01 + 4 * 0.04)
    assert m.decide(SRC, 8, 128, load=three).decision is None  # 0.17 < 0.2
    five = SourceLoad(pushes_in_flight=5, push_slots=8)
    est = m.decide(SRC, 8, 128, load=five)  # 0.25 >= 0.2
    assert est.decision is Decision.NOT_WORTH_IT
    assert est.transfer_s == pytest.approx(0.25)
    # a push measured while 3 others shared the link counts as one alone
    m2, _ = model()
    m2.observe_round_trip(SRC, 0.01)
    m2.observe_push(SRC, 8, 0.01 + 4 * 0.04, three)
    assert m2.transfer_s(SRC, 8) == pytest.approx(0.05)


def test_a_source_with_every_slot_taken_is_refused_whatever_the_policy():
    full = SourceLoad(pushes_in_flight=4, push_slots=4)
    for always in (False, True):
        m = PushCostModel(0, Clock(), always=always)
        assert m.decide(SRC, 8, 128, load=full).decision is Decision.REFUSED
        assert m.decide(SRC, 8, 128, judge=False, load=full).decision is (
            Decision.REFUSED
        )
        assert m.decide(SRC, 8, 128, load=SourceLoad(3, 4)).decision is None
    # slots unknown (an older source): never full
    assert model()[0].decide(SRC, 8, 128, load=SourceLoad(99)).decision is None


def test_a_push_is_measured_apart_while_its_source_prefills():
    """Pushes from a source busy with its own prefills were slow; from the same
    source idle, fast: each state is judged on its own figure, and a state not
    measured yet on the other's."""
    prefilling = SourceLoad(backlog_tokens=20_000)
    m, _ = model()
    m.observe_round_trip(SRC, 0.01)
    m.observe_prefill(1024, 0.2)
    m.observe_push(SRC, 8, 0.05)  # idle: 0.05 s
    assert m.decide(SRC, 8, 128, load=prefilling).decision is None  # idle's figure
    m.observe_push(SRC, 8, 0.81, prefilling)  # prefilling: 0.81 s
    assert m.decide(SRC, 8, 128, load=prefilling).decision is Decision.NOT_WORTH_IT
    assert m.decide(SRC, 8, 128).decision is None
    assert m.transfer_s(SRC, 8, prefilling) == pytest.approx(0.81)
    assert m.transfer_s(SRC, 8) == pytest.approx(0.05)


def test_a_granted_push_is_judged_again_only_when_its_source_is_loaded():
    """auto: granted on the index before the source's answer; the answer's load
    can still turn it down, an idle answer cannot (nor under "always")."""
    m, _ = measured(push_s=0.05, blocks=8, rtt_s=0.01, prefill_s=0.2, tokens=1024)
    loaded = SourceLoad(pushes_in_flight=5, push_slots=8)
    assert m.decide(SRC, 8, 128, judge=False).decision is None
    assert m.decide(SRC, 8, 128, judge=False, load=loaded).decision is (
        Decision.NOT_WORTH_IT
    )
    m.always = True
    assert m.decide(SRC, 8, 128, judge=False, load=loaded).decision is None


def test_a_loaded_sources_budget_is_longer():
    m, _ = measured(push_s=0.05, blocks=8, rtt_s=0.01, prefill_s=0.2, tokens=1024)
    idle = m.budget_s(SRC, 8, 30.0)
    shared = m.budget_s(SRC, 8, 30.0, SourceLoad(pushes_in_flight=3, push_slots=8))
    assert shared == pytest.approx(idle + 4.0 * 3 * 0.04)


def test_a_push_costs_its_tail_the_step_after_it_landed():
    """A landed push's request computes its own tokens one scheduler step after
    the worker's report; a local prefill computes them in its first step. With
    decode streams that step is long: a short push measured at 20 ms to its
    report, against a 22 ms local prefill, is not worth it once its tail of 25 ms
    is counted (measured on this project's CPU host: 512 tokens pushed under
    load took 2.35x their local prefill)."""
    m, clock = measured(push_s=0.02, blocks=4, rtt_s=0.005, prefill_s=0.022, tokens=512)
    assert m.decide(SRC, 4, 128).decision is None  # the write alone: 20 ms < 22 ms
    timer = PrefillTimer(m, clock)
    for i in range(TAIL_MIN_SAMPLES):
        r = req(f"pushed-{i}", computed=512, prompt=600)
        timer.landed(r)  # the worker's report
        clock.now += 0.01
        timer.step(scheduled((r, 512)))  # scheduled: its tail computes in this step
        assert m.transfer_s(SRC, 4) == pytest.approx(0.02)  # not counted yet
        clock.now += 0.015
        r.num_output_tokens = 1
        timer.step(scheduled())
    est = m.decide(SRC, 4, 128)
    # the tail less its own 88 tokens' local prefill (22 ms a 512)
    assert est.transfer_s == pytest.approx(0.02 + 0.025 - 88 * 0.022 / 512)
    assert est.decision is Decision.NOT_WORTH_IT
    # a long push still pays: 32 blocks, 0.005 + 32 x 3.75 ms + 25 ms, against 0.2 s
    m.observe_prefill(4096, 0.2)
    assert m.decide(SRC, 32, 128).decision is None
    # the budget (how long the source may take to start writing) is the write's
    assert m.budget_s(SRC, 4, 30.0) == pytest.approx(4 * 0.02 + 0.005 + 5.0)


def test_a_tail_leaves_out_the_requests_own_tokens():
    """A landed push's request computes its suffix (a turn's new message) before
    its first token, as a local prefill of it would: the tail counts only what the
    push added. Measured with the suffix in it, a loaded D's tails of seconds made
    every later push "not worth it", 17k-token prefixes included."""
    m, clock = measured(push_s=0.05, blocks=40, rtt_s=0.01, prefill_s=2.0, tokens=20000)
    timer = PrefillTimer(m, clock)
    r = req("turn-2", prompt=24000)
    timer.landed(r)
    clock.now += 0.01
    timer.step(scheduled((r, 4000)))  # 4,000 tokens held: 20,000 of its own
    clock.now += 2.04  # 2.0 s of them at D's measured 100 us a token, and a step
    r.num_output_tokens = 1
    timer.step(scheduled())
    assert m._tails[-1] == pytest.approx(0.05)
    # 40 blocks (5,120 tokens) pushed in 0.01 + 0.05 + 0.05 s against 0.51 s here
    est = m.decide(SRC, 40, 128)
    assert est.decision is None, est


def test_a_tail_is_timed_only_to_a_first_token():
    m, clock = model()
    timer = PrefillTimer(m, clock)
    gone = req("aborted", computed=512, prompt=600)
    timer.landed(gone)
    clock.now += 1.0
    timer.finished(gone)  # finished without a token: nothing to time
    done = req("max_tokens=1", computed=512, prompt=600)
    timer.landed(done)
    clock.now += 0.03
    done.num_output_tokens = 1
    timer.finished(done)  # finished at its first token, before any later step
    assert list(m._tails) == [pytest.approx(0.03)]
    assert not timer._tails


def test_a_local_prefill_weighs_the_requests_it_delays():
    """On a saturated D a local prefill takes the compute of every request whose
    prompt is not computed yet; a push's write does not. A push dearer than one
    local prefill pays when it spares the queue behind it."""
    m, _ = measured(push_s=0.5, blocks=8, rtt_s=0.01, prefill_s=0.2, tokens=1024)
    assert m.decide(SRC, 8, 128).decision is Decision.NOT_WORTH_IT
    assert m.decide(SRC, 8, 128, queued=1).decision is Decision.NOT_WORTH_IT  # 0.4 s
    est = m.decide(SRC, 8, 128, queued=2)
    assert est.decision is None and est.prefill_s == pytest.approx(0.6)
    # granted on the index, judged again on a loaded source's answer: the same
    busy = SourceLoad(backlog_tokens=5000)
    m.observe_push(SRC, 8, 0.5, busy)
    assert m.decide(SRC, 8, 128, judge=False, load=busy).decision is (
        Decision.NOT_WORTH_IT
    )
    assert m.decide(SRC, 8, 128, judge=False, load=busy, queued=3).decision is None
    # a bounded weight: a client cannot make every prefill infinitely dear
    assert m.local_cost_s(1024, 10**9) == pytest.approx(0.2 * (1 + MAX_QUEUED))
    assert m.local_cost_s(1024, -5) == pytest.approx(0.2)


def prefill_measured_at(*rates):
    """D measured fresh prefills: (tokens, seconds a token) each."""
    m, clock = model()
    for tokens, rate in rates:
        m.observe_prefill(tokens, tokens * rate)
    return m, clock


def test_a_tail_leaves_out_its_own_tokens_as_they_attend_to_the_held_ones():
    """A landed push's own tokens attend to the held prefix: after 1,024 held
    tokens, its own 1,024 cost what a fresh prefill of 2,048 costs more than one
    of 1,024 (0.3072 s at 100 and 200 us a token), not a fresh 1,024's 0.1024 s.
    Timed as the latter, a turn of 7.5k tokens after 7.5k held read 1.4 s more
    tail than there was, and D judged pushes of 4 blocks to take 2 s."""
    m, clock = prefill_measured_at((1024, 1e-4), (2048, 2e-4))
    timer = PrefillTimer(m, clock)
    r = req("turn-2", prompt=2048)
    timer.landed(r)
    timer.step(scheduled((r, 1024)))  # 1,024 held: 1,024 of its own
    clock.now += 0.3072 + 0.05  # its own tokens, and 50 ms the push added
    r.num_output_tokens = 1
    timer.step(scheduled())
    assert m._tails[-1] == pytest.approx(0.05)


def test_a_local_prefill_after_a_cached_prefix_is_timed_as_a_fresh_one_of_both():
    """1,024 tokens computed after 1,024 cached in 0.3072 s: a fresh prefill of
    2,048 takes that and the cached part's 0.1024 s; a fresh 1,024's time stays."""
    m, clock = prefill_measured_at((1024, 1e-4))
    timer = PrefillTimer(m, clock)
    r = req("turn-2", prompt=2048)
    timer.allocated(r, 0)
    timer.step(scheduled((r, 1024)))
    clock.now += 0.3072
    r.num_output_tokens = 1
    timer.step(scheduled())
    assert m.prefill_s(1024) == pytest.approx(0.1024)
    assert m.prefill_s(2048) == pytest.approx(0.4096)


def test_a_push_after_tokens_d_holds_saves_what_they_would_cost_there():
    """8 blocks (1,024 tokens) pushed in 0.2 s: not worth it from the prompt's
    start (a fresh 1,024 takes 0.1024 s), worth it after 1,024 tokens D holds
    (0.3072 s there)."""
    m, _ = prefill_measured_at((1024, 1e-4), (2048, 2e-4))
    m.observe_round_trip(SRC, 0.0)
    m.observe_push(SRC, 8, 0.2)
    assert m.decide(SRC, 8, 128).decision is Decision.NOT_WORTH_IT
    est = m.decide(SRC, 8, 128, start=1024)
    assert est.decision is None and est.prefill_s == pytest.approx(0.3072)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 4096), st.floats(0.0, 60.0)), min_size=1, max_size=40
    )
)
def test_a_pushs_expected_time_is_never_negative_and_grows_with_its_blocks(pushes):
    m, _ = model()
    m.observe_round_trip(SRC, 0.0)
    for blocks, seconds in pushes:
        m.observe_push(SRC, blocks, seconds)
    times = [m.write_s(SRC, n, SourceLoad()) for n in (1, 2, 16, 256, 4096, 65536)]
    assert all(t is not None and math.isfinite(t) and t >= 0 for t in times)
    assert times == sorted(times)
    longest = max(seconds for _, seconds in pushes)
    # within what was measured, no more than the slowest push
    assert m.write_s(SRC, min(b for b, _ in pushes), SourceLoad()) <= longest + 1e-9
