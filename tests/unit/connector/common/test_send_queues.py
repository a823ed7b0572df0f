"""The send-queue fence: a failed write ends only once the kernel holds none of
the bytes it had queued for the peer, and is held for the bound when the fence
cannot see them.

The kernel is scripted (sockets as the real engine's connections showed them in
a measured link cut: ESTABLISHED and FIN-WAIT-1 with their send queues and
bytes_acked) except in the tests named "real kernel", which read this host's
own sockets; the real engine is exercised by
tests/integration/test_engine_failure_semantics.py."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.send_queues import (
    KernelSockets,
    PeerAddresses,
    QueuedSocket,
    SendQueueFence,
    fence_stats,
    parse_proc_net_tcp,
    probe_reader,
    read_proc_net_tcp,
    read_sock_diag,
)

PEER = "10.231.39.3"
ESTABLISHED, FIN_WAIT1 = 1, 4
HOLD_S = 205.4


def sock(state, send_q, local_port, acked, remote=(PEER, 16860), rto_s=0.2):
    return QueuedSocket(
        ("10.231.39.2", local_port), remote, state, send_q, acked, rto_s
    )


class Kernel:
    """The kernel's answers, one per read (the last one for ever)."""

    def __init__(self, *readings):
        self.readings = list(readings)
        self.reads = 0

    def __call__(self, peers):
        out = self.readings[min(self.reads, len(self.readings) - 1)]
        self.reads += 1
        if out is None:
            return None
        return [s for s in out if peers is None or s.remote[0] in peers]


def fence(kernel, addresses=None, **kw):
    now = [0.0]

    def sleep(s):
        now[0] += s

    f = SendQueueFence(
        hold_s=HOLD_S,
        kernel=KernelSockets({"scripted": kernel}, probe=False),
        addresses=addresses or PeerAddresses(resolve=lambda host: {PEER}),
        clock=lambda: now[0],
        sleep=sleep,
        **kw,
    )
    return f, now


def test_waits_until_an_orphans_queued_bytes_are_acknowledged_or_it_is_gone():
    held = [sock(FIN_WAIT1, 4198185, 45796, 40566858)]
    kernel = Kernel(
        held,  # when the write returned
        held,
        held,
        [sock(FIN_WAIT1, 1, 45796, 40566858 + 4198184)],  # delivered but the FIN
        [],  # closed
    )
    f, now = fence(kernel)
    assert f.wait(f"{PEER}:15000", bound_s=60, started=0) > 0
    assert kernel.reads == 5 and f.fenced == 1 and f.blind_holds == 0


def test_a_busy_connection_is_waited_for_only_up_to_what_it_held():
    # Another write keeps the connection's queue full; what it held at the return
    # is acknowledged by the third read.
    kernel = Kernel(
        [sock(ESTABLISHED, 1000, 1, 5000)],
        [sock(ESTABLISHED, 1000, 1, 5400)],
        [sock(ESTABLISHED, 1000, 1, 6000)],
        [sock(ESTABLISHED, 1000, 1, 9999)],
    )
    f, _ = fence(kernel)
    f.wait(f"{PEER}:1", bound_s=60, started=0)
    assert kernel.reads == 3


def test_a_connection_to_the_peer_with_nothing_queued_returns_at_once():
    kernel = Kernel([sock(ESTABLISHED, 0, 1, 5000)])
    f, _ = fence(kernel)
    assert f.wait(f"{PEER}:1", bound_s=60, started=0) == 0.0
    assert kernel.reads == 1 and f.fenced == 0 and f.blind_holds == 0


def test_past_the_bound_it_says_so_once_and_keeps_waiting(caplog):
    held = [sock(FIN_WAIT1, 100, 1, 0)]
    kernel = Kernel(*([held] * 400), [])
    f, now = fence(kernel)
    with caplog.at_level(logging.ERROR):
        f.wait(f"{PEER}:1", bound_s=30, started=0)
    assert kernel.reads == 401 and now[0] > 30
    assert sum("past the engine's bound" in r.getMessage() for r in caplog.records) == 1


