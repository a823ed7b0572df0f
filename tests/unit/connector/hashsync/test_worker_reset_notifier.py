"""The scheduler's notice of a prefix-cache reset to a worker in another process
(hashsync/scheduler_sync.py): one signed POST /hashsync/reset to the instance's
own bootstrap server; a failure is a warning, never an error in the reset."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    EndpointGuard,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync import (
    scheduler_sync,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.feed_protocol import (
    reset_proof,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    RESET_KEY,
    SCHEDULER_ID,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_sync import (
    WorkerResetNotifier,
)

TOKEN = "tok-reset-notice"


@pytest.fixture
def server():
    """A bootstrap server stand-in: records each POST, answers ``status``."""
    seen: list[tuple[str, dict[str, str], bytes]] = []
    state = {"status": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["content-length"]))
            seen.append((self.path, dict(self.headers), body))
            out = b"{}"
            self.send_response(state["status"])
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen, state
    httpd.shutdown()
    httpd.server_close()


def test_the_notice_is_signed_names_this_scheduler_and_proves_it_is_its(server):
    url, seen, _ = server
    config = ExtConfig(bootstrap_host="0.0.0.0", bootstrap_token=TOKEN)
    WorkerResetNotifier(url, config)(3)
    ((path, headers, body),) = seen
    assert path == "/hashsync/reset"
    assert json.loads(body) == {
        "scheduler_id": SCHEDULER_ID,
        "resets": 3,
        "proof": reset_proof(RESET_KEY, SCHEDULER_ID, 3),
    }
    assert RESET_KEY.encode() not in body and all(
        RESET_KEY not in v for v in headers.values()
    )
    verified = EndpointGuard(config).verify(
        "POST", path, headers.get("authorization") or headers.get("Authorization"), body
    )
    assert verified.denied is None, verified


def test_a_failed_notice_warns_and_does_not_raise(server, monkeypatch):
    url, _, state = server
    warned: list[str] = []
    monkeypatch.setattr(
        scheduler_sync.logger, "warning", lambda msg, *a: warned.append(msg % a)
    )
    config = ExtConfig(bootstrap_host="127.0.0.1")
    state["status"] = 409
    WorkerResetNotifier(url, config)(1)
    state["status"] = 404  # no mirror on this instance: nothing to tell
    WorkerResetNotifier(url, config)(2)
    WorkerResetNotifier("http://127.0.0.1:9", config)(3)  # nothing listens
    assert len(warned) == 2, warned
    assert "409" in warned[0] and "next step" in warned[0]
    assert "http://127.0.0.1:9/hashsync/reset" in warned[1]


def test_a_server_that_trickles_its_answer_is_cut_off_at_one_deadline(monkeypatch):
    """Every wait has one end: a server answering a byte every 0.5 s, each within
    any per-read timeout, gets the notice ended at its deadline (and a warning),
    not when it stops sending."""
    monkeypatch.setattr(scheduler_sync, "RESET_NOTICE_DEADLINE_S", 1.0)
    warned: list[str] = []
    monkeypatch.setattr(
        scheduler_sync.logger, "warning", lambda msg, *a: warned.append(msg % a)
    )

    class Trickle(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["content-length"]))
            out = b"{" + b" " * 10 + b"}"
            self.send_response(200)
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            for byte in out:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.5)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # the notice's client left at its deadline: a broken pipe here

    httpd = Server(("127.0.0.1", 0), Trickle)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        config = ExtConfig(bootstrap_host="127.0.0.1")
        t0 = time.monotonic()
        WorkerResetNotifier(f"http://127.0.0.1:{httpd.server_address[1]}", config)(1)
        took = time.monotonic() - t0
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert took < 1.0 + 1.0, f"the notice took {took:.1f} s against a 1 s deadline"
    assert len(warned) == 1 and "deadline" in warned[0], warned
