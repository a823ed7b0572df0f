"""What one reading of the kernel's send queues costs a failed write's fence, with
many sockets in the network namespace.

Opens ``--sockets`` TCP sockets on loopback (connected pairs), then times each way
of reading the sockets to one peer address: NETLINK_SOCK_DIAG (the fence's reader),
``/proc/net/tcp{,6}`` (its fallback) and ``ss -tinHOn`` (the reader it replaced, a
subprocess), for a peer that none of the sockets goes to (the common case: the
dump is filtered) and for one that every socket goes to.

    python -m microbench.fence_cost [--sockets 6000] [--reps 20]
        -> results/fence_cost.json + a printed table
"""

from __future__ import annotations

import json
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from microbench.common import parser
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.send_queues import (
    read_proc_net_tcp,
    read_sock_diag,
)


def open_pairs(n_sockets: int) -> list[socket.socket]:
    """``n_sockets`` connected loopback sockets (pairs), kept open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n_sockets + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n_sockets + 256), hard))
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    out = [listener]
    for _ in range(n_sockets // 2):
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        out += [client, server]
    return out


def ss_reading(peers: frozenset[str]) -> list[str]:
    r = subprocess.run(
        ["ss", "-tinHOn"], capture_output=True, text=True, timeout=30, check=True
    )
    return [line for line in r.stdout.splitlines() if any(p in line for p in peers)]


def timed(read: Callable[[frozenset[str]], object], peers: frozenset[str], reps: int):
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        read(peers)
        ms.append((time.perf_counter() - t) * 1e3)
    return {
        "median_ms": round(statistics.median(ms), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = parser("fence_cost", __doc__.split("\n")[0])
    ap.add_argument("--sockets", type=int, default=6000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_out(Path("results/fence_cost.json"))
    args = ap.parse_args(argv)
    sockets = open_pairs(args.sockets)
    readers = {"sock_diag": read_sock_diag, "/proc/net/tcp": read_proc_net_tcp}
    if shutil.which("ss"):
        readers["ss -tinHOn (subprocess)"] = ss_reading
    rows = []
    for peers_name, peers in (
        ("no socket to the peer", frozenset({"127.0.0.2"})),
        ("every socket to the peer", frozenset({"127.0.0.1"})),
    ):
        for name, read in readers.items():
            rows.append(
                {"reader": name, "peer": peers_name} | timed(read, peers, args.reps)
            )
    for s in sockets:
        s.close()
    result = {
        "sockets": len(sockets),
        "reps": args.reps,
        "machine": f"{platform.node()} {platform.machine()} {platform.release()}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(sockets)} TCP sockets in the namespace, {args.reps} readings each")
    print(f"{'reader':<26} {'peer':<26} {'median ms':>9} {'min':>7} {'max':>7}")
    for r in rows:
        print(
            f"{r['reader']:<26} {r['peer']:<26} {r['median_ms']:>9} "
            f"{r['min_ms']:>7} {r['max_ms']:>7}"
        )
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