def test_the_poll_backs_off_toward_the_sockets_retransmission_timer():
    stalled = [sock(FIN_WAIT1, 100, 1, 0, rto_s=120.0)]
    kernel = Kernel(*([stalled] * 11), [])
    f, now = fence(kernel)
    f.wait(f"{PEER}:1", bound_s=600, started=0)
    # one reading when the write failed, then 11 polls: the first after 0.1 s,
    # every later one at the 2 s cap (rto/2 = 60 s, capped)
    assert kernel.reads == 12 and now[0] == pytest.approx(0.1 + 11 * 2.0)


@pytest.mark.parametrize(
    "why", ["no reader works", "the readers see no socket of their own"]
)
def test_a_fence_that_cannot_read_the_kernel_holds_for_the_bound_and_counts_it(
    why, caplog
):
    """Measured before: with ``ss`` missing, rejecting -O, slower than its timeout
    or printing nothing, the fence returned in 0.00-0.01 s (5.03 s when slow)."""
    readers = (
        {"a": lambda peers: None, "b": lambda peers: None}
        if why == "no reader works"
        else {"a": lambda peers: []}
    )
    kernel = KernelSockets(readers)  # probed: a socket of its own with bytes queued
    assert kernel.blind
    now = [0.0]
    f = SendQueueFence(
        hold_s=HOLD_S,
        kernel=kernel,
        addresses=PeerAddresses(resolve=lambda host: {PEER}),
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    with caplog.at_level(logging.WARNING):
        f.say_at_start()
        assert f.wait(f"{PEER}:1", bound_s=60, started=0) == pytest.approx(HOLD_S)
    assert f.blind_holds == 1 and f.fence_seconds == pytest.approx(HOLD_S)
    said = [r.getMessage() for r in caplog.records]
    assert any("cannot read this host's TCP send queues" in m for m in said)
    assert any(f"{HOLD_S:.0f} s" in m and "sock_diag" in m for m in said)


def test_a_host_name_resolving_to_another_address_than_the_transports_is_held():
    """The transport connected to the first address the name gave; the name now
    gives another: the fence sees no socket to the peer and must not pass. It
    waits for the sockets of the host that hold bytes, wherever they go, for as
    long as queued bytes can land."""
    kernel = Kernel([sock(FIN_WAIT1, 4198185, 45796, 0, remote=(PEER, 16860))])
    answers = iter([{"10.231.39.9"}] * 10)
    f, now = fence(kernel, addresses=PeerAddresses(resolve=lambda host: next(answers)))
    assert f.wait("decode.example:15000", bound_s=60, started=0) == pytest.approx(
        HOLD_S
    )
    assert f.fenced == 1


def test_with_no_socket_to_the_peer_the_hosts_sockets_holding_bytes_are_waited_for():
    """The transport's connection (to an address the name no longer gives) is
    delivered on the third reading: the write ends then, not at the bound."""
    elsewhere = ("10.231.39.9", 16860)
    kernel = Kernel(
        [],  # nothing to the addresses the name gives
        [
            sock(FIN_WAIT1, 4096, 45796, 0, remote=elsewhere),
            sock(ESTABLISHED, 0, 80, 10, remote=("10.0.0.50", 443)),  # nothing queued
        ],
        [sock(FIN_WAIT1, 4096, 45796, 0, remote=elsewhere)],
        [],  # the kernel dropped it
    )
    f, now = fence(kernel)
    waited = f.wait(f"{PEER}:1", bound_s=60, started=0)
    assert 0 < waited < 1 and kernel.reads == 4
    assert f.fenced == 1 and f.blind_holds == 0


def test_a_write_whose_connections_the_kernel_already_dropped_ends_at_once():
    """Cut for good: by the time the transport reports the write failed, the
    kernel has dropped every connection to the peer (its orphan retries ran
    out), and nothing of this host holds bytes: no byte of the write can land,
    and holding its blocks longer would outlast the peers' own hold."""
    kernel = Kernel([], [sock(ESTABLISHED, 0, 80, 10, remote=("10.0.0.50", 443))])
    f, now = fence(kernel)
    assert f.wait(f"{PEER}:1", bound_s=60, started=0) == 0.0
    assert kernel.reads == 2 and f.fenced == 0 and f.blind_holds == 0


def test_every_address_a_session_resolved_to_since_its_first_write_is_watched():
    """A name with A and AAAA records, or DNS round robin: the fence watches every
    answer, those at the first write included."""
    kernel = Kernel(
        [sock(FIN_WAIT1, 100, 1, 0, remote=(PEER, 16860))],
        [],
    )
    answers = iter([{PEER, "2001:db8::3"}, {"10.231.39.9"}])
    addresses = PeerAddresses(resolve=lambda host: next(answers))
    f, _ = fence(kernel, addresses=addresses)
    f.note("decode.example:15000")
    deadline = time.monotonic() + 5
    while (
        not addresses.of_noted("decode.example:15000") and time.monotonic() < deadline
    ):
        time.sleep(0.01)  # the first write's lookup runs off the writer's thread
    assert f.wait("decode.example:15000", bound_s=60, started=0) > 0
    assert f.fenced == 1 and f.blind_holds == 0


def test_an_ip_literal_session_is_not_looked_up():
    calls = []
    addresses = PeerAddresses(resolve=lambda host: calls.append(host) or set())
    addresses.note("[::ffff:10.0.0.7]:5")
    assert addresses.of_noted("[::ffff:10.0.0.7]:5") == {"10.0.0.7"} and not calls


def test_reading_send_queues_only_waits_until_each_queue_emptied_once():
    """/proc/net/tcp has no bytes_acked: a queue that emptied once held nothing of
    the failed write any more."""
    kernel = Kernel(
        [sock(FIN_WAIT1, 500, 1, None)],
        [sock(FIN_WAIT1, 200, 1, None)],
        [sock(ESTABLISHED, 0, 1, None)],
    )
    f, now = fence(kernel)
    assert f.wait(f"{PEER}:1", bound_s=60, started=0) > 0
    assert kernel.reads == 3 and f.fenced == 1


def test_an_rdma_write_with_no_tcp_socket_to_the_peer_is_held_for_the_fabrics_bound():
    kernel = Kernel([])
    f, _ = fence(kernel, rdma=True, rdma_hold_s=10.0)
    assert f.wait(f"{PEER}:1", bound_s=60, started=0) == pytest.approx(10.0)
    assert f.blind_holds == 0


def test_an_rdma_write_on_a_host_whose_kernel_cannot_be_read_holds_the_tcp_bound():
    """The "rdma" protocol falls back to TCP where no RDMA device is found."""
    f, _ = fence(Kernel(None), rdma=True, rdma_hold_s=10.0)
    assert f.wait(f"{PEER}:1", bound_s=60, started=0) == pytest.approx(HOLD_S)
    assert f.blind_holds == 1


def test_concurrent_fences_share_one_kernel_reading_per_poll():
    """Each poll reads the kernel once for every fenced write."""
    reads = []
    gate = threading.Barrier(4)
    done = threading.Event()

    def kernel(peers):
        reads.append(peers)
        if done.is_set():
            return []
        return [sock(FIN_WAIT1, 100, 1, 0, remote=(ip, 1)) for ip in sorted(peers)]

    f = SendQueueFence(
        hold_s=HOLD_S,
        kernel=KernelSockets({"scripted": kernel}, probe=False),
        addresses=PeerAddresses(resolve=lambda host: {host}),
    )
    threads = [
        threading.Thread(
            target=lambda ip=ip: (gate.wait(), f.wait(f"{ip}:1", 60, time.monotonic()))
        )
        for ip in ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4")
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    done.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    # four fences polling every 0.1-0.2 s for 1 s: far fewer reads than 4 x 10
    assert len(reads) <= 16, len(reads)
    assert any(len(p) > 1 for p in reads)  # one reading served several fences


def test_a_write_waiting_on_the_fence_is_counted_while_it_waits():
    """The stats routes show how many failed writes wait for the kernel now (their
    blocks are out of use meanwhile), and each leaves the count when it ends."""
    release = threading.Event()
    seen: list[int] = []
    f = None

    def kernel(peers):
        if f is not None:
            seen.append(f.fencing)
        return [] if release.is_set() else [sock(FIN_WAIT1, 100, 1, 0)]

    f = SendQueueFence(
        hold_s=HOLD_S,
        kernel=KernelSockets({"scripted": kernel}, probe=False),
        addresses=PeerAddresses(resolve=lambda host: {PEER}),
        sleep=lambda s: time.sleep(0.001),
    )
    t = threading.Thread(target=f.wait, args=(f"{PEER}:1", 30, 0.0))
    t.start()
    deadline = time.monotonic() + 5
    while f.fencing != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert f.fencing == 1
    release.set()
    t.join(5)
    assert not t.is_alive()
    assert f.fencing == 0 and f.fenced == 1 and 1 in seen


def test_proc_net_tcp_lines_are_read_for_the_peers_addresses_only():
    # 10.231.39.2:45796 -> 10.231.39.3:16860 FIN-WAIT-1, tx_queue 0x400 (host order)
    v4 = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt"
        "   uid  timeout inode\n"
        "   0: 0227E70A:B2E4 0327E70A:41DC 04 00000400:00000000 01:00000014 00000000"
        "     0        0 0 1 0000000000000000 20 4 0 10 -1\n"
        "   1: 0227E70A:B2E5 0927E70A:0050 01 00000010:00000000 00:00000000 00000000"
        "     0        0 123 1 0000000000000000 20 4 0 10 -1\n"
        "   2: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000"
        "     0        0 124 1 0000000000000000 20 4 0 10 -1\n"
    )
    # ::ffff:10.231.39.2:5000 -> ::ffff:10.231.39.3:16860 ESTABLISHED, tx_queue 5
    v6 = (
        "  sl  local_address                         remote_address                "
        "        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0000000000000000FFFF00000227E70A:1388 0000000000000000FFFF00000327E70A:41DC"
        " 01 00000005:00000000 00:00000000 00000000     0        0 125 1 "
        "0000000000000000 20 4 0 10 -1\n"
    )
    got = parse_proc_net_tcp(v4, frozenset({PEER})) + parse_proc_net_tcp(
        v6, frozenset({PEER})
    )
    assert [(s.local, s.remote, s.state, s.send_q, s.bytes_acked) for s in got] == [
        (("10.231.39.2", 45796), (PEER, 16860), FIN_WAIT1, 1024, None),
        (("10.231.39.2", 5000), (PEER, 16860), ESTABLISHED, 5, None),
    ]


@pytest.fixture
def stalled_socket():
    """A real loopback connection whose peer does not read: its sender's queue
    holds bytes, as a failed write's does after a link cut."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client = socket.create_connection(listener.getsockname(), timeout=2)
        server, _ = listener.accept()
        client.setblocking(False)
        sent = 0
        for _ in range(256):
            try:
                sent += client.send(bytes(65536))
            except BlockingIOError:
                break
        try:
            yield client, server, sent
        finally:
            client.close()
            server.close()


@pytest.mark.parametrize("read", [read_sock_diag, read_proc_net_tcp])
def test_the_real_kernel_shows_a_stalled_sockets_queue(read, stalled_socket):
    client, _, _ = stalled_socket
    seen = read(frozenset({"127.0.0.1"}))
    assert seen is not None
    key = (client.getsockname()[:2], client.getpeername()[:2])
    mine = [s for s in seen if s.key == key]  # a local port may be reused meanwhile
    assert len(mine) == 1 and mine[0].send_q > 0
    if read is read_sock_diag:
        assert mine[0].bytes_acked is not None and mine[0].rto_s


def test_the_probe_finds_netlink_sock_diag_on_this_host():
    assert probe_reader() == "sock_diag"


def test_without_ss_on_the_path_a_real_stalled_socket_is_still_waited_for(
    stalled_socket, monkeypatch
):
    """Measured before: with no ``ss`` on the writer's PATH the fence returned at
    once while the kernel still held the write's bytes."""
    monkeypatch.setenv("PATH", "/nonexistent")
    client, server, sent = stalled_socket
    f = SendQueueFence(hold_s=HOLD_S)
    assert not f.kernel.blind

    def drain():
        time.sleep(0.6)  # the peer reads again: the kernel delivers the queue
        server.settimeout(5)
        got = 0
        while got < sent:
            got += len(server.recv(1 << 20))

    t = threading.Thread(target=drain)
    t.start()
    port = client.getpeername()[1]
    waited = f.wait(f"127.0.0.1:{port}", bound_s=60, started=time.monotonic())
    t.join(10)
    assert waited >= 0.5 and f.fenced == 1 and f.blind_holds == 0


def test_the_fences_counters_are_served_with_the_push_and_layerwise_stats(c_server):
    from types import SimpleNamespace

    write = SimpleNamespace(
        fence=SimpleNamespace(fenced=3, blind_holds=2, fence_seconds=41.25, fencing=1)
    )
    assert fence_stats(write) == {
        "fenced_writes": 3,
        "blind_holds": 2,
        "fence_seconds": 41.25,
        "fencing_now": 1,
    }
    assert fence_stats(lambda *a: 0) == {
        "fenced_writes": 0,
        "blind_holds": 0,
        "fence_seconds": 0,
        "fencing_now": 0,
    }
    c = c_server()
    stats = c.http.get("/push/stats").json()
    assert stats["fenced_writes"] == 0 and stats["overdue_now"] == 0
    assert stats["fencing_now"] == 0 and stats["blind_holds"] == 0


def test_the_kernel_filters_the_dump_by_every_address_of_the_peer():
    """IPv4, IPv6 and an IPv4 client on a dual-stack listener (seen as
    IPv4-mapped by the kernel): kept for the peer's addresses, left out for
    another's, by the bytecode the dump carries."""
    with (
        socket.create_server(("127.0.0.1", 0)) as v4,
        socket.create_server(
            ("::", 0), family=socket.AF_INET6, dualstack_ipv6=True
        ) as dual,
    ):
        conns = [
            socket.create_connection(("127.0.0.1", v4.getsockname()[1])),
            socket.create_connection(("::1", dual.getsockname()[1])),
            socket.create_connection(("127.0.0.1", dual.getsockname()[1])),
        ]
        try:
            # each connection by its whole address pair (a local port can be
            # reused meanwhile), and the accepted side of the IPv4 client on the
            # dual-stack listener: an IPv6 socket whose remote address is
            # IPv4-mapped, read as 127.0.0.1
            ours = {(c.getsockname()[:2], c.getpeername()[:2]) for c in conns}
            ours.add((("127.0.0.1", dual.getsockname()[1]), conns[2].getsockname()[:2]))

            def mine(peers):
                seen = read_sock_diag(frozenset(peers))
                assert seen is not None
                return {s.key for s in seen if s.key in ours}

            assert len(mine({"127.0.0.1", "::1", "10.0.0.1"})) == 4
            assert len(mine({"::1"})) == 1
            assert mine({"127.0.0.2", "2001:db8::1"}) == set()
        finally:
            for c in conns:
                c.close()


def test_a_dropped_connection_ends_only_once_the_peers_engine_has_read_it_and_closed():
    """Acknowledged is not yet landed: the peer's kernel acknowledged the orphan's
    last bytes (FIN_WAIT2), but they may still wait in its receive queue until the
    peer's engine reads them to the end and closes its side (TIME_WAIT here)."""
    fin_wait2, time_wait = 5, 6
    kernel = Kernel(
        [sock(FIN_WAIT1, 4096, 7, 1000)],  # when the write returned
        [sock(fin_wait2, 0, 7, 5096)],  # all acknowledged, the peer still reading
        [sock(fin_wait2, 0, 7, 5096)],
        [sock(time_wait, 0, 7, 5096)],  # the peer's engine read to EOF and closed
    )
    f, _ = fence(kernel)
    f.wait(f"{PEER}:1", bound_s=60, started=0)
    assert kernel.reads == 4
