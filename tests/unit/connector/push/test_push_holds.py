"""How long D keeps a push's blocks when C does not answer, and what makes
that bound hold: C's clock measured by D, a relative budget next to the
absolute deadline, C's own engine timeout and the bytes of the write.

C is a real PushServer on 127.0.0.1 (uvicorn in a thread) whose transfer
engine is a logging memmove (helpers.CServer); D is the real
PushScheduler and PushReceiver."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from helpers import (
    BLEN,
    BS,
    C_BLOCKS,
    C_SOURCE,
    D_SESSION,
    FP,
    HCFG,
    NBLK,
    SCHED_FP,
    TOKENS,
    Blocks,
    Clock,
    CServer,
    ask,
    d_request,
    filled_mirror,
    match_answer,
    push_job,
    serve_push,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.write_bounds import (
    stalled_delivery_bound_s,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    PushJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_server import (
    PushServer,
)


def c_request(url: str, rid: str = "r1") -> SimpleNamespace:
    """A request D pushes from C: TOKENS, whose 3 full blocks C holds."""
    r = d_request(rid, source=url)
    r.prompt_token_ids = list(TOKENS)
    return r


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- D measures C's clock ------------------------------------------------------------


@pytest.mark.parametrize("offset_s", [60, -60])
def test_a_source_whose_clock_is_a_minute_off_is_refused_and_nothing_is_written(
    c_server, caplog, offset_s
):
    c = c_server()
    c.server._now_ms = lambda: int((time.time() + offset_s) * 1000)
    d = c.destination()
    sched = PushScheduler(
        BS, ExtConfig(push_min_tokens=0, push_sources=(c.url,)), SCHED_FP
    )
    r = c_request(c.url)
    with caplog.at_level(logging.WARNING):
        got = ask(sched, r)
    assert got == (0, False), "D pushes from a source whose clock is a minute off"
    assert sched.take_jobs() == [] and c.engine.log == [] and d.untouched()
    (warning,) = [w for w in warnings_of(caplog) if r.request_id in w]
    assert "MOONCAKE_PUSH_CLOCK_SKEW_S" in warning, warning
    assert re.search(r"\b(59\.9|60\.0|60\.1) s\b", warning), warning
    assert ("ahead of" if offset_s > 0 else "behind") in warning
    assert sched.stats["refused_clock_skew"] == 1 and sched.stats["match_failed"] == 0


def test_a_source_within_the_allowance_is_pushed_from(c_server):
    c = c_server()
    c.server._now_ms = lambda: int((time.time() + 3) * 1000)
    sched = PushScheduler(
        BS, ExtConfig(push_min_tokens=0, push_sources=(c.url,)), SCHED_FP
    )
    assert ask(sched, c_request(c.url)) == (3 * BS, True)
    assert sched.stats["refused_clock_skew"] == 0


def test_the_round_trip_counts_against_the_allowance():
    """C's clock is 2 s ahead. Answered in 1 ms: within 5 s. Answered after 7 s
    (C read its clock somewhere in that round trip, so it could be 5.5 s
    off): no push."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.peer_client import (
        Answer,
    )

    wall = [1_700_000_000.0]

    def ask_with_round_trip(round_trip_s):
        sched = PushScheduler(
            BS,
            ExtConfig(
                push_min_tokens=0, push_sources=("http://c:9000",), push_clock_skew_s=5
            ),
            SCHED_FP,
            wall_clock=lambda: wall[0],
        )

        def post(source, path, content, headers, deadline):
            c_now = wall[0] + round_trip_s / 2 + 2
            wall[0] += round_trip_s
            return Answer(200, match_answer(now_unix_ms=int(c_now * 1000)))

        sched._lanes.post = post
        try:
            return ask(sched, d_request()), sched.stats["refused_clock_skew"]
        finally:
            sched.shutdown()

    assert ask_with_round_trip(0.001) == ((4 * BS, True), 0)
    assert ask_with_round_trip(7.0) == ((0, False), 1)


# ---- C: the budget next to the deadline ----------------------------------------------


