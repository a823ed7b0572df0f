"""Destinations C must refuse before writing: its own session, a changed layout,
block ids out of range, another fingerprint, tensor parallelism, sizes, bodies,
concurrency. Each refusal is checked twice: no engine call, and no destination
byte changed. In-process HTTP; no vLLM instance.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import (
    BLEN,
    BS,
    C_SESSION,
    D_SESSION,
    FP,
    KV,
    NBLK,
    SLOTS,
    TOKEN,
    TOKENS,
    assert_landed,
    assert_push_ok,
    dumps,
    push_body,
    refused,
    wait_until,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import auth
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    request_headers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    PushRequestError,
    parse_push_request,
    validate,
)


def test_own_session_is_refused(c_servers):
    c = c_servers()
    d = c.destination()
    c.engine.register(C_SESSION, d)  # even if C's own engine would accept the write
    out = refused(c, push_body(d, session=C_SESSION), 409, d)
    assert out["detail"]["field"] == "dst_session"
    assert c.server.stats["refused"] == 1


def test_a_known_session_cannot_change_its_layout_while_a_push_into_it_is_written(
    c_servers,
):
    """Without authentication (an open C): while a push into a destination is
    being written, no other layout is registered for it (409, nothing written);
    once it has ended, a push with another layout re-registers the destination
    (a restarted instance). An authenticated push signed earlier than the one
    that registered a layout: tests/unit/connector/push/test_push_hygiene.py."""
    c = c_servers(ExtConfig(bootstrap_host="127.0.0.1", push_max_tokens=64))
    d = c.destination()
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))
    gate = c.engine.gate()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(c.post, "/push_blocks", push_body(d))
        assert wait_until(lambda: c.engine.entered == 2), "the write never started"
        other = KV(fill=False)
        c.engine.register("127.0.0.1:17003", other)
        for over in [
            {"dst_num_blocks": NBLK - 1},
            {"dst_kv_base_addrs": other.bases},
            {"dst_kv_base_addrs": d.bases[::-1]},
        ]:
            out = refused(c, push_body(d, **over), 409, other)
            assert out["detail"]["field"] == "dst_session"
            assert D_SESSION in out["detail"]["message"]
            assert "being written" in out["detail"]["message"]
        gate.set()
        assert first.result(10).json()["status"] == "ok"
    # a new session may have its own layout at any time
    assert_push_ok(
        c, other, c.post("/push_blocks", push_body(other, "127.0.0.1:17003"))
    )
    # nothing in flight: D restarted with new buffers on the same session
    restarted = KV(fill=False)
    c.engine.register(D_SESSION, restarted)
    assert_push_ok(c, restarted, c.post("/push_blocks", push_body(restarted)))


@pytest.mark.parametrize(
    "over",
    [
        {"dst_block_ids": [3, 4, NBLK]},
        {"dst_block_ids": [3, 4, 2**63]},
        {"dst_num_blocks": 7},
        {"dst_num_blocks": 2**58},  # the tensors end beyond 2**64
        {"dst_kv_base_addrs": "overlap"},
    ],
)
def test_out_of_range_destination_is_422(c_servers, over):
    c = c_servers()
    d = c.destination()
    if over.get("dst_kv_base_addrs") == "overlap":
        over = {"dst_kv_base_addrs": [d.bases[0], d.bases[0] + NBLK * BLEN - 1]}
    out = refused(c, push_body(d, **over), 422, d)
    assert out["detail"]["field"] in ("dst_block_ids", "dst_kv_base_addrs")


@pytest.mark.parametrize(
    "field,value",
    [
        ("dtype", "bfloat16/auto"),
        ("model", "Other:1"),
        ("block_size", BS * 4),
        ("block_len", BLEN * 2),
        ("num_kv_tensors", SLOTS + 2),
    ],
)
def test_fingerprint_mismatch_is_409_naming_both(c_servers, field, value):
    c = c_servers()
    d = c.destination()
    fp = FP.model_copy(update={field: value}).model_dump()
    out = refused(c, push_body(d, fingerprint=fp), 409, d)
    msg = out["detail"]["message"]
    assert out["detail"]["field"] == "fingerprint" and field in msg
    assert repr(getattr(FP, field)) in msg and repr(value) in msg, msg


@pytest.mark.parametrize("c_tp,d_tp", [(1, 2), (2, 1), (2, 4)])
def test_different_tensor_parallel_sizes_are_409_naming_both(c_servers, c_tp, d_tp):
    c = c_servers(fingerprint=FP.model_copy(update={"tp_size": c_tp}))
    d = c.destination()
    d_fp = FP.model_copy(update={"tp_size": d_tp}).model_dump()
    out = refused(c, push_body(d, fingerprint=d_fp), 409, d)
    msg = out["detail"]["message"]
    assert f"tp_size {c_tp} (source) != {d_tp} (destination)" in msg, msg
    # and directly, as validate() sees it
    with pytest.raises(PushRequestError) as e:
        validate(
            parse_push_request(push_body(d, fingerprint=d_fp)),
            block_size=BS,
            num_kv_tensors=SLOTS,
            block_len=BLEN,
            fingerprint=FP.model_copy(update={"tp_size": c_tp}),
        )
    assert e.value.status == 409


def test_each_tp_rank_writes_only_the_shard_asked_of_it(c_server):
    """TP 2 on both sides: a push names D's rank; C's rank 0 serves rank 0's shard,
    refuses another rank's (421) and a rank beyond the TP size (422)."""
    fp2 = FP.model_copy(update={"tp_size": 2})
    c = c_server(fingerprint=fp2, tp_rank=0)
    c.server.ranks_registered([])  # its sibling's engine: none here
    d = c.destination()
    body = push_body(d, fingerprint=fp2.model_dump())
    out = refused(c, {**body, "tp_rank": 1}, 421, d)
    assert out["detail"]["field"] == "tp_rank" and "rank 0" in out["detail"]["message"]
    out = refused(c, {**body, "tp_rank": 2}, 422, d)
    assert out["detail"]["field"] == "tp_rank"
    assert_push_ok(c, d, c.post("/push_blocks", body))
    assert_landed(c.c, d)


