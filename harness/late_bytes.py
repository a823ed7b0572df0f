"""Where a failed write's late bytes come from: a terminal write across a link cut,
with the kernel's TCP sockets on both hosts sampled every half second.

    python -m harness.late_bytes [--nbytes N] [--cut-s S] [--watch-s S] [--out FILE]

Writer and receiver are real Mooncake engines (harness/engine_peer.py, TCP,
MC_TRANSFER_TIMEOUT=5) on two hosts (network namespaces on a bridge,
harness/netns.py); the receiver's link is limited (800 Mbit/s), cut once the
write's first bytes landed, and restored after ``--cut-s``. Each sample records,
per TCP socket between the two hosts, its state, Send-Q and bytes_acked (writer)
or bytes_received (receiver), and how many of the receiver's 64 KiB chunks hold
the writer's bytes (from the link's return on). Prints the timeline and writes it
as JSON.
Needs root (namespaces) and iproute2.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from typing import Any

from harness import netns
from harness.engine_peer import cut_mid_write, landed, terminal_write_on_two_hosts

_FIELDS = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")


def sockets(host: netns.Host, peer_ip: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [*host.exec_prefix(), "ss", "-tinHOn", "dst", peer_ip],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    rows = []
    for line in out.splitlines():
        f = line.split()
        if len(f) < 5:
            continue
        rows.append(
            {
                "state": f[0],
                "send_q": int(f[2]),
                "local": f[3],
                **{k: int(v) for k, v in _FIELDS.findall(line)},
            }
        )
    return rows


def run(nbytes: int, cut_s: float, watch_s: float) -> dict[str, Any]:
    env = {"MC_TRANSFER_TIMEOUT": "5"}
    t0 = time.monotonic()

    def t() -> float:
        return round(time.monotonic() - t0, 2)

    events: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    with terminal_write_on_two_hosts(nbytes, env) as (topo, writer, recv):
        w, r = topo.host("writer"), topo.host("receiver")
        cut_mid_write(topo, writer, recv)
        events["cut"] = t()
        while t() < 600:
            if "link_up" not in events and t() - events["cut"] >= cut_s:
                topo.link_up("receiver")
                events["link_up"] = t()
            try:
                line, _ = writer.expect("RETURNED", 0.5)
                events["returned"] = t()
                events["rc"] = int(line.split()[1])
            except AssertionError:
                pass
            sample: dict[str, Any] = {
                "t": t(),
                "writer": sockets(w, r.ip),
                "receiver": sockets(r, w.ip),
            }
            if "link_up" in events:  # the receiver answers only while reachable
                sample["landed_chunks"] = landed(recv)
            samples.append(sample)
            if (
                "returned" in events
                and "link_up" in events
                and t() - max(events["returned"], events["link_up"]) > watch_s
            ):
                break
    at_return = next(
        (
            s["landed_chunks"]
            for s in samples
            if "landed_chunks" in s and s["t"] >= events.get("returned", 1e9)
        ),
        None,
    )
    final = samples[-1].get("landed_chunks")
    late = [
        (s["t"], s["landed_chunks"])
        for s in samples
        if s.get("landed_chunks") is not None
        and s["t"] > events.get("returned", 1e9)
        and s["landed_chunks"] != at_return
    ]
    return {
        "nbytes": nbytes,
        "cut_s": cut_s,
        "events": events,
        "landed_chunks_at_return": at_return,
        "landed_chunks_final": final,
        "late_chunks": (final - at_return) if None not in (final, at_return) else None,
        "first_late_sample_s": late[0][0] if late else None,
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbytes", type=int, default=512 << 20)
    ap.add_argument("--cut-s", type=float, default=40.0)
    ap.add_argument("--watch-s", type=float, default=20.0)
    ap.add_argument("--out", default="late-bytes.json")
    args = ap.parse_args()
    result = run(args.nbytes, args.cut_s, args.watch_s)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    for s in result["samples"]:
        states = sorted({x["state"] for x in s["writer"]})
        queued = sum(x["send_q"] for x in s["writer"])
        print(
            f"{s['t']:7.2f} s  writer sockets {','.join(states) or '-':24s} "
            f"Send-Q {queued:>10d}  landed chunks {s.get('landed_chunks', '-')}"
        )


if __name__ == "__main__":
    main()
