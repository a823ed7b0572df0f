"""The send-queue fence: a failed write ends only once the kernel holds none of
the bytes it had queued for the peer.

``ss`` is replaced by scripted outputs in its own format (lines as the real
engine's connections showed them in a measured link cut: ESTAB and FIN-WAIT-1
sockets with their Send-Q and bytes_acked); the real kernel and engine are
exercised by tests/integration/test_engine_failure_semantics.py."""

from __future__ import annotations

import logging
import time

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.send_queues import (
    SendQueueFence,
    parse_ss,
)

PEER = "10.231.39.3"


def line(state, send_q, local_port, acked, remote=f"{PEER}:16860"):
    return (
        f"{state} 0      {send_q} 10.231.39.2:{local_port} {remote} "
        f"skmem:(r0,rb131072,t0) cubic rto:26112 backoff:7 bytes_sent:40932185 "
        f"bytes_acked:{acked} unacked:249 notsent:3842993"
    )


def test_ss_lines_are_read_for_the_peers_address_only():
    text = "\n".join(
        [
            line("FIN-WAIT-1", 4198185, 45796, 40566858),
            line("ESTAB", 0, 42186, 67108913),
            line("ESTAB", 12, 5000, 7, remote="10.231.39.9:80"),
            line("ESTAB", 5, 6000, 9, remote=f"[::ffff:{PEER}]:16860"),
            "garbage",
        ]
    )
    got = parse_ss(text, PEER)
    assert [(s.state, s.send_q, s.bytes_acked) for s in got] == [
        ("FIN-WAIT-1", 4198185, 40566858),
        ("ESTAB", 0, 67108913),
        ("ESTAB", 5, 9),
    ]


class Kernel:
    """ss's answers, one per read (the last one for ever)."""

    def __init__(self, *outputs):
        self.outputs = list(outputs)
        self.reads = 0

    def __call__(self):
        out = self.outputs[min(self.reads, len(self.outputs) - 1)]
        self.reads += 1
        return out


def fence(kernel, clock=None):
    now = [0.0]

    def sleep(s):
        now[0] += s

    return SendQueueFence(
        read=kernel,
        resolve=lambda session: PEER,
        clock=clock or (lambda: now[0]),
        sleep=sleep,
    ), now


def test_waits_until_an_orphans_queued_bytes_are_acknowledged_or_it_is_gone():
    held = line("FIN-WAIT-1", 4198185, 45796, 40566858)
    kernel = Kernel(
        held,  # when the write returned
        held,
        held,
        line("FIN-WAIT-1", 1, 45796, 40566858 + 4198184),  # delivered but the FIN
        "",  # closed
    )
    f, now = fence(kernel)
    assert f.wait(f"{PEER}:15000", bound_s=60, started=0) > 0
    assert kernel.reads == 5 and f.fenced == 1


def test_a_busy_connection_is_waited_for_only_up_to_what_it_held():
    # Another write keeps the connection's queue full; what it held at the return
    # is acknowledged by the third read.
    kernel = Kernel(
        line("ESTAB", 1000, 1, 5000),
        line("ESTAB", 1000, 1, 5400),
        line("ESTAB", 1000, 1, 6000),
        line("ESTAB", 1000, 1, 9999),
    )
    f, _ = fence(kernel)
    f.wait(f"{PEER}:1", bound_s=60, started=0)
    assert kernel.reads == 3


def test_nothing_queued_returns_at_once():
    kernel = Kernel(line("ESTAB", 0, 1, 5000))
    f, _ = fence(kernel)
    assert f.wait(f"{PEER}:1", bound_s=60, started=0) == 0.0
    assert kernel.reads == 1 and f.fenced == 0


def test_past_the_bound_it_says_so_once_and_keeps_waiting(caplog):
    held = line("FIN-WAIT-1", 100, 1, 0)
    kernel = Kernel(*([held] * 1000), "")
    f, now = fence(kernel)
    with caplog.at_level(logging.ERROR):
        f.wait(f"{PEER}:1", bound_s=30, started=0)
    assert kernel.reads == 1001 and now[0] > 30
    assert sum("past the engine's bound" in r.getMessage() for r in caplog.records) == 1


def test_unreadable_sockets_are_said_once_and_not_waited_for(caplog):
    f, _ = fence(Kernel(None))
    with caplog.at_level(logging.WARNING):
        assert f.wait(f"{PEER}:1", bound_s=30, started=0) == 0.0
        assert f.wait(f"{PEER}:1", bound_s=30, started=0) == 0.0
    assert sum("iproute2" in r.getMessage() for r in caplog.records) == 1


def test_the_fences_counters_are_served_with_the_push_and_layerwise_stats(c_server):
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.send_queues import (
        fence_stats,
    )

    write = SimpleNamespace(
        fence=SimpleNamespace(fenced=3, fence_seconds=41.25, fencing=1)
    )
    assert fence_stats(write) == {
        "fenced_writes": 3,
        "fence_seconds": 41.25,
        "fencing_now": 1,
    }
    assert fence_stats(lambda *a: 0) == {
        "fenced_writes": 0,
        "fence_seconds": 0,
        "fencing_now": 0,
    }
    c = c_server()
    stats = c.http.get("/push/stats").json()
    assert stats["fenced_writes"] == 0 and stats["overdue_now"] == 0
    assert stats["fencing_now"] == 0


def test_a_write_waiting_on_the_fence_is_counted_while_it_waits():
    """The stats routes show how many failed writes wait for the kernel now (their
    blocks are out of use meanwhile), and each leaves the count when it ends."""
    import threading

    held = line("FIN-WAIT-1", 100, 1, 0)
    release = threading.Event()
    seen: list[int] = []
    f = None

    def read():
        if f is not None:
            seen.append(f.fencing)
        return "" if release.is_set() else held

    f = SendQueueFence(read=read, resolve=lambda session: PEER, sleep=lambda s: None)
    t = threading.Thread(target=f.wait, args=(f"{PEER}:1", 30, 0.0))
    t.start()
    deadline = time.monotonic() + 5
    while f.fencing != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert f.fencing == 1 and f.fenced == 0
    release.set()
    t.join(5)
    assert not t.is_alive()
    assert f.fencing == 0 and f.fenced == 1 and 1 in seen