def test_token_count_above_the_limit_is_413(c_servers):
    c = c_servers()  # push_max_tokens=64
    d = c.destination()
    longest = TOKENS + list(range(10_000, 10_000 + 64 - len(TOKENS)))
    over = longest + [1]
    out = refused(c, push_body(d, token_ids=over), 413, d)
    assert out["detail"]["field"] == "token_ids"
    r = c.post("/match_blocks", {"token_ids": over})
    assert r.status_code == 413, r.text
    # at the limit: served (the prompt's first 3 blocks are C's)
    assert c.post("/match_blocks", {"token_ids": longest}).json()["matched_blocks"] == 3
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d, token_ids=longest)))


def raw_http(
    port: int, head: bytes, body: bytes, timeout: float = 5.0
) -> tuple[bytes, float]:
    """Send bytes as they are; return all the server sent until it closed (or the
    timeout), and how long the first byte of the answer took."""
    t0 = time.monotonic()
    first = None
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        # the server may answer and close before taking it all
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head + body)
        s.settimeout(timeout)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                if first is None:
                    first = time.monotonic() - t0
                    s.settimeout(1.0)  # then read what follows, until idle
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out, first if first is not None else timeout


def statuses(raw: bytes) -> list[int]:
    return [
        int(line.split()[1])
        for line in raw.split(b"\r\n")
        if line.startswith(b"HTTP/1.")
    ]


