"""Two real Mooncake transfer engines in two processes, for tests of the engine's
failure semantics (tests/integration/test_engine_failure_semantics.py).

    python -m harness.engine_peer receiver NBYTES
        registers NBYTES of zeros, prints "READY <rpc_port> <addr>", then answers
        each line "count" on stdin with "COUNT <landed>": how many of the buffer's
        64 KiB chunks hold the writer's bytes (their last byte is non-zero).
    python -m harness.engine_peer writer PORT ADDR NBYTES MODE
        registers NBYTES of 0xAB, makes a 1-byte write to open the segment
        (the handshake; at offset 0, which no count looks at), prints "READY", waits for a line on stdin, then writes the
        whole buffer with MODE "sync" (the engine's batch_transfer_sync_write) or
        "terminal" (this series' TerminalWriter) and prints "RETURNED <rc> <n> <f>",
        n the engine writes it submitted, f the seconds its send-queue fence
        waited (0 in mode sync); again for each further "go", until another line.
        With $VMP_SS_TRACE set, the writer appends this namespace's TCP sockets
        (``ss -tinHOn``) to that file every second, each set headed by the
        seconds since the "go".

Both bind the engine to $VMP_ENGINE_HOST (default 127.0.0.1; P2PHANDSHAKE, TCP);
the writer finds the receiver at $VMP_PEER_HOST (default 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from harness.runtime_env import vllm_env

ROOT = Path(__file__).resolve().parent.parent

CHUNK = 64 << 10


def _engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    host = os.environ.get("VMP_ENGINE_HOST", "127.0.0.1")
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("engine_peer: the transfer engine did not start")
    return engine


def receiver(nbytes: int) -> None:
    engine = _engine()
    buf = np.zeros(nbytes, dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, nbytes) != 0:
        raise SystemExit("engine_peer: register_memory failed")
    print(f"READY {engine.get_rpc_port()} {buf.ctypes.data}", flush=True)
    last = np.arange(CHUNK - 1, nbytes, CHUNK)
    for line in sys.stdin:
        if line.strip() == "count":
            print(f"COUNT {int(np.count_nonzero(buf[last]))}", flush=True)


def writer(port: int, addr: int, nbytes: int, mode: str) -> None:
    engine = _engine()
    src = np.full(nbytes, 0xAB, dtype=np.uint8)
    if engine.register_memory(src.ctypes.data, nbytes) != 0:
        raise SystemExit("engine_peer: register_memory failed")
    session = f"{os.environ.get('VMP_PEER_HOST', '127.0.0.1')}:{port}"
    # The segment handshake has no timeout of ours: do it while the peer runs.
    if engine.transfer_sync_write(session, src.ctypes.data, addr, 1) != 0:
        raise SystemExit("engine_peer: the first write (handshake) failed")
    engine = _CountingEngine(engine)
    if mode == "terminal":
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
            ExtConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.engine_write import (
            TerminalWriter,
        )

        config = ExtConfig.from_env()
        write = TerminalWriter(engine, config)
        ready = (
            f"READY {config.engine_write_bound_s(nbytes):.1f}"  # what peers hold for
        )
    elif mode == "sync":
        write = engine.batch_transfer_sync_write
        ready = "READY"
    else:
        raise SystemExit(f"engine_peer: unknown mode {mode!r}")
    # Entries of 32 MiB, as a KV write has many entries.
    step = 32 << 20
    offs = list(range(0, nbytes, step))
    srcs = [src.ctypes.data + o for o in offs]
    dsts = [addr + o for o in offs]
    lens = [min(step, nbytes - o) for o in offs]
    print(ready, flush=True)
    fence = getattr(write, "fence", None)
    # Each "go" writes the buffer once; anything else (or EOF) ends the process.
    # The engine's threads stay alive in between.
    for line in sys.stdin:
        if line.strip() != "go":
            break
        submitted = engine.submitted
        fenced = getattr(fence, "fence_seconds", 0.0)
        with _socket_trace(os.environ.get("VMP_SS_TRACE")):
            rc = write(session, srcs, dsts, lens)
        fenced = getattr(fence, "fence_seconds", 0.0) - fenced
        print(f"RETURNED {rc} {engine.submitted - submitted} {fenced:.1f}", flush=True)


@contextlib.contextmanager
def _socket_trace(path: str | None) -> Iterator[None]:
    """While the block runs: this namespace's TCP sockets, every second, appended
    to ``path`` (nothing when None). What a failed write waited for, afterwards."""
    if not path:
        yield
        return
    done = threading.Event()
    t0 = time.monotonic()

    def trace() -> None:
        with open(path, "a") as out:
            while True:
                out.write(f"--- {time.monotonic() - t0:.1f} s\n")
                out.write(_ss())
                out.flush()
                if done.wait(1.0):
                    return

    thread = threading.Thread(target=trace, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=10)


def _ss() -> str:
    """``ss -tinHOn``'s view of this namespace's TCP sockets, for the trace."""
    try:
        r = subprocess.run(
            ["ss", "-tinHOn"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(ss failed: {e})\n"
    return r.stdout


class _CountingEngine:
    """The engine, counting the writes submitted to it (RETURNED's second field)."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.submitted = 0

    def transfer_submit_write(self, *args: Any) -> int:
        self.submitted += 1
        return self._engine.transfer_submit_write(*args)

    def batch_transfer_sync_write(self, *args: Any) -> int:
        self.submitted += 1
        return self._engine.batch_transfer_sync_write(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class EnginePeer:
    """This module run as a subprocess, driven line by line (tests)."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ):
        """``env``: added to the environment; ``prefix``: a command the Python
        process runs under (e.g. a new network namespace)."""
        env = {
            **vllm_env(),
            "MC_LOG_LEVEL": "ERROR",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "harness.engine_peer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.write_bound_s: float | None = None  # a terminal writer's, once READY
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float) -> tuple[str, float]:
        """The next line starting with prefix, and when it was read."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {timeout} s") from None
            if line.startswith(prefix):
                return line, time.monotonic()

    def said(self, prefix: str) -> bool:
        """Whether a line starting with prefix was read and not yet expected."""
        with self.lines.mutex:
            return any(line.startswith(prefix) for line in self.lines.queue)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


def landed(receiver: EnginePeer) -> int:
    """The receiver's 64 KiB chunks that hold the writer's bytes (while it runs)."""
    receiver.send("count")
    return int(receiver.expect("COUNT", 30)[0].split()[1])


# The receiver's link is limited so that a write is still under way when it is cut,
# on any machine: at full speed the bridge carries 512 MiB in well under a second, and
# a cut 80 ms into the write once came after it had ended (the write returned 0).
CUT_LINK_MBIT = 800  # 512 MiB in about 5.4 s


def cut_mid_write(topo: Any, writer: EnginePeer, recv: EnginePeer) -> float:
    """Start the writer's write over the receiver's link limited to CUT_LINK_MBIT,
    and cut that link once the first of its bytes have landed; returns when the
    link was cut. Raises AssertionError when the write ended before the cut (a
    test would see no cut) or no byte landed within 30 s."""
    topo.limit("receiver", mbit=CUT_LINK_MBIT)
    writer.send("go")
    deadline = time.monotonic() + 30
    while landed(recv) == 0:
        assert time.monotonic() < deadline, "no byte of the write landed within 30 s"
        time.sleep(0.01)
    topo.link_down("receiver")
    t_cut = time.monotonic()
    assert not writer.said("RETURNED"), "the write ended before its link was cut"
    return t_cut


@contextlib.contextmanager
def terminal_write_on_two_hosts(
    nbytes: int, env: dict[str, str], writer_sysctls: dict[str, int] | None = None
) -> Iterator[tuple[Any, EnginePeer, EnginePeer]]:
    """A receiver and a writer (this series' TerminalWriter) on two hosts of their
    own (harness/netns.py), the writer READY to write ``nbytes`` (send "go"):
    (the topology, the writer, the receiver). ``writer.write_bound_s`` is the
    bound the writer's configuration puts on the write (what peers hold blocks
    for), read in its namespace after ``writer_sysctls`` were set there. Needs
    root."""
    from harness import netns

    with netns.Topology(["writer", "receiver"]) as topo:
        w, r = topo.host("writer"), topo.host("receiver")
        for name, value in (writer_sysctls or {}).items():
            w.sysctl(name, value)
        recv = EnginePeer(
            "receiver",
            str(nbytes),
            env={**env, "VMP_ENGINE_HOST": r.ip},
            prefix=r.exec_prefix(),
        )
        writer = None
        try:
            _, port, addr = recv.expect("READY", 60)[0].split()
            writer = EnginePeer(
                "writer",
                port,
                addr,
                str(nbytes),
                "terminal",
                env={**env, "VMP_ENGINE_HOST": w.ip, "VMP_PEER_HOST": r.ip},
                prefix=w.exec_prefix(),
            )
            writer.write_bound_s = float(writer.expect("READY", 120)[0].split()[1])
            yield topo, writer, recv
            writer.send("exit")
        finally:
            if writer is not None:
                writer.close()
            recv.close()


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "receiver":
        receiver(int(sys.argv[2]))
    else:
        writer(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