def test_c_with_a_clock_a_minute_behind_starts_no_write_once_the_budget_passed(
    c_server,
):
    """C's clock runs 60 s behind D's and C takes longer than the push's timeout
    to get to the write (here: its match is slow). By its own clock the deadline
    is far ahead; by D's it has passed and D may have given the blocks away. C
    must not write."""
    c = c_server()
    c.server._now_ms = lambda: int((time.time() - 60) * 1000)
    match = c.server.sync.match

    def slow_match(*args):
        time.sleep(1.5)
        return match(*args)

    c.server.sync.match = slow_match
    d = c.destination()
    cfg = ExtConfig(push_timeout_s=0.5, push_clock_skew_s=0.2)
    rec = PushReceiver(D_SESSION, d.bases, BLEN, BS, NBLK, FP, cfg)
    rec.start([push_job("r1", c.url, (3, 4, 7))])
    end = time.monotonic() + 10
    while not rec.merge_finished(None) and time.monotonic() < end:
        time.sleep(0.01)
    assert c.engine.log == [] and d.untouched(), (
        "C wrote after the push's budget had passed"
    )
    assert rec.take_outcome().landed == {"r1": 0}
    assert c.server.stats["past_deadline"] == 1
    getattr(rec, "shutdown", lambda: None)()


# ---- the hold: C's engine timeout and the bytes -------------------------------------

BIG_BLEN = 1 << 30  # bytes per block per KV tensor: 3 blocks x 2 tensors = 6 GiB


def test_the_hold_covers_the_sources_engine_timeout_and_the_bytes():
    """C runs with MC_TRANSFER_TIMEOUT=60, D with 5; the push asks for 6 GiB. C
    takes the request and does not answer (its write hangs). D must keep the
    blocks for its budget + C's bound on a 6 GiB write with C's 60 s (handshake,
    timeout, 1 ns a byte, no-progress watchdog) + the skew allowance, not for
    its own 5 s."""
    fp = FP.model_copy(update={"block_len": BIG_BLEN})
    c_cfg = ExtConfig.from_env(
        {
            "MC_TRANSFER_TIMEOUT": "60",
            "MOONCAKE_BOOTSTRAP_HOST": "127.0.0.1",
            "MOONCAKE_LAYERWISE_TIMEOUT_S": "200",
        }
    )
    sync = filled_mirror(BS, TOKENS, C_BLOCKS, HCFG)
    gate, writing = threading.Event(), threading.Event()

    def hanging_write(
        session, src, dst, lens, layout=None
    ):  # no (fake) address touched
        writing.set()
        gate.wait(60)
        return -1

    server = PushServer(
        sync,
        hanging_write,
        [1 << 40, 2 << 40],
        BIG_BLEN,
        fp,
        "127.0.0.1:1",
        c_cfg,
        source_id=C_SOURCE,
    )
    url, stop = serve_push(server)
    d_cfg = ExtConfig(
        push_min_tokens=0,
        push_timeout_s=2,
        push_clock_skew_s=1,
        engine_transfer_timeout_s=5,
        push_sources=(url,),
    )
    sched = PushScheduler(BS, d_cfg, SCHED_FP)
    clock = Clock()
    rec = PushReceiver(
        D_SESSION, [3 << 40, 4 << 40], BIG_BLEN, BS, NBLK, fp, d_cfg, clock=clock
    )
    try:
        r = c_request(url)
        assert ask(sched, r) == (3 * BS, True)
        sched.update_state_after_alloc(r, Blocks([3, 4, 7]), 3 * BS)
        (job,) = sched.take_jobs()
        rec.start([job])
        assert writing.wait(10), "C did not start the write"
        nbytes = 3 * 2 * BIG_BLEN
        c_bound = ExtConfig(engine_transfer_timeout_s=60).engine_write_bound_s(nbytes)
        hold = 2 + c_bound + 1
        assert hold > 2 + 60 + 6 + 1  # the bytes term and C's timeout are in it
        clock.now += hold - 0.25
        assert rec.merge_finished(None) is None, (
            "D ended the push (freeing its blocks) while C's write could still land"
        )
        clock.now += 0.5
        assert rec.merge_finished(None) == {"r1"}
        assert rec.take_outcome().landed == {"r1": 0}
    finally:
        gate.set()
        time.sleep(0.2)
        for x in (sched, rec):
            getattr(x, "shutdown", lambda: None)()
        stop()


def test_c_reports_its_engine_timeout_and_clock():
    c = CServer(
        ExtConfig.from_env(
            {"MC_TRANSFER_TIMEOUT": "45", "MOONCAKE_BOOTSTRAP_HOST": "127.0.0.1"}
        )
    )
    try:
        before = int(time.time() * 1000)
        out = c.post("/match_blocks", {"token_ids": TOKENS}).json()
        after = int(time.time() * 1000)
        assert out["engine_timeout_s"] == 45 and before <= out["now_unix_ms"] <= after
    finally:
        c.close()


