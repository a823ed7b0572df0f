"""D ends a push early only on the source's own refusals.

C's routes mark every answer other than 200 that they give before any write of
the request started (authentication, validation, a busy or unready server) with
protocol.SOURCE_REFUSAL_HEADER. Any other answer (a TLS proxy's 502 or 504 while
C's write may still run, a 500) leaves the push's blocks with the request until
its hold has passed. C is served by routes.py on 127.0.0.1 (helpers.CServer,
serve_routes); D is the real PushReceiver with an injected clock."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from helpers import (
    BLEN,
    BS,
    D_SESSION,
    FP,
    NBLK,
    TOKENS,
    Clock,
    push_job,
    serve,
    serve_routes,
    wait_until,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    SOURCE_REFUSAL_HEADER,
    PushJob,
    is_source_refusal,
)

TOKEN = ExtConfig(bootstrap_host="127.0.0.1", bootstrap_token="t0ken-for-refusals")


# ---- C marks its refusals, and only those --------------------------------------------


def test_every_refusal_of_the_source_is_marked_and_an_answer_is_not(c_server):
    c = c_server(TOKEN)
    unsigned = c.post("/push_blocks", b"{}", headers={})
    too_large = c.post("/push_blocks", b" " * (TOKEN.push_max_body_bytes + 1))
    malformed = c.post("/push_blocks", {"token_ids": "not a list"})
    answered = c.post("/match_blocks", {"token_ids": TOKENS})
    got = {
        r.status_code: r.headers.get(SOURCE_REFUSAL_HEADER)
        for r in (unsigned, too_large, malformed, answered)
    }
    assert got == {
        401: "nothing-written",
        413: "nothing-written",
        422: "nothing-written",
        200: None,
    }, got


def test_a_source_not_serving_yet_and_a_busy_source_are_refusals(c_server):
    cfg = ExtConfig(bootstrap_host="127.0.0.1", push_max_concurrent=1)
    url, stop = serve_routes(cfg, push=None)
    try:
        r = httpx.post(url + "/push_blocks", content=b'{"token_ids": [1]}', timeout=10)
    finally:
        stop()
    assert r.status_code == 503
    assert is_source_refusal(r.status_code, dict(r.headers))
    c = c_server(cfg)
    assert c.server.try_begin()  # the only push slot is taken
    busy = c.post("/push_blocks", {"token_ids": TOKENS})
    assert busy.status_code == 429
    assert is_source_refusal(busy.status_code, dict(busy.headers))


def test_only_the_marker_with_a_status_other_than_200_is_a_refusal():
    marked = {SOURCE_REFUSAL_HEADER: "nothing-written"}
    assert is_source_refusal(429, marked)
    assert not is_source_refusal(504, {})
    assert not is_source_refusal(502, {SOURCE_REFUSAL_HEADER: "yes"})
    assert not is_source_refusal(200, marked)


# ---- D: a proxy's answer keeps the hold; the source's refusal ends it ------------------


class FixedAnswer:
    """A push source whose /push_blocks answers ``status`` with ``headers``."""

    def __init__(self, status: int, headers: dict[str, str]):
        self.asked = threading.Event()
        app = FastAPI()

        async def push_blocks(request: Request):
            await request.body()
            self.asked.set()
            return Response(b"<html>gateway</html>", status, headers=headers)

        app.post("/push_blocks")(push_blocks)
        self.url, self.stop = serve(app)


def receiver(clock: Clock) -> PushReceiver:
    return PushReceiver(
        D_SESSION,
        [1 << 20, 2 << 20],
        BLEN,
        BS,
        NBLK,
        FP,
        ExtConfig(push_timeout_s=2, push_clock_skew_s=1, engine_transfer_timeout_s=5),
        clock=clock,
    )


def job(url: str) -> PushJob:
    return push_job("r1", url)


@pytest.mark.parametrize("status", [502, 504, 500])
def test_an_answer_that_is_not_the_sources_keeps_the_blocks_until_the_hold(status):
    src, clock = FixedAnswer(status, {}), Clock()
    rec = receiver(clock)
    try:
        j = job(src.url)
        hold = rec.hold_s(j)
        rec.start([j])
        assert src.asked.wait(10)
        time.sleep(0.3)  # D has read the answer
        clock.now += hold - 0.5
        assert rec.merge_finished(None) is None, (
            f"D ended the push at an HTTP {status} that the source's code did not "
            "give: the source's write may still land in the blocks"
        )
        clock.now += 1.0
        assert rec.merge_finished(None) == {"r1"}
        assert rec.take_outcome().landed == {"r1": 0}
    finally:
        rec.shutdown()
        src.stop()


def test_the_sources_own_refusal_ends_the_push_at_once():
    src, clock = FixedAnswer(429, {SOURCE_REFUSAL_HEADER: "nothing-written"}), Clock()
    rec = receiver(clock)
    try:
        rec.start([job(src.url)])
        assert src.asked.wait(10)
        assert wait_until(lambda: rec.merge_finished(None) == {"r1"}, 5), (
            "D kept the blocks of a push the source refused"
        )
        assert rec.take_outcome().landed == {"r1": 0}
    finally:
        rec.shutdown()
        src.stop()
