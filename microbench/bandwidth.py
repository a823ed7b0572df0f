"""The transfer engine's own write bandwidth on this machine (no vLLM).

Two ways to measure it:

``engine_write_bandwidth(total_bytes, entry_bytes)``
    Two Mooncake TransferEngines in this process (threads on every core), one
    ``batch_transfer_sync_write`` of ``total_bytes`` in ``entry_bytes`` entries.
    microbench/push's "line rate" of its TTFT bound, and mb7's per-layer write.

``placed_write_bandwidth(layout, src_cpus=..., dst_cpus=...)``
    The write as a push does it: a writer process and a reader process (each
    its own engine, pinned like C's and D's instances: the CPU backend binds a
    whole instance, the engine's threads included, to its cores), the entry
    layout of the push (``WriteLayout``: entry count and size; a push has one
    entry per KV tensor and run of contiguous blocks), and the push's writer
    (connector/push/source_writer.py: the engine's busy-polling sync call on a thread
    at nice 19). microbench/push compares C's write seconds with this.

Both check that every byte landed and return the seconds of each repetition.

The engine logs to the process's own stderr (glog lines such as
``transfer_metadata.cpp:616] removeSegmentDesc``) and importing vLLM's
connector pieces logs to stdout, so the benchmarks run their probes in a child
process whose output goes to a log file they name: ``engine_write_bandwidths``
and ``placed_write_bandwidth_logged`` (``python -m microbench.bandwidth``, an
interface between this module and its child only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from microbench.common import run_logged

SETUP_TIMEOUT_S = 120.0  # a child's engine start-up and registration
LOGGED_TIMEOUT_S = 900.0  # a logged probe child: vLLM's import, engines, every write


@dataclass(frozen=True)
class WriteLayout:
    """``entries`` entries of ``entry_bytes`` each, written in one batch."""

    entry_bytes: int
    entries: int

    def __post_init__(self) -> None:
        if self.entry_bytes <= 0 or self.entries <= 0:
            raise ValueError(
                f"a write layout needs positive entry bytes and count, got "
                f"{self.entries} entries of {self.entry_bytes} bytes"
            )

    @property
    def total_bytes(self) -> int:
        return self.entry_bytes * self.entries

    @classmethod
    def of_write(cls, total_bytes: int, entries: int) -> WriteLayout:
        """The layout of a write of ``total_bytes`` in ``entries`` entries (as C's push
        stats report it): entries of the mean size. A push's entries are equal when its
        runs of blocks are; otherwise this is the same count and volume, evenly split."""
        if entries <= 0 or total_bytes < entries:
            raise ValueError(f"no layout for {total_bytes} bytes in {entries} entries")
        return cls(total_bytes // entries, entries)

    def describe(self) -> str:
        return f"{self.entries} x {self.entry_bytes / 2**20:.2f} MiB"


def parse_cpus(spec: str | None) -> frozenset[int] | None:
    """ "0", "0-1", "0,2-3" -> CPU set (the connector's parse_cpu_list, which reads
    MOONCAKE_IO_CPUS); None or "" -> None (no pinning)."""
    if not spec:
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
        parse_cpu_list,
    )

    return parse_cpu_list(spec, "CPU list")


def _apply_transport_defaults(protocol: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.transport_env import (
        apply_transport_env_defaults,
    )

    apply_transport_env_defaults(protocol)


def _new_engine(protocol: str):
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({protocol})")
    return e


def engine_write_bandwidth(
    total_bytes: int, entry_bytes: int, protocol: str = "tcp", reps: int = 3
) -> dict:
    """Both engines in this process, unpinned; best of ``reps`` writes."""
    _apply_transport_defaults(protocol)
    src_e, dst_e = _new_engine(protocol), _new_engine(protocol)
    n = max(1, total_bytes // entry_bytes)
    src = np.full(n * entry_bytes, 3, dtype=np.uint8)
    dst = np.zeros(n * entry_bytes, dtype=np.uint8)
    if src_e.register_memory(src.ctypes.data, src.nbytes) or dst_e.register_memory(
        dst.ctypes.data, dst.nbytes
    ):
        raise RuntimeError("Mooncake register_memory failed")
    peer = f"127.0.0.1:{dst_e.get_rpc_port()}"
    srcs = [src.ctypes.data + i * entry_bytes for i in range(n)]
    # every other destination entry, reversed: no accidental contiguity
    dsts = [dst.ctypes.data + i * entry_bytes for i in range(n)][::-1]
    secs = []
    for _ in range(reps):
        dst[:] = 0
        t0 = time.perf_counter()
        rc = src_e.batch_transfer_sync_write(peer, srcs, dsts, [entry_bytes] * n)
        secs.append(time.perf_counter() - t0)
        if rc != 0 or not (dst == 3).all():
            raise RuntimeError(
                f"bandwidth probe: write returned {rc} or landed wrong bytes"
            )
    best = min(secs)
    return {
        "protocol": protocol,
        "bytes": n * entry_bytes,
        "entry_bytes": entry_bytes,
        "seconds": secs,
        "gb_per_s": n * entry_bytes / best / 1e9,
    }


# --- writer and reader in two pinned processes ---------------------------------------


def _pin(cpus: frozenset[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def _reader_main(
    conn: Any, nbytes: int, protocol: str, cpus: frozenset[int] | None
) -> None:
    """Reader process: registers ``nbytes``; answers ("check", v) with whether all are v."""
    try:
        _pin(cpus)
        e = _new_engine(protocol)
        buf = np.zeros(nbytes, dtype=np.uint8)
        if e.register_memory(buf.ctypes.data, buf.nbytes):
            raise RuntimeError("reader: Mooncake register_memory failed")
        conn.send(("ready", e.get_rpc_port(), buf.ctypes.data))
        while (msg := conn.recv())[0] == "check":
            conn.send(("checked", bool((buf == msg[1]).all())))
    except Exception as ex:  # reported to the parent, which raises
        conn.send(("error", f"reader: {ex!r}"))


def _writer_main(
    conn: Any,
    layout: WriteLayout,
    peer: str,
    dst_base: int,
    protocol: str,
    cpus: frozenset[int] | None,
    nice: int,
) -> None:
    """Writer process: on each ("write", v) fills its buffer with v and writes it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_writer import (
            LowPriorityWriter,
        )

        _pin(cpus)
        e = _new_engine(protocol)
        eb, n = layout.entry_bytes, layout.entries
        src = np.zeros(layout.total_bytes, dtype=np.uint8)
        if e.register_memory(src.ctypes.data, src.nbytes):
            raise RuntimeError("writer: Mooncake register_memory failed")
        srcs = [src.ctypes.data + i * eb for i in range(n)]
        dsts = [dst_base + i * eb for i in range(n)][::-1]  # no accidental contiguity
        write = LowPriorityWriter(e.batch_transfer_sync_write, nice=nice)
        conn.send(("ready",))
        while (msg := conn.recv())[0] == "write":
            src[:] = msg[1]
            t0 = time.perf_counter()
            rc = write(peer, srcs, dsts, [eb] * n)
            conn.send(("wrote", rc, time.perf_counter() - t0))
    except Exception as ex:
        conn.send(("error", f"writer: {ex!r}"))