def test_the_push_request_carries_its_budget_beside_the_deadline():
    seen = []
    c = CServer(ExtConfig(bootstrap_host="127.0.0.1"))
    push = c.server.push

    def spy(payload, *args, **kw):
        seen.append(json.loads(payload))
        return push(payload, *args, **kw)

    c.server.push = spy
    d = c.destination()
    rec = PushReceiver(
        D_SESSION,
        d.bases,
        BLEN,
        BS,
        NBLK,
        FP,
        ExtConfig(push_timeout_s=30),
        clock=Clock(),
    )
    try:
        rec.start([push_job("r1", c.url, (3, 4, 7))])
        end = time.monotonic() + 10
        while not rec.merge_finished(None) and time.monotonic() < end:
            time.sleep(0.01)
        assert rec.take_outcome().landed == {"r1": 3}
        (body,) = seen
        assert body["budget_ms"] == 30_000 and body["deadline_unix_ms"] > 0
    finally:
        rec.shutdown()
        c.close()


@pytest.mark.parametrize(
    ("reported", "pushed"), [(120, True), (121, False), (3600, False)]
)
def test_a_source_reporting_a_longer_engine_timeout_than_d_accepts_is_not_pushed_from(
    c_server, caplog, reported, pushed
):
    """C says its MC_TRANSFER_TIMEOUT is ``reported`` s. D holds a push's blocks
    for C's write bound, which grows with it: beyond what D accepts (120 s by
    default) D prefills locally and says why, naming both values."""
    c = c_server()
    c.server.engine_timeout_s = reported
    d_cfg = ExtConfig.from_env(
        {"MOONCAKE_PUSH_SOURCES": c.url, "MOONCAKE_PUSH_MIN_TOKENS": "0"}
    )
    assert d_cfg.push_source_timeout_max_s == 120
    sched = PushScheduler(BS, d_cfg, SCHED_FP)
    with caplog.at_level(logging.WARNING):
        got = ask(sched, c_request(c.url))
    assert got == ((3 * BS, True) if pushed else (0, False))
    if not pushed:
        assert sched.take_jobs() == [] and c.engine.log == []
        (warning,) = [w for w in warnings_of(caplog) if "MC_TRANSFER_TIMEOUT" in w]
        assert f"{reported} s" in warning and "1 .. 120 s" in warning, warning
        assert "MOONCAKE_PUSH_SOURCE_TIMEOUT_MAX_S" in warning


def test_d_accepts_a_source_with_its_own_engine_timeout_when_that_is_longer():
    cfg = ExtConfig.from_env({"MC_TRANSFER_TIMEOUT": "300"})
    assert cfg.push_source_timeout_max_s == 300
    assert (
        ExtConfig.from_env(
            {"MOONCAKE_PUSH_SOURCE_TIMEOUT_MAX_S": "40"}
        ).push_source_timeout_max_s
        == 40
    )


def push_job_from(c, caplog, **d_env: str) -> tuple[tuple, PushJob | None, ExtConfig]:
    """D (its kernel's default orphan retries, ``d_env`` added) asks C for a
    prompt of 3 full blocks: (what the scheduler answered, the push job it made or
    None, D's configuration)."""
    d_cfg = replace(
        ExtConfig.from_env(
            {"MOONCAKE_PUSH_SOURCES": c.url, "MOONCAKE_PUSH_MIN_TOKENS": "0", **d_env}
        ),
        tcp_orphan_retries=8,
    )
    sched = PushScheduler(BS, d_cfg, SCHED_FP)
    r = c_request(c.url)
    with caplog.at_level(logging.WARNING):
        got = ask(sched, r)
    if got[0] == 0:
        assert sched.take_jobs() == [] and c.engine.log == []
        return got, None, d_cfg
    sched.update_state_after_alloc(r, Blocks([3, 4, 7]), 3 * BS)
    (job,) = sched.take_jobs()
    return got, job, d_cfg


PUSHED_BYTES = 3 * (1 << 20)  # push_job_from's 3 blocks of D's one 1 MiB layer


def held_for(d_cfg: ExtConfig, job, stalled_s: float) -> float:
    """D's hold for ``job``: the push's deadline, then C's bound on its write (the
    handshake, C's engine timeout, the bytes, and ``stalled_s``: how long after a
    stall its bytes can still land), then the clock skew allowed."""
    return (
        d_cfg.push_timeout_s
        + 5
        + job.source_engine_timeout_s
        + PUSHED_BYTES * 1e-9
        + stalled_s
        + d_cfg.push_clock_skew_s
    )


