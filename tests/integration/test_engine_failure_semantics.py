"""The real Mooncake engine's failure semantics, and why every write of this
series goes through TerminalWriter.

Two processes on loopback, each with the real transfer engine (TCP,
MC_TRANSFER_TIMEOUT=5). The receiver is stopped (SIGSTOP) for STOP_S seconds
while the writer writes 256 MiB into it; then it resumes. "No byte after the
end": once the write call has returned, the receiver's buffer must not change
any more.

- The engine's batch_transfer_sync_write returns -1 on its own timeout while
  the receiver is stopped, and its bytes land after that (the hazard: a
  returned call is no proof of anything).
- TerminalWriter returns only once every entry is terminal: the bytes it
  wrote have all landed when it returns, and nothing changes afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from harness.engine_peer import (
    EnginePeer,
    cut_mid_write,
    landed,
    terminal_write_on_two_hosts,
)

pytestmark = pytest.mark.integration

NBYTES = 256 << 20
CHUNKS = NBYTES // (64 << 10)
STOP_S = 9
ENGINE_TIMEOUT_S = 5
ENV = {"MC_TRANSFER_TIMEOUT": str(ENGINE_TIMEOUT_S)}


def write_to_a_stopped_receiver(mode: str) -> dict:
    """Returns the writer's rc, when it returned relative to the stop and to the
    resume, and the receiver's landed chunks at the writer's return and 3 s later."""
    recv = EnginePeer("receiver", str(NBYTES), env=ENV)
    writer = None
    try:
        _, port, addr = recv.expect("READY", 60)[0].split()
        writer = EnginePeer("writer", port, addr, str(NBYTES), mode, env=ENV)
        writer.expect("READY", 120)
        os.kill(recv.proc.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        writer.send("go")
        try:
            line, t_ret = writer.expect("RETURNED", STOP_S)
        except AssertionError:
            line = None
        os.kill(recv.proc.pid, signal.SIGCONT)
        t_cont = time.monotonic()
        if line is None:
            line, t_ret = writer.expect("RETURNED", 120)
        recv.send("count")  # read once the receiver runs again
        at_return = int(recv.expect("COUNT", 30)[0].split()[1])
        time.sleep(3)
        recv.send("count")
        later = int(recv.expect("COUNT", 30)[0].split()[1])
        writer.send("exit")
        return {
            "rc": int(line.split()[1]),
            "returned_after_stop_s": t_ret - t_stop,
            "returned_while_stopped": t_ret < t_cont,
            "landed_at_return": at_return,
            "landed_later": later,
        }
    finally:
        if writer is not None:
            writer.close()
        recv.close()


def test_the_engines_sync_write_returns_minus_one_and_its_bytes_land_afterwards():
    r = write_to_a_stopped_receiver("sync")
    assert r["rc"] == -1, r
    assert r["returned_while_stopped"], r
    assert ENGINE_TIMEOUT_S - 0.5 < r["returned_after_stop_s"] < STOP_S, r
    # the hazard: bytes of a write that "failed" landed after the call returned
    assert r["landed_later"] > r["landed_at_return"], r
    assert r["landed_later"] == CHUNKS, r


def test_a_terminal_write_returns_only_once_no_byte_of_it_can_land():
    r = write_to_a_stopped_receiver("terminal")
    assert not r["returned_while_stopped"], r
    assert r["rc"] == 0, r
    assert r["landed_at_return"] == CHUNKS, r
    assert r["landed_later"] == r["landed_at_return"], r


# ---- a link cut past the transport's no-progress watchdog --------------------------

CUT_NBYTES = 512 << 20
CUT_S = 40  # longer than the TCP transport's 30 s no-progress watchdog
WATCH_AFTER_S = 20  # late bytes came 7-13 s after the return in measurements


def write_across_a_link_cut(env: dict[str, str] | None = None) -> dict:
    """Writer and receiver on two hosts (network namespaces on a bridge); the
    receiver's link is cut while a 512 MiB terminal write is under way and restored
    after CUT_S. Returns the writer's rc and the receiver's landed chunks when
    the write returned and WATCH_AFTER_S after that (and after the link came
    back)."""
    with terminal_write_on_two_hosts(CUT_NBYTES, {**ENV, **(env or {})}) as (
        topo,
        writer,
        recv,
    ):
        t_cut = cut_mid_write(topo, writer, recv)
        line, t_ret = None, 0.0
        with contextlib.suppress(AssertionError):  # returned during the cut
            line, t_ret = writer.expect("RETURNED", CUT_S)
        topo.link_up("receiver")
        t_up = time.monotonic()
        if line is None:
            line, t_ret = writer.expect("RETURNED", 400)
        at_return = landed(recv)
        time.sleep(max(0.0, max(t_ret, t_up) + WATCH_AFTER_S - time.monotonic()))
        return {
            "rc": int(line.split()[1]),
            "returned_after_cut_s": round(t_ret - t_cut, 1),
            "returned_after_link_up_s": round(t_ret - t_up, 1),
            "landed_at_return": at_return,
            "landed_later": landed(recv),
        }


@pytest.mark.hosts
def test_a_failed_write_returns_only_once_the_kernel_holds_none_of_its_bytes():
    """The transport drops the stalled connections after 30 s and the engine
    reports their tasks FAILED, but their bytes stay in the kernel's send queues
    (FIN-WAIT-1 orphans) and are delivered when the link returns. The terminal
    write must return only once they were delivered or dropped: no byte of it
    lands afterwards."""
    r = write_across_a_link_cut()
    assert r["rc"] == -1, r
    assert r["landed_later"] == r["landed_at_return"], (
        f"bytes of a write that returned -1 landed after it returned: {r}"
    )


# ---- a link cut for good: how long peers must hold -------------------------------

# The writer's kernel gives up on the orphaned connections at the first retransmission
# timer past the span of this many retransmissions, about 52 s after the cut (the
# default, 8, takes about 104 s); either is past the engine's own rule (about 40 s
# with MC_TRANSFER_TIMEOUT=5: handshake, call timeout, 30 s watchdog).
ORPHAN_RETRIES = 7


# The writer's transport opens one connection to the receiver, as transport_env.py
# sets it. When its watchdog drops it, the entries no connection had taken yet are
# still queued, and the transport connects again for them before it fails them.
ONE_LANE = {"MC_TCP_LANES_PER_PEER": "1"}


def cut_off_for_good(env: dict[str, str], orphan_retries: int, stall_s: float) -> None:
    """The receiver's link is cut while the write is under way and not restored until the
    write has returned. Peers hold blocks for a write for the writer's bound
    (ExtConfig.engine_write_bound_s: D's push hold, D's pull give-up against P's
    timeout), so the write must end within it, and once it has ended no byte of
    it may land, even when the link comes back. ``stall_s``: the write must have
    stalled at least this long (else the cut was not seen).

    The receiver is reached as behind a router (the writer's neighbour entry for
    it never fails): the transport's connect again after its watchdog lasts the
    kernel's whole SYN span, as when the router's own address still answers. With
    ARP failing instead, the connect ends after about 3 s; the engine's four lanes,
    on a loaded machine, once took 133 s for the first, and the write returned
    174.4 s after the cut, past the bound of the orphans alone."""
    with terminal_write_on_two_hosts(
        CUT_NBYTES,
        {**env, **ONE_LANE},
        writer_sysctls={"net.ipv4.tcp_orphan_retries": orphan_retries},
    ) as (topo, writer, recv):
        topo.pin_neighbour("writer", "receiver")
        bound = writer.write_bound_s
        t_cut = cut_mid_write(topo, writer, recv)
        line, t_ret = writer.expect("RETURNED", bound + 120)
        took = t_ret - t_cut
        topo.link_up("receiver")
        at_return = landed(recv)
        time.sleep(WATCH_AFTER_S / 2)
        later = landed(recv)
    fenced = float(line.split()[3])
    print(
        f"cut for good: the write returned {took:.1f} s after the cut (bound {bound:.1f} s; "
        f"{fenced:.1f} s of it waiting for the kernel's send queues)"
    )
    assert int(line.split()[1]) == -1, line
    assert took > stall_s, (
        f"the write ended {took:.1f} s after the cut: no stall of {stall_s:g} s was seen"
    )
    assert took <= bound, (
        f"the write ended {took:.1f} s after the cut ({fenced:.1f} s of it waiting "
        f"for the kernel's send queues), past the {bound:.1f} s its peers hold blocks "
        "for: they would have freed them while its bytes could still land"
    )
    assert later == at_return, (
        f"bytes landed after the write had returned: {at_return} -> {later} chunks"
    )


@pytest.mark.hosts
def test_a_write_cut_off_for_good_ends_within_the_bound_peers_hold_for():
    cut_off_for_good(ENV, ORPHAN_RETRIES, 30)


# The transport's watchdog raised above what the bound once assumed (30 s): with one
# orphan retry that bound was 5 + 5 + 61 s, and a write cut off for good outlived it
# (it returned 106.9 s after the cut: the watchdog, then the orphan's next timer).
RAISED_WATCHDOG_S = 80


@pytest.mark.hosts
def test_a_raised_transport_watchdog_raises_the_bound_peers_hold_for():
    """The transport keeps a stalled connection, and its queued bytes, until its
    watchdog (here RAISED_WATCHDOG_S) drops it: the write ends only after that,
    and the bound its peers hold blocks for must cover it."""
    env = {
        **ENV,
        "MC_TCP_PROGRESS_TIMEOUT_SEC": str(RAISED_WATCHDOG_S),
        "MC_TCP_STATUS_TIMEOUT_SEC": str(RAISED_WATCHDOG_S),
    }
    cut_off_for_good(env, 1, RAISED_WATCHDOG_S - 5)


# ---- a peer whose writes keep failing ----------------------------------------------


def test_a_peer_whose_writes_keep_failing_is_refused_without_a_write():
    """The receiver is killed (its engine's port closed); the writer writes to it
    again and again. After a few failed writes in a row (peer_refusal.py) the
    writer refuses the peer: the next write fails at once without submitting
    anything to the engine (no byte of it can land anywhere)."""
    recv = EnginePeer("receiver", str(1 << 20), env=ENV)
    writer = None
    runs = []
    try:
        _, port, addr = recv.expect("READY", 60)[0].split()
        writer = EnginePeer("writer", port, addr, str(1 << 20), "terminal", env=ENV)
        writer.expect("READY", 120)
        recv.close()
        for _ in range(10):
            t0 = time.monotonic()
            writer.send("go")
            line, t_ret = writer.expect("RETURNED", 120)
            _, rc, submitted, _ = line.split()
            runs.append((int(rc), int(submitted), round(t_ret - t0, 2)))
            if runs[-1][1] == 0:
                break
        writer.send("exit")
    finally:
        if writer is not None:
            writer.close()
        recv.close()
    print(f"(rc, engine writes submitted, seconds) per write: {runs}")
    assert all(rc == -1 for rc, _, _ in runs), runs
    assert runs[-1][1] == 0, f"a peer whose writes keep failing was written to: {runs}"
    assert len(runs) >= 3, f"refused after {len(runs) - 1} failed write(s): {runs}"
    assert all(n >= 1 for _, n, _ in runs[:-1]), runs


@pytest.mark.hosts
def test_a_failed_write_whose_fence_cannot_read_the_kernel_is_held_until_nothing_lands():
    """As above, with a fence that cannot read the kernel's send queues (no
    sock_diag, no /proc/net/tcp). Measured before, with no ``ss`` on the writer's
    PATH: the write returned -1 41.9 s after the cut, and 2,494,464 bytes landed
    after it returned. It must hold for the bound: nothing lands afterwards."""
    r = write_across_a_link_cut({"MOONCAKE_FAULT_FENCE_BLIND": "1"})
    assert r["rc"] == -1, r
    assert r["landed_later"] == r["landed_at_return"], (
        f"bytes of a write that returned -1 landed after it returned: {r}"
    )
    # held for the kernel's bound on queued bytes (205.4 s with its default
    # orphan retries), counted from the failure, which came after the watchdog
    assert r["returned_after_cut_s"] > 205, r