def _expect(conn: Any, proc: Any, kind: str, what: str) -> tuple:
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while not conn.poll(0.1):
        if not proc.is_alive():
            raise RuntimeError(
                f"bandwidth probe: the {what} process exited (code "
                f"{proc.exitcode}) without answering; its stderr says why"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"bandwidth probe: no answer from the {what} in {SETUP_TIMEOUT_S:.0f} s"
            )
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"bandwidth probe: {msg[1]}")
    if msg[0] != kind:
        raise RuntimeError(
            f"bandwidth probe: the {what} sent {msg[0]!r}, expected {kind!r}"
        )
    return msg


def placed_write_bandwidth(
    layout: WriteLayout,
    *,
    src_cpus: str | None,
    dst_cpus: str | None,
    protocol: str = "tcp",
    reps: int = 3,
    nice: int = 19,
) -> dict:
    """Write ``layout`` from a process on ``src_cpus`` into one on ``dst_cpus``,
    ``reps`` times, through the push's low-priority writer at ``nice``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_writer import (
        WRITER_NICE,
    )

    _apply_transport_defaults(protocol)  # inherited by the children
    src_set, dst_set = parse_cpus(src_cpus), parse_cpus(dst_cpus)
    ctx = mp.get_context("spawn")
    r_conn, r_child = ctx.Pipe()
    w_conn, w_child = ctx.Pipe()
    reader = ctx.Process(
        target=_reader_main,
        args=(r_child, layout.total_bytes, protocol, dst_set),
        daemon=True,
    )
    reader.start()
    writer = None
    try:
        _, port, dst_base = _expect(r_conn, reader, "ready", "reader")
        writer = ctx.Process(
            target=_writer_main,
            daemon=True,
            args=(
                w_child,
                layout,
                f"127.0.0.1:{port}",
                dst_base,
                protocol,
                src_set,
                nice,
            ),
        )
        writer.start()
        _expect(w_conn, writer, "ready", "writer")
        secs = []
        for i in range(reps + 1):  # the first write opens the connections: not counted
            value = i % 250 + 1
            w_conn.send(("write", value))
            _, rc, s = _expect(w_conn, writer, "wrote", "writer")
            r_conn.send(("check", value))
            _, landed = _expect(r_conn, reader, "checked", "reader")
            if rc != 0 or not landed:
                raise RuntimeError(
                    f"bandwidth probe: write {i} of {layout.describe()} returned "
                    f"{rc}, bytes {'landed' if landed else 'NOT landed'}"
                )
            if i:
                secs.append(s)
    finally:
        for conn, proc in ((w_conn, writer), (r_conn, reader)):
            if proc is None:
                continue
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("stop",))
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    med = statistics.median(secs)
    return {
        "protocol": protocol,
        "bytes": layout.total_bytes,
        "entry_bytes": layout.entry_bytes,
        "entries": layout.entries,
        "src_cpus": src_cpus,
        "dst_cpus": dst_cpus,
        "poller_nice": nice,
        "push_writer_nice": WRITER_NICE,
        "seconds": secs,
        "median_s": med,
        "gb_per_s": layout.total_bytes / med / 1e9,
        "best_gb_per_s": layout.total_bytes / min(secs) / 1e9,
    }


# --- the probes in a child process, its output in a log file -------------------------


def engine_write_bandwidths(
    probes: list[tuple[int, int]],
    protocol: str = "tcp",
    reps: int = 3,
    *,
    log_path: Path,
) -> list[dict]:
    """``engine_write_bandwidth(total_bytes, entry_bytes, protocol, reps)`` for each
    ``(total_bytes, entry_bytes)`` of ``probes``, all in one child process whose
    output (the engine's and vLLM's log lines) is appended to ``log_path``."""
    kwargs = {"probes": [list(p) for p in probes], "protocol": protocol, "reps": reps}
    return run_logged(
        "microbench.bandwidth",
        ["engine", "--kwargs", json.dumps(kwargs)],
        log_path,
        timeout=LOGGED_TIMEOUT_S,
    )


def placed_write_bandwidth_logged(
    layout: WriteLayout,
    *,
    log_path: Path,
    src_cpus: str | None,
    dst_cpus: str | None,
    protocol: str = "tcp",
    reps: int = 3,
    nice: int = 19,
) -> dict:
    """``placed_write_bandwidth`` in a child process (its writer and reader are that
    child's children) whose output is appended to ``log_path``."""
    kwargs = {
        "layout": asdict(layout),
        "src_cpus": src_cpus,
        "dst_cpus": dst_cpus,
        "protocol": protocol,
        "reps": reps,
        "nice": nice,
    }
    return run_logged(
        "microbench.bandwidth",
        ["placed", "--kwargs", json.dumps(kwargs)],
        log_path,
        timeout=LOGGED_TIMEOUT_S,
    )


def main(argv: list[str] | None = None) -> int:
    """The child of the two functions above: one call, its result as JSON."""
    ap = argparse.ArgumentParser(prog="python -m microbench.bandwidth")
    ap.add_argument("call", choices=["engine", "placed"])
    ap.add_argument("--kwargs", required=True, help="the call's arguments, JSON")
    ap.add_argument(
        "--result", type=Path, required=True, help="where the JSON result goes"
    )
    args = ap.parse_args(argv)
    kw = json.loads(args.kwargs)
    if args.call == "engine":
        result: Any = [
            engine_write_bandwidth(total, entry, kw["protocol"], kw["reps"])
            for total, entry in kw["probes"]
        ]
    else:
        result = placed_write_bandwidth(WriteLayout(**kw.pop("layout")), **kw)
    args.result.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