@pytest.mark.parametrize(
    ("reported", "pushed"), [(1, True), (8, True), (9, False), (255, False)]
)
def test_the_hold_follows_the_sources_kernel_and_refuses_one_beyond_what_d_accepts(
    c_server, caplog, reported, pushed
):
    """C says its kernel retries orphaned connections ``reported`` times: a write
    of C's cut off mid-way can land in D's blocks that much later, so D's hold for
    the push is computed with it; beyond the kernel's default (or D's own, if
    larger) D prefills locally and says why."""
    c = c_server()
    # C's reconnect shorter than its orphans' (ExtConfig.engine_reconnect_s)
    c.server.config = replace(
        c.server.config, tcp_orphan_retries=reported, engine_reconnect_s=1
    )
    got, job, d_cfg = push_job_from(c, caplog)
    assert got == ((3 * BS, True) if pushed else (0, False))
    if pushed:
        assert job.source_tcp_orphan_retries == reported
        rec = PushReceiver(D_SESSION, [3 << 40], 1 << 20, BS, NBLK, FP, d_cfg)
        try:
            assert rec.hold_s(job) == d_cfg.push_hold_for_s(
                PUSHED_BYTES, job.source_engine_timeout_s, reported, None, 1
            )
            assert rec.hold_s(job) == pytest.approx(
                held_for(d_cfg, job, stalled_delivery_bound_s(reported))
            )
        finally:
            rec.shutdown()
    else:
        (warning,) = [w for w in warnings_of(caplog) if "tcp_orphan_retries" in w]
        assert f"={reported}" in warning and "1 .. 8" in warning, warning


@pytest.mark.parametrize(
    ("reported", "pushed"), [(5, True), (200, True), (300, True), (301, False)]
)
def test_the_hold_follows_the_sources_transport_watchdog(
    c_server, caplog, reported, pushed
):
    """C's transport keeps a stalled connection, and what it had queued, for
    ``reported`` s (its MC_TCP_PROGRESS_TIMEOUT_SEC / MC_TCP_STATUS_TIMEOUT_SEC)
    before it drops it: a write of C's can land in D's blocks that much later, so
    D's hold for the push is computed with it; beyond what D accepts (here 300 s)
    D prefills locally and says why."""
    c = c_server()
    c.server.config = replace(
        c.server.config,
        engine_no_progress_s=reported,
        tcp_orphan_retries=1,
        engine_reconnect_s=1,
    )
    got, job, d_cfg = push_job_from(c, caplog, MOONCAKE_PUSH_SOURCE_TIMEOUT_MAX_S="300")
    assert got == ((3 * BS, True) if pushed else (0, False))
    if not pushed:
        (warning,) = [w for w in warnings_of(caplog) if "no-progress watchdog" in w]
        assert f"{reported} s" in warning and "1 .. 300 s" in warning, warning
        return
    assert job.source_engine_no_progress_s == reported
    rec = PushReceiver(D_SESSION, [3 << 40], 1 << 20, BS, NBLK, FP, d_cfg)
    try:
        assert rec.hold_s(job) == pytest.approx(
            held_for(d_cfg, job, stalled_delivery_bound_s(1, reported))
        )
        if reported > 30:  # what D held for before: C's write could outlive it
            assert rec.hold_s(job) > d_cfg.push_timeout_s + reported + min(
                reported, 120
            )
    finally:
        rec.shutdown()


@pytest.mark.parametrize(
    ("reported", "pushed"), [(136, True), (544, True), (545, False), (0, False)]
)
def test_the_hold_follows_the_sources_reconnect(c_server, caplog, reported, pushed):
    """Once C's transport dropped a stalled connection it connects to D again for
    the write's queued slices, for up to ``reported`` s (its lanes, each a SYN
    span): a write of C's can land in D's blocks until then, so D's hold for the
    push is computed with it; beyond what D accepts (the engine's default four
    lanes with the kernel's defaults, 544 s) D prefills locally and says why."""
    c = c_server()
    c.server.config = replace(
        c.server.config, tcp_orphan_retries=1, engine_reconnect_s=reported
    )
    got, job, d_cfg = push_job_from(c, caplog)
    assert got == ((3 * BS, True) if pushed else (0, False))
    if not pushed:
        (warning,) = [w for w in warnings_of(caplog) if "reconnect" in w]
        assert f"{reported} s" in warning and "1 .. 544 s" in warning, warning
        return
    assert job.source_engine_reconnect_s == reported
    rec = PushReceiver(D_SESSION, [3 << 40], 1 << 20, BS, NBLK, FP, d_cfg)
    try:
        assert rec.hold_s(job) == pytest.approx(
            held_for(d_cfg, job, job.source_engine_no_progress_s + reported)
        )
    finally:
        rec.shutdown()
