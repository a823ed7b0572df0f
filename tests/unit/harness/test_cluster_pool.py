"""harness/cluster_pool.py: which test runs when, and when a shared cluster is
handed to the next module, started anew or stopped (clusters stubbed; the
hand-over check against a stub instance's /health and /metrics)."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness import cluster_pool
from harness.cluster_pool import ClusterPool, run_order, unfit
from harness.launcher import Cluster, InstanceSpec


def test_modules_of_a_shared_cluster_run_together_in_their_order():
    # one entry per test: "late" (second of group g) is collected before "early"
    modules = ["a", "late", "late", "b", "early", "c", "late2"]
    order = run_order(modules, {"g": ["early", "late", "late2"]})
    assert [modules[i] for i in order] == [
        "a",
        "early",
        "late",
        "late",
        "late2",
        "b",
        "c",
    ]
    assert order[2:4] == [1, 2]  # the tests of a module keep their order


def test_without_shared_modules_nothing_moves():
    assert run_order(["x", "y", "x"], {"g": ["p"]}) == [0, 1, 2]


class FakeInstance:
    def __init__(self) -> None:
        self.marks = 0

    def mark_log(self) -> None:
        self.marks += 1


class FakeCluster:
    def __init__(self, name: str) -> None:
        self.name = name
        self.instances = {"p": FakeInstance(), "d": FakeInstance()}
        self.running = False

    def start(self) -> FakeCluster:
        self.running = True
        return self

    def stop(self) -> None:
        self.running = False


def pool_with(verdicts: list[str | None]) -> ClusterPool:
    """A pool of fake clusters whose hand-over checks answer ``verdicts`` in turn."""
    return ClusterPool(FakeCluster, check=lambda cluster: verdicts.pop(0))


def test_a_fit_cluster_is_handed_over_with_its_logs_marked():
    pool = pool_with([None])
    first = pool.get("g")
    assert first.running and first.instances["p"].marks == 0
    assert pool.get("g") is first
    assert all(i.marks == 1 for i in first.instances.values())
    assert pool.started == [first]


def test_an_unfit_cluster_is_started_anew_saying_why(capsys):
    pool = pool_with(["KV blocks still in use after the last module: {'p': 0.1}"])
    first = pool.get("g")
    second = pool.get("g")
    assert second is not first and second.running and not first.running
    assert "KV blocks still in use" in capsys.readouterr().out


def test_another_cluster_or_a_fresh_one_stops_the_live_one():
    pool = pool_with([])
    g = pool.get("g")
    h = pool.get("h")
    assert not g.running and h.running and pool.name == "h"
    h2 = pool.get("h", fresh=True)
    assert h2 is not h and not h.running
    pool.release()
    assert not h2.running and pool.cluster is None and pool.name is None


def test_live_is_the_running_cluster_of_that_name_without_a_check():
    pool = pool_with([])  # a hand-over check would fail: no verdict to pop
    assert pool.live("g") is None
    g = pool.get("g")
    assert pool.live("g") is g and pool.live("h") is None
    assert all(i.marks == 0 for i in g.instances.values())
    pool.release()
    assert pool.live("g") is None


class StubInstanceServer:
    """/health and a /metrics with the KV usage the test sets."""

    def __init__(self) -> None:
        self.usage = 0.0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                body = (
                    f'vllm:kv_cache_usage_perc{{engine="0"}} {stub.usage}\n'.encode()
                    if self.path == "/metrics"
                    else b"ok"
                )
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub_cluster(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(cluster_pool, "HANDOVER_KV_TIMEOUT_S", 0.5)
    server = StubInstanceServer()
    cluster = Cluster([InstanceSpec("p", model="m")], tmp_path)
    inst = cluster["p"]
    inst.port = server.port
    inst.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield cluster, server
    inst.proc.kill()
    inst.proc.wait()
    server.close()


def test_the_hand_over_check_names_held_kv_and_a_dead_instance(stub_cluster):
    cluster, server = stub_cluster
    assert unfit(cluster) is None
    server.usage = 0.25
    why = unfit(cluster)
    assert why is not None and "KV blocks still in use" in why and "0.25" in why
    server.usage = 0.0
    cluster["p"].proc.kill()
    cluster["p"].proc.wait()
    assert unfit(cluster) == "instance p is not running"


def test_log_text_starts_at_the_mark(tmp_path: Path):
    cluster = Cluster([InstanceSpec("p", model="m")], tmp_path)
    inst = cluster["p"]
    inst.log_path.write_text("before\n")
    assert inst.log_text() == "before\n"
    inst.mark_log()
    with open(inst.log_path, "a") as f:
        f.write("after\n")
    assert inst.log_text() == "after\n"
