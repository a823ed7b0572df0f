"""Signed push requests (connector/common/auth.py): what a captured request is worth.

C and D share MOONCAKE_BOOTSTRAP_TOKEN. D's real receiver and scheduler talk
to a real C over HTTP (helpers.CServer); what D sends is captured on its way
and then replayed, altered or delivered late, as someone on the path would.
C, or another source sharing the token, must refuse each (401/409/421) without
calling its engine, while the
legitimate flow still lands byte-exact, and the token itself is never sent.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from helpers import (
    BS,
    D_SESSION,
    FP,
    KV,
    NBLK,
    SCHED_FP,
    TOKEN,
    TOKENS,
    ask,
    assert_landed,
    d_request,
    push_body,
    push_job,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import auth
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.peer_client import (
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
    is_source_refusal,
)

BLEN = FP.block_len
# C accepts a signed request this long either side of its clock: skew + push timeout
C_CONFIG = dict(
    bootstrap_token=TOKEN, push_max_tokens=64, push_clock_skew_s=0.5, push_timeout_s=0.5
)


class Captured:
    """D's calls as they left D: (path, body, headers)."""

    def __init__(self):
        self.calls: list[tuple[str, bytes, dict]] = []
        self.done = threading.Event()


def d_receiver(d: KV, deliver: bool, capture: Captured) -> PushReceiver:
    """D's worker over the KV cache ``d``; each of its calls is recorded, and
    delivered only if ``deliver``."""
    rec = PushReceiver(
        D_SESSION,
        d.bases,
        BLEN,
        BS,
        NBLK,
        FP,
        ExtConfig(bootstrap_token=TOKEN, push_timeout_s=5),
    )
    real = rec._lanes.post

    def post(source, path, content, headers, deadline):
        capture.calls.append((path, content, dict(headers)))
        try:
            if deliver:
                return real(source, path, content, headers, deadline)
            # taken off the wire: C never saw it, nothing was written
            return Answer(503, b"{}", dict(SOURCE_REFUSAL))
        finally:
            capture.done.set()

    rec._lanes.post = post
    return rec


def push_from_d(c, deliver=True) -> tuple[KV, Captured, int]:
    """One push of TOKENS' 3 blocks from C into D: (D's KV cache, what D sent, blocks
    landed)."""
    cap = Captured()
    d = KV(fill=False)
    rec = d_receiver(d, deliver, cap)
    if deliver:
        c.engine.register(D_SESSION, d)
    rec.start([push_job("r1", c.url)])
    end = time.monotonic() + 10
    finished = None
    while not finished and time.monotonic() < end:
        finished = rec.merge_finished(None)
        time.sleep(0.01)
    assert finished == {"r1"}
    landed = rec.take_outcome().landed["r1"]
    rec.shutdown()
    return d, cap, landed


def deliver(c, call) -> httpx.Response:
    path, content, headers = call
    return c.http.post(path, content=content, headers=headers)


def test_the_legitimate_push_lands_and_the_token_is_never_sent(c_server):
    c = c_server(ExtConfig(**C_CONFIG))
    d, cap, landed = push_from_d(c)
    assert landed == 3
    assert_landed(c.c, d)
    ((path, body, headers),) = cap.calls
    assert path == "/push_blocks"
    assert TOKEN not in json.dumps(headers) and TOKEN.encode() not in body
    assert headers["authorization"].startswith("Mooncake-HMAC-SHA256 ")


def test_the_legitimate_match_is_signed_and_answered(c_server):
    c = c_server(ExtConfig(**C_CONFIG))
    sched = PushScheduler(
        BS,
        ExtConfig(
            push_min_tokens=0,
            bootstrap_token=TOKEN,
            push_sources=(c.url,),
            push_match_timeout_s=5,
        ),
        SCHED_FP,
    )
    seen = []
    real = sched._lanes.post

    def post(source, path, content, headers, deadline):
        seen.append(dict(headers))
        return real(source, path, content, headers, deadline)

    sched._lanes.post = post
    r = d_request(n_tokens=len(TOKENS), source=c.url)
    r.prompt_token_ids = list(TOKENS)
    try:
        assert ask(sched, r) == (3 * BS, True)
    finally:
        sched.shutdown()
    assert TOKEN not in json.dumps(seen)


def test_a_replayed_push_is_refused_after_ds_blocks_were_reused(c_server):
    c = c_server(ExtConfig(**C_CONFIG))
    d, cap, landed = push_from_d(c)
    assert landed == 3
    for t in d.kv:  # D gave the blocks to another request, which prefilled zeros
        t[:] = 0
    calls = len(c.engine.log)
    r = deliver(c, cap.calls[0])  # the captured push, sent again within its window
    assert r.status_code in (401, 409), r.text
    assert len(c.engine.log) == calls and d.untouched()


