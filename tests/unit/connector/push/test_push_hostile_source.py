"""A hostile push source answering D's scheduler and receiver: every number in its
answers is clamped or ignored, and D counts only blocks it can prove landed.

In-process HTTP; no vLLM instance.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi import (
    FastAPI,
    Request,
)  # module level: FastAPI resolves annotations by name
from fastapi.responses import Response
from helpers import (
    BLEN,
    BS,
    D_SESSION,
    FP,
    KV,
    NBLK,
    SCHED_FP,
    SLOTS,
    TOKEN,
    Blocks,
    Clock,
    Raw,
    ask,
    d_request,
    dumps,
    fresh,
    match_answer,
    push_job,
    serve,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    SOURCE_REFUSAL,
    PushBlocksResponse,
)


class HostileC:
    """A fake C whose /match_blocks and /push_blocks answer what the test sets."""

    def __init__(self):
        self.match = (200, b"{}")
        self.push = (200, b"{}")
        self.seen: list[tuple[str, dict, bytes]] = []
        self.answered = threading.Event()
        app = FastAPI()

        async def match_blocks(request: Request):
            self.seen.append(("match", dict(request.headers), await request.body()))
            return Response(
                fresh(self.match[1]), self.match[0], media_type="application/json"
            )

        async def push_blocks(request: Request):
            self.seen.append(("push", dict(request.headers), await request.body()))
            self.answered.set()
            status, body = self.push[:2]
            headers = self.push[2] if len(self.push) > 2 else None
            return Response(
                body, status, headers=headers, media_type="application/json"
            )

        app.post("/match_blocks")(match_blocks)
        app.post("/push_blocks")(push_blocks)
        self.url, self.stop = serve(app)


@pytest.fixture(scope="module")
def hostile():
    h = HostileC()
    yield h
    h.stop()


def fp_with(**over):
    return FP.model_copy(update=over).model_dump()


HOSTILE_MATCHES = [  # (id, status, body, local tokens, expected)
    ("control", 200, match_answer(), 0, (4 * BS, True)),
    ("more than the prompt", 200, match_answer(matched_blocks=100), 0, (5 * BS, True)),
    (
        "more, after a local hit",
        200,
        match_answer(matched_blocks=100),
        2 * BS,
        (3 * BS, True),
    ),
    ("10**18", 200, match_answer(matched_blocks=10**18), 0, (5 * BS, True)),
    ("2**64", 200, match_answer(matched_blocks=2**64), 0, (5 * BS, True)),
    ("negative", 200, match_answer(matched_blocks=-3), 0, (0, False)),
    ("-10**18", 200, match_answer(matched_blocks=-(10**18)), 0, (0, False)),
    ("1e18", 200, match_answer(matched_blocks=Raw("1e18")), 0, (0, False)),
    ("float", 200, match_answer(matched_blocks=2.5), 0, (0, False)),
    ("float 4.0", 200, match_answer(matched_blocks=4.0), 0, (0, False)),
    ("string", 200, match_answer(matched_blocks="4"), 0, (0, False)),
    ("bool", 200, match_answer(matched_blocks=True), 0, (0, False)),
    ("null", 200, match_answer(matched_blocks=None), 0, (0, False)),
    ("NaN", 200, match_answer(matched_blocks=Raw("NaN")), 0, (0, False)),
    ("no matched_blocks", 200, match_answer(matched_blocks=...), 0, (0, False)),
    ("no fingerprint", 200, match_answer(fingerprint=...), 0, (0, False)),
    (
        "fingerprint block_size",
        200,
        match_answer(fingerprint=fp_with(block_size=2 * BS)),
        0,
        (0, False),
    ),
    (
        "fingerprint dtype",
        200,
        match_answer(fingerprint=fp_with(dtype="bfloat16/auto")),
        0,
        (0, False),
    ),
    (
        "fingerprint model",
        200,
        match_answer(fingerprint=fp_with(model="Other:1")),
        0,
        (0, False),
    ),
    (
        "fingerprint tp",
        200,
        match_answer(fingerprint=fp_with(tp_size=2)),
        0,
        (0, False),
    ),
    (
        "fingerprint extra",
        200,
        match_answer(fingerprint={**FP.model_dump(), "x": 1}),
        0,
        (0, False),
    ),
    ("fingerprint string", 200, match_answer(fingerprint="same"), 0, (0, False)),
    ("extra field", 200, match_answer(status="ok"), 0, (0, False)),
    ("500", 500, match_answer(), 0, (0, False)),
    ("401", 401, match_answer(), 0, (0, False)),
    ("not json", 200, b"<html>ok</html>", 0, (0, False)),
    ("empty", 200, b"", 0, (0, False)),
    ("array", 200, b"[" + match_answer() + b"]", 0, (0, False)),
    ("2 MiB", 200, match_answer(pad="x" * (2 << 20)), 0, (0, False)),
    ("deep", 200, b"[" * 50_000, 0, (0, False)),
]


@pytest.mark.parametrize(
    "name,status,body,local,expected",
    HOSTILE_MATCHES,
    ids=[h[0] for h in HOSTILE_MATCHES],
)
def test_hostile_match_answer_is_clamped_or_ignored(
    hostile, name, status, body, local, expected
):
    hostile.match = (status, body)
    sched = PushScheduler(
        BS,
        ExtConfig(
            push_min_tokens=0,
            push_match_timeout_s=5,
            push_sources=(hostile.url,),
            bootstrap_token=TOKEN,
        ),
        SCHED_FP,
    )
    hostile.seen.clear()
    r = d_request(source=hostile.url)
    got = ask(sched, r, local)  # never raises
    assert got == expected, (name, got, sched.stats)
    assert [s[0] for s in hostile.seen] == ["match"]
    assert hostile.seen[0][1].get("authorization").startswith("Mooncake-HMAC-SHA256 ")
    assert TOKEN not in json.dumps(
        hostile.seen[0][1]
    )  # signed: the token is never sent
    assert sched.stats["match_failed"] == (
        0 if got[1] or name in ("negative", "-10**18") else 1
    )
    if got[1]:  # the push asks for at most the prompt's full blocks
        sched.update_state_after_alloc(r, Blocks(list(range(100, 105))), got[0])
        (job,) = sched.take_jobs()
        assert job.first_block + len(job.dst_block_ids) <= 5


def push_answer(**over):
    b = {
        "status": "ok",
        "matched_blocks": 3,
        "matched_tokens": 3 * BS,
        "pushed_blocks": 3,
        "total_full_blocks": 3,
        "bytes": 3 * BLEN * SLOTS,
        "seconds": 0.01,
        "message": "",
    }
    b.update(over)
    return dumps(b)


HOSTILE_PUSHES = [  # (id, status, body, landed, answered: ends before the hold)
    ("control", 200, push_answer(), 3, True),
    ("fewer", 200, push_answer(pushed_blocks=2, bytes=2 * BLEN * SLOTS), 2, True),
    (
        "more than asked",
        200,
        push_answer(pushed_blocks=5, bytes=5 * BLEN * SLOTS),
        0,
        True,
    ),
    (
        "10**18 blocks",
        200,
        push_answer(pushed_blocks=10**18, bytes=10**18 * BLEN * SLOTS),
        0,
        True,
    ),
    ("negative", 200, push_answer(pushed_blocks=-1, bytes=-BLEN * SLOTS), 0, True),
    ("negative, 0 bytes", 200, push_answer(pushed_blocks=-1, bytes=0), 0, True),
    ("bytes -1", 200, push_answer(bytes=3 * BLEN * SLOTS - 1), 0, True),
    ("bytes +1", 200, push_answer(bytes=3 * BLEN * SLOTS + 1), 0, True),
    ("bytes 0", 200, push_answer(bytes=0), 0, True),
    ("one tensor's bytes", 200, push_answer(bytes=3 * BLEN), 0, True),
    ("failed", 200, push_answer(status="failed"), 0, True),
    ("no_match", 200, push_answer(status="no_match"), 0, True),
    ("409 refusal", (409, SOURCE_REFUSAL), push_answer(), 0, True),
    ("500 refusal", (500, SOURCE_REFUSAL), push_answer(), 0, True),
    # answers D cannot read, or that C's own code did not give (no refusal
    # header): C may still be writing, so only the hold ends them
    ("409", 409, push_answer(), 0, False),
    ("500", 500, push_answer(), 0, False),
    ("504", 504, b"<html>gateway time-out</html>", 0, False),
    ("float blocks", 200, push_answer(pushed_blocks=3.0), 0, False),
    ("string blocks", 200, push_answer(pushed_blocks="3"), 0, False),
    ("OK", 200, push_answer(status="OK"), 0, False),
    ("extra field", 200, push_answer(dst=1), 0, False),
    ("not json", 200, b"ok", 0, False),
]


@pytest.mark.parametrize(
    "name,status,body,landed,answered",
    HOSTILE_PUSHES,
    ids=[h[0] for h in HOSTILE_PUSHES],
)
def test_hostile_push_answer_lands_nothing_it_cannot_prove(
    hostile, name, status, body, landed, answered
):
    status, headers = status if isinstance(status, tuple) else (status, None)
    hostile.push = (status, body, headers)
    hostile.answered.clear()
    hostile.seen.clear()
    d = KV(fill=False)
    cfg = ExtConfig(
        push_timeout_s=1.0,
        engine_transfer_timeout_s=1.0,
        push_clock_skew_s=0.5,
        bootstrap_token=TOKEN,
    )
    clock = Clock()
    rec = PushReceiver(D_SESSION, d.bases, BLEN, BS, NBLK, FP, cfg, clock=clock)
    job = push_job("r1", hostile.url)
    rec.start([job])
    assert hostile.answered.wait(5)
    assert hostile.seen[0][1].get("authorization").startswith("Mooncake-HMAC-SHA256 ")
    assert TOKEN not in json.dumps(
        hostile.seen[0][1]
    )  # signed: the token is never sent
    sent = json.loads(hostile.seen[0][2])
    assert sent["dst_num_blocks"] == NBLK and sent["fingerprint"] == FP.model_dump()
    end = time.monotonic() + (5 if answered else 0.5)
    finished = None
    while time.monotonic() < end and not finished:
        finished = rec.merge_finished(None)
        time.sleep(0.01)
    if not answered:
        assert finished is None, "an unreadable answer ended the push before the hold"
        clock.now += rec.hold_s(job)
        finished = rec.merge_finished(None)
    assert finished == {"r1"}
    assert rec.take_outcome().landed == {"r1": landed}


@pytest.mark.parametrize(
    "pushed,nbytes,expected",
    [
        (3, 3 * BLEN * SLOTS, 3),
        (0, 0, 0),
        (1, BLEN * SLOTS, 1),
        (4, 4 * BLEN * SLOTS, 0),
        (-1, -BLEN * SLOTS, 0),
        (3, 3 * BLEN * SLOTS + 7, 0),
        (3, 0, 0),
        (2**70, 2**70 * BLEN * SLOTS, 0),
    ],
)
def test_proven_blocks(pushed, nbytes, expected):
    rec = PushReceiver(D_SESSION, [1 << 20, 2 << 20], BLEN, BS, NBLK, FP, ExtConfig())
    job = push_job("r1", "http://c:9000")
    resp = PushBlocksResponse(status="ok", pushed_blocks=pushed, bytes=nbytes)
    assert rec.proven_blocks(job, resp) == expected
