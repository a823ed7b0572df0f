"""Faults on a two-host cluster, each at a moment the connector itself marks.

Runs every fault of bench.py (or those named) ``--runs`` times on one two-host
cluster (P and D, each in a network namespace of its own) and reports, per fault,
how its requests ended, whether every answer was correct, whether KV blocks stayed
allocated, and how long the cluster took to serve again.

    python -m microbench.faults [--runs 3] [--only link_down_short,kill_prefill]
        -> results/faults.json + a printed table (docs/faults.md)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from microbench.common import parser

from .bench import (
    BLIND_REQUEST_DEADLINE_S,
    BLIND_SCENARIOS,
    CUT_REQUEST_DEADLINE_S,
    CUT_SCENARIOS,
    SCENARIOS,
    FaultBench,
    Outcome,
    fault_cluster,
    run_fault,
)


def render(outcomes: list[Outcome]) -> str:
    head = (
        f"{'fault':<36} {'runs':>4} {'reqs':>4} {'ok':>3} {'err':>3} {'lost':>4} "
        f"{'wrong':>5} {'stranded':>8}  recovery s (min/med/max)  holds"
    )
    lines = [head, "-" * len(head)]
    for o in outcomes:
        if o.skipped:
            lines.append(f"{o.fault:<36} skipped: {o.skipped}")
            continue
        rec = sorted(o.recovery_s)
        rec_s = (
            f"{rec[0]:.1f} / {rec[len(rec) // 2]:.1f} / {rec[-1]:.1f}" if rec else "-"
        )
        lines.append(
            f"{o.fault:<36} {o.runs:>4} {o.requests:>4} {o.ok:>3} "
            f"{o.ended_with_error:>3} {o.lost:>4} {o.wrong:>5} {o.stranded_runs:>8}  "
            f"{rec_s:<24}  {'yes' if o.holds else 'NO'}"
        )
        if o.reused_blocks_checked or o.reused_wrong or o.reused_unchecked:
            lines.append(
                f"{'':<36} reused blocks read back {o.reused_blocks_checked}, "
                f"changed {o.reused_wrong}, not read back {o.reused_unchecked}; "
                f"ended {o.ended_after_cut_s} s after the cut"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser("faults", __doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per fault (default 3)")
    known = [*SCENARIOS, *CUT_SCENARIOS, *BLIND_SCENARIOS]
    ap.add_argument("--only", help="comma-separated faults: " + ", ".join(known))
    ap.add_out(Path("results/faults.json"))
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else known
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown faults {unknown}; known: {', '.join(known)}")
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    done = 0
    # the rows of each cluster (the cut rows' hosts keep the kernel's defaults; the
    # blind row's P cannot read its kernel's send queues)
    groups = (
        ("faults-logs", False, False, SCENARIOS, None),
        ("faults-cut-logs", True, False, CUT_SCENARIOS, CUT_REQUEST_DEADLINE_S),
        ("faults-blind-logs", True, True, BLIND_SCENARIOS, BLIND_REQUEST_DEADLINE_S),
    )
    for log_name, kernel_defaults, blind, group, deadline_s in groups:
        mine = [n for n in names if n in group]
        if not mine:
            continue
        logs = args.out.parent / log_name
        print(
            f"[faults {time.monotonic() - t0:5.0f}s] starting P and D ...", flush=True
        )
        with fault_cluster(logs, kernel_defaults, blind) as cluster:
            bench = FaultBench(cluster, deadline_s)
            try:
                for name in mine:
                    done += 1
                    print(
                        f"[faults {time.monotonic() - t0:5.0f}s] {done}/{len(names)} "
                        f"{name} x{args.runs} ...",
                        flush=True,
                    )
                    outcomes.append(run_fault(bench, name, args.runs))
                    print("\n".join(render(outcomes[-1:]).splitlines()[2:]), flush=True)
            finally:
                bench.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "outcomes": [asdict(o) | {"holds": o.holds} for o in outcomes],
                "seconds": round(time.monotonic() - t0),
            },
            indent=1,
        )
        + "\n"
    )
    print(render(outcomes))
    print(f"JSON: {args.out}")
    return 0 if all(o.holds for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
