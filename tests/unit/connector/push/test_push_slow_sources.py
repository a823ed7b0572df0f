"""D's calls to push sources that are slow, huge, or behind an environment proxy.

A slow source (a raw socket server on 127.0.0.1 that trickles its answer one
byte every 0.5 s, so no single read ever times out) must pin only its own
threads and only until each call's deadline: a healthy source (a real
PushServer, helpers.CServer) is answered at once meanwhile, and
the process can exit. An answer is never read past its cap. D connects to the
source it names, never to a proxy from its environment. A push queued behind
a slow source's pushes is never sent once it has ended."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from helpers import (
    BLEN,
    BS,
    C_SOURCE,
    D_SESSION,
    FP,
    NBLK,
    SCHED_FP,
    TOKENS,
    ask,
    d_request,
    push_job,
    serve,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import (
    peer_client,
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

ROOT = Path(__file__).resolve().parents[4]
TRICKLE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4096\r\n\r\n"
    + b" " * 4096
)


class RawSource:
    """A source on 127.0.0.1 answering every request with ``answer(conn)``
    (a thread per connection). Counts connections, open ones and bytes sent."""

    def __init__(self, answer):
        self.answer = answer
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        self.open = 0
        self.sent = 0
        self.paths: list[str] = []
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.conns.append(conn)
                self.open += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                head += chunk
            self.paths.append(head.split(b" ", 2)[1].decode())
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:  # D closed before its whole body (its deadline passed)
                    return
                body += chunk
            self.answer(self, conn)
        except OSError:
            pass
        finally:
            with self.lock:
                self.open -= 1
            conn.close()

    def send(self, conn, data: bytes) -> None:
        conn.sendall(data)
        with self.lock:
            self.sent += len(data)

    def stop(self):
        self.stopped.set()
        self.sock.close()
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)


def trickle(src: RawSource, conn) -> None:
    """One byte every 0.5 s, headers first: never a read that waits long."""
    for b in TRICKLE:
        if src.stopped.is_set():
            return
        src.send(conn, bytes([b]))
        time.sleep(0.5)


@pytest.fixture
def sources():
    made = []

    def make(answer=trickle) -> RawSource:
        made.append(RawSource(answer))
        return made[-1]

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def healthy(c_server):
    return c_server()


def wait_until(cond, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def push_threads():
    """``push_threads(url)``: D's threads started during this test that serve calls
    to the source at ``url``. Threads an earlier test in this process left (idle
    lanes of a receiver it never shut down, named for a source whose port this
    test's source may now have) are not counted."""
    before = set(threading.enumerate())

    def threads(url: str) -> list[str]:
        where = url.split("//", 1)[1]
        return [
            t.name
            for t in threading.enumerate()
            if t not in before
            and t.name.startswith("mooncake-push")
            and t.name.rsplit("-", 1)[0].endswith(where)
        ]

    return threads


def shutdown(*parts):
    for p in parts:
        getattr(p, "shutdown", lambda: None)()


# ---- a slow source pins only itself, and only until its deadline --------------------


def test_a_slow_source_at_the_match_phase_does_not_delay_a_healthy_one(
    sources, healthy, push_threads
):
    slow = sources()
    sched = PushScheduler(
        BS,
        ExtConfig(
            push_min_tokens=0,
            push_match_timeout_s=3,
            push_sources=(slow.url, healthy.url),
        ),
        SCHED_FP,
    )
    try:
        # six prompts (one prompt's requests would coalesce onto one call)
        slow_reqs = [
            d_request(f"s{i}", source=slow.url, tokens=range(i, i + 5 * BS + 3))
            for i in range(6)
        ]
        for r in slow_reqs:
            assert sched.get_num_new_matched_tokens(r, 0) == (None, False)
        assert wait_until(lambda: slow.open >= 4, 5)
        t0 = time.monotonic()
        r = d_request("h", source=healthy.url, n_tokens=len(TOKENS))
        r.prompt_token_ids = list(TOKENS)
        got = ask(sched, r, timeout=10)
        took = time.monotonic() - t0
        assert got == (3 * BS, True) and took < 1.5, (
            f"a healthy source answered after {took:.1f} s ({got}) behind a slow one"
        )
        # each slow call ends at its deadline (3 s after it was asked), not per read
        assert wait_until(
            lambda: all(sched._matches[q.request_id].done() for q in slow_reqs), 3 + 2
        ), "slow /match_blocks calls outlived their deadline"
        # the source notices a closed connection on its second send after it (a
        # byte every 0.5 s): about 1 s, more on a loaded machine. A queued call
        # can start with a few ms left and get only its headers out (see below)
        assert wait_until(lambda: slow.open == 0, 5)
        for q in slow_reqs:
            assert sched.get_num_new_matched_tokens(q, 0) == (0, False)
    finally:
        shutdown(sched)
    assert wait_until(lambda: not push_threads(slow.url), 5), push_threads(slow.url)


def test_a_call_whose_deadline_passes_between_its_headers_and_body_is_closed(
    sources, monkeypatch
):
    """A call (e.g. one queued behind a slow source's calls, started with a few ms
    left) whose deadline passes after its request headers went out but before its
    body: D closes the connection at once, not when the exception it raised (kept
    by the scheduler's future) is garbage-collected, and the source sees it close."""
    slow = sources()
    real_write = peer_client._DeadlineStream.write
    writes: list[bytes] = []

    def write(self, buffer, timeout=None):
        if writes:  # the headers went out: the deadline passes before the body
            time.sleep(0.6)
        writes.append(bytes(buffer))
        return real_write(self, buffer, timeout)

    monkeypatch.setattr(peer_client._DeadlineStream, "write", write)
    lanes = peer_client.SourceLanes("mooncake-push-test", 1)
    gc.disable()
    try:
        with pytest.raises(peer_client.DeadlinePassed) as err:
            lanes.post(slow.url, "/match_blocks", b"{}", {}, time.monotonic() + 0.5)
        # the headers were sent; the body's write found the deadline passed
        assert len(writes) == 2 and b"content-length: 2" in writes[0].lower()
        assert wait_until(lambda: slow.paths == ["/match_blocks"], 2)
        assert wait_until(lambda: slow.open == 0, 2), (
            "the source still has the connection of a call that hit its deadline"
        )
        # the exception (and its traceback) was alive meanwhile, as in a future
        assert "deadline" in str(err.value)
    finally:
        gc.enable()
        lanes.shutdown()


def test_a_call_with_almost_no_time_left_is_not_started(sources):
    """A call whose deadline is closer than MIN_CALL_S (one queued behind a slow
    source's calls) cannot get a whole answer: the source sees no connection and
    no request, and the call ends at once."""
    slow = sources()
    lanes = peer_client.SourceLanes("mooncake-push-test", 1)
    try:
        t0 = time.monotonic()
        with pytest.raises(peer_client.DeadlinePassed) as err:
            lanes.post(slow.url, "/match_blocks", b"{}", {}, t0 + 0.02)
        assert time.monotonic() - t0 < 0.02 + 0.5
        time.sleep(0.3)
        assert slow.paths == [] and slow.open == 0, (slow.paths, slow.open)
        assert "not started" in str(err.value)
    finally:
        lanes.shutdown()


# ---- a source's lane lives while it is used ----------------------------------------


def test_a_lane_idle_past_its_limit_is_closed_when_another_source_is_called(
    push_threads,
):
    """Sources come and go (an instance restarted on another port): a lane unused
    for idle_s ends its threads and closes its connections at the next call, and
    the source gets a new one when it is called again."""
    lanes = peer_client.SourceLanes("mooncake-push-test", 2, idle_s=0.3)
    gone, other = "http://127.0.0.1:9", "http://127.0.0.1:10"
    try:
        assert lanes.submit(gone, lambda: 1).result(5) == 1
        assert len(push_threads(gone)) == 2
        time.sleep(0.4)
        assert lanes.submit(other, lambda: 2).result(5) == 2
        assert wait_until(lambda: not push_threads(gone), 2), push_threads(gone)
        assert lanes.sources() == [other]
        assert lanes.submit(gone, lambda: 3).result(5) == 3  # a new lane
        assert len(push_threads(gone)) == 2
    finally:
        lanes.shutdown()


def test_a_lane_with_a_call_running_or_in_flight_is_never_closed(sources, push_threads):
    """Idle means no call queued, running, or posted from another thread: a lane
    whose call outlives idle_s keeps its threads and its connection."""
    slow = sources()
    lanes = peer_client.SourceLanes("mooncake-push-test", 1, idle_s=0.2)
    release = threading.Event()
    busy = "http://127.0.0.1:9"
    ended: list = []

    def post_slow():  # from a thread of the caller's, as the reset notice is sent
        t0 = time.monotonic()
        try:
            lanes.post(slow.url, "/x", b"{}", {}, t0 + 2.0)
        except Exception as e:  # noqa: BLE001 - what ended the call
            ended.append((time.monotonic() - t0, e))

    try:
        running = lanes.submit(busy, release.wait, 10)
        poster = threading.Thread(target=post_slow)
        poster.start()
        assert wait_until(lambda: slow.open == 1, 2)
        time.sleep(0.5)  # both past idle_s, both busy
        assert lanes.submit("http://127.0.0.1:10", lambda: 0).result(5) == 0
        assert len(push_threads(busy)) == 1 and len(push_threads(slow.url)) == 1
        release.set()
        assert running.result(5) is True
        poster.join(5)
        # the slow call ended at its deadline, not cut off by a closed lane
        ((took, error),) = ended
        assert isinstance(error, peer_client.DeadlinePassed) and took >= 1.9, ended
    finally:
        release.set()
        lanes.shutdown()


def test_a_slow_source_at_the_push_phase_does_not_delay_a_healthy_one(
    sources, healthy, push_threads
):
    slow = sources()
    d = healthy.destination()
    rec = PushReceiver(
        D_SESSION, d.bases, BLEN, BS, NBLK, FP, ExtConfig(push_timeout_s=5)
    )
    try:
        rec.start([push_job(f"s{i}", slow.url) for i in range(6)])
        assert wait_until(lambda: slow.open >= 4, 5)
        t0 = time.monotonic()
        rec.start([push_job("h", healthy.url)])
        ended: set[str] = set()

        def healthy_ended():
            ended.update(rec.merge_finished(None) or ())
            return "h" in ended

        wait_until(healthy_ended, 10)
        took = time.monotonic() - t0
        assert "h" in ended and took < 1.5, (
            f"the push from a healthy source ended after {took:.1f} s behind a slow one"
        )
        assert rec.take_outcome().landed["h"] == 3
        assert healthy.engine.log, "the healthy source was never asked"
    finally:
        t1 = time.monotonic()
        shutdown(rec)
    # shutdown aborts the slow calls (their deadline, the hold, is a minute away)
    assert wait_until(lambda: not push_threads(slow.url), 5), push_threads(slow.url)
    assert time.monotonic() - t1 < 5
    assert wait_until(lambda: slow.open == 0, 2)


def test_the_process_exits_while_calls_to_a_slow_source_are_in_flight(sources):
    slow = sources()
    script = textwrap.dedent(f"""
        import time
        from types import SimpleNamespace
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import ExtConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
            KVFingerprint, PushJob)
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
            PushReceiver)
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
            PushScheduler)
        fp = KVFingerprint(model="m", dtype="d", block_size=4, tp_size=1)
        url = {slow.url!r}
        s = PushScheduler(4, ExtConfig(push_min_tokens=0, push_match_timeout_s=600, push_sources=(url,)), fp)
        r = SimpleNamespace(request_id="r", prompt_token_ids=list(range(9)), cache_salt=None,
                            kv_transfer_params={{"push_from": url}}, lora_request=None)
        s.get_num_new_matched_tokens(r, 0)
        rec = PushReceiver("127.0.0.1:2", [1 << 20], 64, 4, 16, fp,
                           ExtConfig(push_timeout_s=600))
        rec.start([PushJob("p", url, tuple(range(9)), None, None, 0, (1, 2), source_id={C_SOURCE!r})])
        time.sleep(2)
        print("exiting", flush=True)
    """)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=os.environ.copy(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail("D's process did not exit: its push threads wait on a slow source")
    assert proc.returncode == 0 and "exiting" in out, err[-2000:]
    assert slow.open == 0 or wait_until(lambda: slow.open == 0, 2)
    assert time.monotonic() - t0 < 60


# ---- a push queued behind a slow source's pushes ------------------------------------


class GatedSource:
    """A source whose /push_blocks answers only once the gate opens."""

    def __init__(self):
        self.gate = threading.Event()
        self.pushes: list[str] = []
        app = FastAPI()

        async def push_blocks(request: Request):
            import asyncio
            import json as _json

            self.pushes.append(_json.loads(await request.body())["request_id"])
            await asyncio.to_thread(self.gate.wait, 30)
            return Response(
                b'{"status": "failed", "message": "gated"}',
                200,
                media_type="application/json",
            )

        app.post("/push_blocks")(push_blocks)
        self.url, self.stop = serve(app)


def test_a_push_that_ended_while_queued_is_never_sent():
    """Four pushes to a source hang; a fifth waits for one of their threads. Its
    hold passes (the injected clock): the push ends with nothing landed and its
    blocks go back to the pool. When the four return, the fifth must not be
    sent: C would write into blocks that other requests now use."""
    src = GatedSource()
    clock = SimpleNamespace(now=1000.0)
    rec = PushReceiver(
        D_SESSION,
        [1 << 20, 2 << 20],
        BLEN,
        BS,
        NBLK,
        FP,
        ExtConfig(push_timeout_s=1),
        clock=lambda: clock.now,
    )
    try:
        rec.start([push_job(f"a{i}", src.url) for i in range(4)])
        assert wait_until(lambda: len(src.pushes) == 4, 5)
        rec.start([push_job("late", src.url)])
        time.sleep(0.2)
        clock.now += 3600  # every hold has passed
        assert rec.merge_finished(None) == {"a0", "a1", "a2", "a3", "late"}
        assert rec.take_outcome().landed["late"] == 0
        src.gate.set()
        time.sleep(1.0)
        assert src.pushes.count("late") == 0, "D sent a push after it had ended"
    finally:
        src.gate.set()
        shutdown(rec)
        src.stop()


# ---- answers are read up to a cap ---------------------------------------------------

HUGE = 400 << 20


def huge_answer(declared: bool):
    def answer(src: RawSource, conn) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        head += (
            (b"content-length: %d\r\n" % HUGE) if declared else b"connection: close\r\n"
        )
        src.send(conn, head + b"\r\n")
        chunk = b" " * (1 << 20)
        for _ in range(HUGE // len(chunk)):
            src.send(conn, chunk)

    return answer


@pytest.mark.parametrize(
    "declared", [True, False], ids=["content-length", "until-close"]
)
@pytest.mark.parametrize("phase", ["match", "push"])
def test_a_400_mib_answer_is_not_read(sources, phase, declared):
    """The source answers 400 MiB of JSON whitespace. D must stop reading at its
    cap (the bytes the source got out are an upper bound on what D read: the
    kernel's socket buffers hold a few MiB)."""
    src = sources(huge_answer(declared))
    t0 = time.monotonic()
    if phase == "match":
        sched = PushScheduler(
            BS,
            ExtConfig(
                push_min_tokens=0, push_match_timeout_s=20, push_sources=(src.url,)
            ),
            SCHED_FP,
        )
        try:
            assert ask(sched, d_request(source=src.url), timeout=30) == (0, False)
            assert sched.stats["match_failed"] == 1
        finally:
            shutdown(sched)
    else:
        rec = PushReceiver(
            D_SESSION,
            [1 << 20, 2 << 20],
            BLEN,
            BS,
            NBLK,
            FP,
            ExtConfig(push_timeout_s=20),
        )
        try:
            rec.start([push_job("r1", src.url)])
            # the answer is refused (the source's connection is gone), unread: no
            # end before the hold (C may still write)
            assert wait_until(lambda: src.paths and src.open == 0, 30)
            assert rec.merge_finished(None) is None
        finally:
            shutdown(rec)
    assert wait_until(lambda: src.open == 0, 5)
    assert src.sent < 64 << 20, f"D read up to {src.sent >> 20} MiB of a 400 MiB answer"
    assert time.monotonic() - t0 < 30


# ---- no proxy from the environment --------------------------------------------------


def test_d_ignores_proxies_from_its_environment(monkeypatch, sources, healthy):
    proxy = sources(lambda src, conn: None)  # takes the request, answers nothing
    for var in (
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ):
        monkeypatch.setenv(var, proxy.url)
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    sched = PushScheduler(
        BS,
        ExtConfig(
            push_min_tokens=0, push_match_timeout_s=3, push_sources=(healthy.url,)
        ),
        SCHED_FP,
    )
    d = healthy.destination()
    rec = PushReceiver(
        D_SESSION, d.bases, BLEN, BS, NBLK, FP, ExtConfig(push_timeout_s=3)
    )
    try:
        r = d_request(source=healthy.url, n_tokens=len(TOKENS))
        r.prompt_token_ids = list(TOKENS)
        assert ask(sched, r) == (3 * BS, True)
        rec.start([push_job("r1", healthy.url)])
        assert wait_until(lambda: rec.merge_finished(None) == {"r1"}, 10)
        assert rec.take_outcome().landed == {"r1": 3}
        assert proxy.paths == [], f"D went through the proxy: {proxy.paths}"
    finally:
        shutdown(sched, rec)
