"""Smaller guarantees of prefix push: D builds URLs from a source's origin only,
refusals are logged at a bounded rate, C logs a requester's id as printable
text, a restarted destination re-registers its layout, a producer without
prefix caching says so, and C's counters add up under concurrency."""

from __future__ import annotations

import json
import logging
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi import (
    FastAPI,
    Request,
)  # module level: FastAPI resolves annotations by name
from fastapi.responses import JSONResponse
from helpers import (
    BS,
    C_SESSION,
    D_SESSION,
    FP,
    KV,
    NBLK,
    SCHED_FP,
    TOKEN,
    assert_landed,
    assert_push_ok,
    push_body,
    push_job,
    serve,
    serve_routes,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import auth
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.peer_client import (
    SourceLanes,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- push_from: an origin, nothing else ------------------------------------------------


class Recorder:
    """An allowed source that records every request it gets (method, path, query)."""

    def __init__(self):
        self.seen: list[tuple[str, str, str]] = []
        app = FastAPI()

        async def anything(request: Request, rest: str):
            self.seen.append((request.method, request.url.path, request.url.query))
            return JSONResponse({"detail": "recorded"}, 404)

        app.api_route("/{rest:path}", methods=["GET", "POST"])(anything)
        self.url, self.stop = serve(app)


@pytest.fixture(scope="module")
def recorder():
    r = Recorder()
    yield r
    r.stop()


def scheduler_for(*sources: str) -> PushScheduler:
    return PushScheduler(
        BS,
        ExtConfig(push_min_tokens=0, push_match_timeout_s=2, push_sources=sources),
        SCHED_FP,
    )


def request_from(source, rid="r1"):
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(5 * BS)),
        kv_transfer_params={"push_from": source},
        cache_salt=None,
        lora_request=None,
        num_computed_tokens=0,
        num_external_computed_tokens=0,
    )


@pytest.mark.parametrize(
    "suffix",
    [
        "/push_blocks?",
        "/push_blocks#",
        "/push_blocks",
        "/x/",
        "?a=1",
        "#f",
        "/?",
        "/match_blocks/../push_blocks",
        "\\push_blocks",
        "/%2e%2e/push_blocks",
    ],
)
def test_push_from_with_a_path_query_or_fragment_is_refused_without_a_call(
    recorder, suffix
):
    sched = scheduler_for(recorder.url)
    recorder.seen.clear()
    try:
        r = request_from(recorder.url + suffix)
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        time.sleep(0.1)
        assert recorder.seen == [] and sched.stats["refused_sources"] == 1
    finally:
        sched.shutdown()


def test_push_from_with_userinfo_is_refused(recorder):
    sched = scheduler_for(recorder.url)
    recorder.seen.clear()
    try:
        r = request_from(recorder.url.replace("://", "://user:pw@"))
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        assert recorder.seen == [] and sched.stats["refused_sources"] == 1
    finally:
        sched.shutdown()


@pytest.mark.parametrize("suffix", ["", "/", "//"])
def test_an_allowed_origin_is_asked_on_its_own_route(recorder, suffix):
    sched = scheduler_for(recorder.url)
    recorder.seen.clear()
    try:
        r = request_from(recorder.url + suffix)
        assert sched.get_num_new_matched_tokens(r, 0) == (None, False)
        end = time.monotonic() + 5
        while not recorder.seen and time.monotonic() < end:
            time.sleep(0.01)
        assert recorder.seen == [("POST", "/match_blocks", "")]
    finally:
        sched.shutdown()


def test_d_never_posts_to_a_path_its_caller_named(recorder):
    lanes = SourceLanes("t", 1)
    recorder.seen.clear()
    try:
        for source in (
            recorder.url + "/push_blocks?",
            recorder.url + "/push_blocks#",
            recorder.url + "/x",
        ):
            with pytest.raises(ValueError):
                lanes.post(source, "/match_blocks", b"{}", {}, time.monotonic() + 2)
        assert (
            lanes.post(
                recorder.url + "/", "/match_blocks", b"{}", {}, time.monotonic() + 2
            ).status
            == 404
        )
        assert recorder.seen == [("POST", "/match_blocks", "")]
    finally:
        lanes.shutdown()


