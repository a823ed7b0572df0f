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

import os
import signal
import time

import pytest

from harness.engine_peer import EnginePeer

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