def test_body_above_the_cap_is_413(c_servers):
    c = c_servers()
    d = c.destination()
    cap = c.config.push_max_body_bytes
    valid = dumps(push_body(d))
    padded = (
        valid[:-1] + b" " * (cap + 1 - len(valid)) + b"}"
    )  # a valid push, 1 byte too long
    assert len(padded) == cap + 1
    assert refused(c, padded.decode(), 413, d)["detail"]["field"] == "body"
    assert (
        c.post("/match_blocks", b'{"token_ids": [1]' + b" " * cap + b"}").status_code
        == 413
    )

    # no content-length (chunked): the cap still holds
    def chunks():
        yield padded[:1000]
        yield padded[1000:]

    signed = auth.sign(
        TOKEN, "POST", "/push_blocks", padded
    )  # passes until the body's size
    r = c.http.post("/push_blocks", content=chunks(), headers={"authorization": signed})
    assert r.status_code == 413 and "content-length" not in r.request.headers

    # lying content-length, too large: refused at once, the body is never waited for
    head = (
        f"POST /push_blocks HTTP/1.1\r\nHost: x\r\nAuthorization: {signed}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {10**15}\r\n\r\n"
    ).encode()
    out, took = raw_http(c.port, head, valid)
    assert statuses(out)[:1] == [413] and took < 3, (out[:200], took)

    # lying content-length, too small: only that many bytes are the body; the rest is
    # not a request. Nothing is written and nothing answers 200 or 5xx.
    head = (
        f"POST /push_blocks HTTP/1.1\r\nHost: x\r\nAuthorization: {signed}\r\n"
        f"Content-Type: application/json\r\nContent-Length: 20\r\n\r\n"
    ).encode()
    out, _ = raw_http(c.port, head, padded, timeout=3)
    codes = statuses(out)
    assert codes and all(400 <= s < 500 for s in codes), out[:300]
    # an invalid content-length header never reaches the handler
    for value in [
        "-1",
        "abc",
        "1e3",
        "\u00b2".encode().decode("latin-1"),
        "10, 20",
        "",
    ]:
        head = (
            f"POST /push_blocks HTTP/1.1\r\nHost: x\r\nAuthorization: {signed}\r\n"
            f"Content-Length: {value}\r\n\r\n"
        ).encode("latin-1")
        out, _ = raw_http(c.port, head, valid, timeout=3)
        codes = statuses(out)
        assert all(400 <= s < 500 for s in codes), (value, out[:300])
    assert c.engine.log == [] and d.untouched()
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))  # still serving


def test_concurrent_pushes_beyond_the_limit_are_429(c_servers):
    c = c_servers(ExtConfig(bootstrap_token=TOKEN, push_max_concurrent=2))
    gate = c.engine.gate()
    dests = [
        (f"127.0.0.1:{18000 + i}", c.destination(f"127.0.0.1:{18000 + i}"))
        for i in range(20)
    ]
    t0 = time.monotonic()
    done: dict[int, tuple[int, dict, float]] = {}

    def one(i):
        session, d = dests[i]
        content = json.dumps(push_body(d, session=session)).encode()
        r = httpx.post(
            c.url + "/push_blocks",
            content=content,
            timeout=30,
            headers=request_headers(c.config, "POST", "/push_blocks", content),
        )
        done[i] = (r.status_code, r.json(), time.monotonic() - t0)

    with ThreadPoolExecutor(20) as pool:
        futs = [pool.submit(one, i) for i in range(20)]
        end = time.monotonic() + 10
        while (len(done) < 18 or c.engine.entered < 2) and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.2)  # nothing else gets in while the gate is closed
        answered_before = dict(done)
        entered_before = c.engine.entered
        gate.set()
        for f in futs:
            f.result(30)
    assert entered_before == 2, f"{entered_before} writes in progress at once (limit 2)"
    busy = [i for i, (code, _, _) in answered_before.items() if code == 429]
    assert len(busy) == 18 and len(answered_before) == 18, answered_before
    assert all(answered_before[i][2] < 5 for i in busy)  # quickly, while two were held
    ok = [
        i for i, (code, out, _) in done.items() if code == 200 and out["status"] == "ok"
    ]
    assert sorted(ok + busy) == list(range(20))
    for i in busy:
        assert dests[i][1].untouched(), (
            f"a refused push ({i}) changed destination bytes"
        )
    for i in ok:
        assert_landed(c.c, dests[i][1])
    assert c.server.stats["busy"] == 18
    d = c.destination()
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))