def test_a_captured_push_with_another_body_is_refused(c_server):
    c = c_server(ExtConfig(**C_CONFIG))
    _, cap, _ = push_from_d(c, deliver=False)
    path, body, headers = cap.calls[0]
    elsewhere = KV(fill=False)  # where the altered push would write
    c.engine.register("127.0.0.1:17009", elsewhere)
    for change in (
        {"dst_session": "127.0.0.1:17009", "dst_kv_base_addrs": elsewhere.bases},
        {"dst_block_ids": [0, 1, 2]},
        {"deadline_unix_ms": int(time.time() * 1000) + 3_600_000},
    ):
        sent = {**json.loads(body), **change}
        r = deliver(c, (path, json.dumps(sent).encode(), headers))
        assert r.status_code == 401, (change, r.text)
    assert c.engine.log == [] and elsewhere.untouched()


def test_a_captured_push_delivered_late_is_refused_as_stale(c_server):
    c = c_server(ExtConfig(**C_CONFIG))  # a 1 s window
    _, cap, _ = push_from_d(c, deliver=False)
    d = KV(fill=False)
    c.engine.register(D_SESSION, d)
    time.sleep(1.3)
    r = deliver(c, cap.calls[0])
    assert r.status_code == 401 and "clock" in r.text, r.text
    assert c.engine.log == [] and d.untouched()


def test_a_captured_push_is_refused_by_another_source_sharing_the_token(c_server):
    """The signed body names the source it is for (the source_id of that source's
    /match_blocks answer): a push captured on its way to C and delivered within
    its window to another source with the same token is refused there, as C's own
    refusal (421, nothing written); at C the same capture is good."""
    c = c_server(ExtConfig(**C_CONFIG))
    other = c_server(ExtConfig(**C_CONFIG), source_id="another-source")
    _, cap, _ = push_from_d(c, deliver=False)
    d = KV(fill=False)
    other.engine.register(D_SESSION, d)
    r = deliver(other, cap.calls[0])
    assert r.status_code == 421 and "c-under-test" in r.text, r.text
    assert is_source_refusal(r.status_code, dict(r.headers))
    assert other.engine.log == [] and d.untouched()
    assert other.server.stats["refused"] == 1
    c.engine.register(D_SESSION, d)
    r = deliver(c, cap.calls[0])
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert_landed(c.c, d)


def test_the_read_key_does_not_open_the_post_routes(c_server):
    c = c_server(ExtConfig(**C_CONFIG))
    d = c.destination()
    bearer = {
        "authorization": f"Bearer {auth.read_key(TOKEN)}",
        "content-type": "application/json",
    }
    assert c.post("/push_blocks", push_body(d), headers=bearer).status_code == 401
    assert (
        c.post("/match_blocks", {"token_ids": TOKENS}, headers=bearer).status_code
        == 401
    )
    assert (
        c.http.get("/hashsync", headers=bearer).status_code == 200
    )  # GET: the read key
    assert c.engine.log == [] and d.untouched()


# ---- the signature itself ----------------------------------------------------------------


def signed(path: str, body: bytes, **kw) -> dict:
    return {
        "content-type": "application/json",
        "authorization": auth.sign(TOKEN, "POST", path, body, **kw),
    }


def test_signed_by_hand_stale_future_and_wrong_key_are_refused(c_server):
    c = c_server(ExtConfig(**C_CONFIG))
    d = c.destination()
    body = json.dumps(push_body(d)).encode()
    now = int(time.time() * 1000)
    for headers, status in [
        (signed("/push_blocks", body, now_ms=now - 5_000), 401),  # stale
        (signed("/push_blocks", body, now_ms=now + 5_000), 401),  # from the future
        (signed("/match_blocks", body), 401),  # signed for another route
        ({"authorization": auth.sign("other", "POST", "/push_blocks", body)}, 401),
    ]:
        assert (
            c.http.post("/push_blocks", content=body, headers=headers).status_code
            == status
        )
    assert c.engine.log == [] and d.untouched()
    ok = signed("/push_blocks", body)
    assert (
        c.http.post("/push_blocks", content=body, headers=ok).json()["status"] == "ok"
    )
    assert (
        c.http.post("/push_blocks", content=body, headers=ok).status_code == 409
    )  # replay


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Mooncake-HMAC-SHA256",
        "Mooncake-HMAC-SHA256 t=1,n=2,s=3",
        "Mooncake-HMAC-SHA256 t=1,n=" + "a" * 32 + ",s=" + "b" * 64 + ",t=2",
        "Mooncake-HMAC-SHA256 t=1,n=" + "A" * 32 + ",s=" + "b" * 64,
        "Mooncake-HMAC-SHA256 t=-1,n=" + "a" * 32 + ",s=" + "b" * 64,
        "Mooncake-HMAC-SHA256 t=1,n=" + "a" * 32 + ",s=" + "b" * 64 + ",x=1",
        # the body hash is signed and named in the header
        "Mooncake-HMAC-SHA256 t=1,n=" + "a" * 32 + ",s=" + "b" * 64,
        "Mooncake-HMAC-SHA256 t=1,n=" + "a" * 32 + ",b=xyz,s=" + "b" * 64,
    ],
)
def test_malformed_signatures_are_refused_before_the_body(header):
    g = auth.EndpointGuard(ExtConfig(bootstrap_token=TOKEN))
    assert g.check_signed_header(header)[0] == 401
    assert g.verify("POST", "/push_blocks", header, b"{}").denied[0] == 401