# ---- refusals in the log: bounded ----------------------------------------------------------


def test_a_refused_source_is_warned_about_once_a_minute_not_per_request(caplog):
    sched = scheduler_for("http://c:9000")
    with caplog.at_level(logging.WARNING):
        for i in range(50):
            sched.get_num_new_matched_tokens(request_from("http://evil:80", f"a{i}"), 0)
        for i in range(50):
            sched.get_num_new_matched_tokens(
                request_from("http://other:80", f"b{i}"), 0
            )
    refusals = [w for w in warnings_of(caplog) if "MOONCAKE_PUSH_SOURCES" in w]
    assert len(refusals) == 2, refusals
    assert sched.stats["refused_sources"] == 100


def test_a_client_varying_the_source_cannot_flood_the_log(caplog):
    sched = scheduler_for("http://c:9000")
    with caplog.at_level(logging.WARNING):
        for i in range(2000):
            sched.get_num_new_matched_tokens(
                request_from(f"http://evil{i}:80", f"r{i}"), 0
            )
    refusals = [w for w in warnings_of(caplog) if "MOONCAKE_PUSH_SOURCES" in w]
    assert len(refusals) <= 300, len(refusals)
    assert sched.stats["refused_sources"] == 2000


# ---- C's log: the requester's id as printable text -------------------------------------------

HOSTILE_ID = "r1\n2024-01-01 INFO forged line\x1b[31m\r\x00" + "x" * 500


def test_c_logs_the_requesters_id_printable_and_short(c_server, caplog):
    c = c_server(ExtConfig(bootstrap_host="127.0.0.1", push_timeout_s=30))
    d = c.destination()
    with caplog.at_level(logging.INFO):
        assert_push_ok(
            c, d, c.post("/push_blocks", push_body(d, request_id=HOSTILE_ID))
        )
        c.post(
            "/push_blocks", push_body(d, session=C_SESSION, request_id=HOSTILE_ID)
        )  # 409
        c.post(
            "/push_blocks",
            push_body(
                d,
                request_id=HOSTILE_ID,  # past its deadline
                deadline_unix_ms=int(time.time() * 1000) - 1000,
            ),
        )
    logged = [r.getMessage() for r in caplog.records if "push_blocks" in r.getMessage()]
    assert len(logged) >= 3, logged
    for line in logged:
        assert line.isprintable() and "\x1b" not in line, repr(line)
        assert "x" * 65 not in line, line


# ---- a restarted destination ---------------------------------------------------------------


def push_via_receiver(c, d: KV, config: ExtConfig) -> int:
    rec = PushReceiver(D_SESSION, d.bases, FP.block_len, BS, NBLK, FP, config)
    try:
        rec.start([push_job("r1", c.url)])
        end = time.monotonic() + 10
        while not (finished := rec.merge_finished(None)) and time.monotonic() < end:
            time.sleep(0.01)
        assert finished == {"r1"}
        return rec.take_outcome().landed["r1"]
    finally:
        rec.shutdown()


def test_a_restarted_destination_re_registers_its_layout_with_an_authenticated_push(
    c_server,
):
    cfg = ExtConfig(bootstrap_token=TOKEN, push_max_tokens=64)
    c = c_server(cfg)
    before = c.destination()
    assert push_via_receiver(c, before, cfg) == 3
    time.sleep(0.01)  # the restart: same session, new buffers, a later push
    after = c.destination()
    assert push_via_receiver(c, after, cfg) == 3
    assert_landed(c.c, after)