def test_a_nonce_is_remembered_until_stale_and_memory_is_bounded():
    now = [1_700_000_000_000]
    g = auth.EndpointGuard(
        ExtConfig(bootstrap_token=TOKEN, push_clock_skew_s=1, push_timeout_s=1),
        wall_clock_ms=lambda: now[0],
        nonces=auth.NonceMemory(capacity=3),
    )
    h = [auth.sign(TOKEN, "POST", "/p", b"x", now_ms=now[0]) for _ in range(3)]
    assert g.verify("POST", "/p", h[0], b"x") == auth.Verified(None, now[0])
    assert g.verify("POST", "/p", h[0], b"x").denied[0] == 409
    # a wrong signature is refused before its nonce counts: it fills nothing
    forged = h[1][:-4] + ("0000" if not h[1].endswith("0000") else "1111")
    assert g.verify("POST", "/p", forged, b"x").denied[0] == 401
    assert len(g.nonces) == 1
    assert g.verify("POST", "/p", h[1], b"x").denied is None
    assert g.verify("POST", "/p", h[2], b"x").denied is None
    assert len(g.nonces) == 3
    now[0] += 2_001  # the three are stale now, and forgotten
    fresh = auth.sign(TOKEN, "POST", "/p", b"x", now_ms=now[0])
    assert g.verify("POST", "/p", fresh, b"x").denied is None
    assert len(g.nonces) == 1
    assert g.verify("POST", "/p", h[0], b"x").denied[0] == 401  # the replay is stale


def test_a_flood_of_signed_requests_shuts_others_out_at_most_for_the_skew():
    """A holder of the token fills the nonce memory: the oldest nonces are forgotten,
    their replays refused, and a request signed after the flood's is served (a full
    memory used to answer 503 to everyone until the flood's nonces expired)."""
    now = [1_700_000_000_000]
    skew_ms = 1_000
    g = auth.EndpointGuard(
        ExtConfig(bootstrap_token=TOKEN, push_clock_skew_s=1, push_timeout_s=30),
        wall_clock_ms=lambda: now[0],
        nonces=auth.NonceMemory(capacity=4),
    )

    def signed(at_ms):
        return auth.sign(TOKEN, "POST", "/p", b"x", now_ms=at_ms)

    legit = signed(now[0])
    assert g.verify("POST", "/p", legit, b"x").denied is None
    flood = [signed(now[0]) for _ in range(10)]  # at this instant's clock
    now[0] += 1
    assert [g.verify("POST", "/p", f, b"x").denied for f in flood[:3]] == [None] * 3
    assert g.verify("POST", "/p", signed(now[0]), b"x").denied is None  # not 503
    assert len(g.nonces) == 4
    # what was forgotten cannot be replayed: the first request, a flood member
    for old in (legit, flood[0]):
        denied = g.verify("POST", "/p", old, b"x").denied
        assert denied is not None and denied[0] in (401, 409), denied
    # the flood signs as far ahead as the guard allows: others wait out the skew
    ahead = [signed(now[0] + skew_ms) for _ in range(4)]
    assert [g.verify("POST", "/p", a, b"x").denied for a in ahead] == [None] * 4
    assert g.verify("POST", "/p", signed(now[0] + 5), b"x").denied is not None
    assert g.verify("POST", "/p", signed(now[0] + skew_ms + 1), b"x").denied[0] == 401
    now[0] += skew_ms + 1
    assert g.verify("POST", "/p", signed(now[0]), b"x").denied is None
    # and no request is accepted further ahead than the skew
    assert g.verify("POST", "/p", signed(now[0] + skew_ms + 1), b"x").denied[0] == 401


def test_the_signature_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(
        auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b)
    )
    g = auth.EndpointGuard(ExtConfig(bootstrap_token=TOKEN))
    h = auth.sign(TOKEN, "POST", "/p", b"x")
    assert g.verify("POST", "/p", h, b"x").denied is None
    # the signature, then the body's hash against the signed one
    assert len(calls) == 2 and all(a == b for a, b in calls)


def test_open_endpoints_need_no_signature():
    g = auth.EndpointGuard(ExtConfig(bootstrap_host="127.0.0.1"))
    assert g.check_signed_header(None) is None
    assert g.verify("POST", "/push_blocks", None, b"{}") == auth.Verified()
    assert auth.request_headers(ExtConfig(), "POST", "/p", b"") == {
        "content-type": "application/json"
    }