def test_an_earlier_signed_push_cannot_change_a_layout(c_server):
    c = c_server(ExtConfig(bootstrap_token=TOKEN, push_max_tokens=64))
    d = c.destination()
    now = int(time.time() * 1000)
    first = json.dumps(push_body(d)).encode()
    later = json.dumps(push_body(d, dst_num_blocks=NBLK - 1)).encode()

    def send(body, at):
        return c.http.post(
            "/push_blocks",
            content=body,
            headers={
                "authorization": auth.sign(
                    TOKEN, "POST", "/push_blocks", body, now_ms=at
                )
            },
        )

    assert send(first, now).json()["status"] == "ok"
    r = send(later, now - 100)  # signed before the push that registered the layout
    assert r.status_code == 409 and r.json()["detail"]["field"] == "dst_session", r.text
    assert send(later, now + 100).json()["status"] == "ok"


def test_without_authentication_a_restarted_destination_is_served_under_its_new_layout(
    c_server,
):
    """Without a token a push cannot prove it was sent later; a restarted D on the
    same session (new buffers) is served once no push into its old layout is
    being written (before, it got 409 until C restarted)."""
    c = c_server()  # open: loopback, no token
    d = c.destination()
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))
    restarted = c.destination()
    r = c.post("/push_blocks", push_body(restarted))
    assert_push_ok(c, restarted, r)


# ---- a producer without prefix caching -----------------------------------------------------


def test_a_producer_without_prefix_caching_says_retrying_will_not_help():
    open_ = ExtConfig(bootstrap_host="127.0.0.1")
    url, stop = serve_routes(open_, push_here=False)
    try:
        for path in ("/match_blocks", "/push_blocks"):
            r = httpx.post(url + path, content=b"{}", timeout=10)
            assert r.status_code == 503
            text = r.json()["detail"]
            assert "--enable-prefix-caching" in text and "will not help" in text, text
    finally:
        stop()
    url, stop = serve_routes(open_)  # not ready yet: retrying will
    try:
        r = httpx.post(url + "/match_blocks", content=b"{}", timeout=10)
        assert r.status_code == 503 and "retry" in r.json()["detail"]
    finally:
        stop()


# ---- C's counters under concurrency ----------------------------------------------------------


def let_threads_switch_inside_updates(server) -> None:
    """Another thread may run between a counter's read and its write, and between
    two counters' updates, as a free-threaded interpreter allows (CPython 3.11
    with its GIL happens not to switch there: reading yields here to show it)."""

    class Yielding(type(server.stats)):
        def __getitem__(self, key):
            time.sleep(0)
            value = super().__getitem__(key)
            time.sleep(0)
            return value

    server.stats = Yielding(**dict(server.stats))


def test_cs_counters_add_up_and_read_whole_while_pushes_run_at_once(c_server):
    """Each push's counters move together: every snapshot (what /hashsync shows) is
    one a sequence of whole pushes could leave, and no update is lost."""
    c = c_server(ExtConfig(bootstrap_host="127.0.0.1", push_max_concurrent=64))
    let_threads_switch_inside_updates(c.server)
    d = c.destination()
    body = push_body(d)
    nbytes, entries = 3 * FP.block_len * FP.num_kv_tensors, 3 * FP.num_kv_tensors
    threads, each = 8, 40
    running = threading.Event()
    running.set()
    torn: list[dict] = []
    seen_torn = [0]

    def pusher():
        for _ in range(each):
            assert c.server.push(body)[1]["status"] == "ok"

    def reader():
        while running.is_set():
            s = dict(c.server.stats)
            if s["bytes"] != s["ok"] * nbytes or s["entries"] != s["ok"] * entries:
                torn[:] = (torn + [s])[:3]
                seen_torn[0] += 1

    watch = threading.Thread(target=reader)
    watch.start()
    workers = [threading.Thread(target=pusher) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    running.clear()
    watch.join()
    stats = dict(c.server.stats)
    pushes = threads * each
    assert stats["pushes"] == stats["ok"] == pushes, stats
    assert (stats["bytes"], stats["entries"]) == (pushes * nbytes, pushes * entries), (
        stats
    )
    assert seen_torn[0] == 0, f"{seen_torn[0]} snapshots mid-update, e.g. {torn}"
    assert_landed(c.c, d)
