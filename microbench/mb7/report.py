"""mb7's rows, targets, table and plot, computed from the samples (never asserted).

Headline figures are the ones that survive run-to-run prefill noise: the tail
(D's first token after P's last layer, same request, on the engines' clock),
tail / floor, and the
post-hoc / layer-wise tail ratio paired by repetition, each with its spread
(min / median / max over repetitions). ``total - prefill-only`` is kept in
the JSON (``overhead_s``) but not printed: it subtracts two prefills of
several seconds from each other and its noise exceeds the transfer.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from microbench.common import figure, save_figure

from .measure import kv_bytes
from .plan import LAYERWISE, POSTHOC, PREFILL_ONLY

# mb7's targets: (load level, key, comparison, bound)
IDLE_TAIL_OVER_FLOOR = 1.2
LOAD_TAIL_OVER_FLOOR = 1.5
FLATNESS = 1.3
IDLE_RATIO, IDLE_RATIO_AT = 8.0, 2048
LOAD_RATIO = 4.0
NOTICE = 1.25  # under load: transfer end -> D's first token / D's local-hit TTFT
SLOWDOWN = 0.05
# the tail's split on the engines' clock, then the client's view
# (measure.where_the_tail_goes)
SPLIT_KEYS = (
    "prefill_end_to_last_write_ms",
    "last_write_to_end_ms",
    "end_to_d_runnable_ms",
    "d_runnable_to_scheduled_ms",
    "d_scheduled_to_first_token_ms",
    "d_first_token_to_client_ms",
    "p_response_to_end_ms",
    "end_to_d_response_ms",
)


def spread(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {
        "min": min(xs),
        "median": statistics.median(xs),
        "max": max(xs),
        "n": len(xs),
    }


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def build_rows(
    samples: list[dict], layer_s: dict[int, float], facts: dict
) -> list[dict]:
    """One row per (load, mode, size) of the transfer arms."""
    rows = []
    keys = sorted(
        {
            (s["load"], s["arm"], s["kv_tokens"])
            for s in samples
            if s["arm"] != PREFILL_ONLY
        }
    )
    for load, arm, n in keys:
        mine = [
            s
            for s in samples
            if (s["load"], s["arm"], s["kv_tokens"]) == (load, arm, n)
        ]
        same = [s for s in samples if (s["load"], s["kv_tokens"]) == (load, n)]
        ok = [s for s in mine if not s["error"]]
        hits = [s["local_hit_s"] for s in same if s["arm"] != PREFILL_ONLY]
        local_hit = _med(hits)
        floor = (
            local_hit + layer_s[n] if local_hit is not None and n in layer_s else None
        )
        po = {
            s["rep"]: s["p_latency_s"]
            for s in same
            if s["arm"] == PREFILL_ONLY and not s["error"]
        }
        po_cpu = {
            s["rep"]: s.get("p_forward_cpu_s")
            for s in same
            if s["arm"] == PREFILL_ONLY and not s["error"]
        }
        other = LAYERWISE if arm == POSTHOC else POSTHOC
        other_tail = {
            s["rep"]: s["tail_s"]
            for s in same
            if s["arm"] == other and not s["error"] and s["tail_s"]
        }
        row = {
            "load": load,
            "mode": arm,
            "kv_tokens": n,
            "prompt_len": n + 1,
            "bytes": kv_bytes(n, facts["kv_bytes_per_token"]),
            "reps": len(mine),
            "errors": [s["error"] for s in mine if s["error"]],
            "tail_s": spread([s["tail_s"] for s in ok]),
            "client_tail_s": spread([s.get("client_tail_s") for s in ok]),
            "local_hit_s": spread(hits),
            "one_layer_s": layer_s.get(n),
            "floor_s": floor,
            "tail_over_floor": spread([s["tail_s"] / floor for s in ok if s["tail_s"]])
            if floor
            else None,
            "p_latency_s": spread([s["p_latency_s"] for s in ok]),
            "prefill_only_s": spread(list(po.values())),
            # paired by repetition: the same rep's P alone vs P with this mode's
            # transfer, on P's forward thread's own CPU clock (no other process can
            # add to it: the target's figure) ...
            "prefill_slowdown": spread(
                [
                    s["p_forward_cpu_s"] / po_cpu[s["rep"]] - 1
                    for s in ok
                    if s.get("p_forward_cpu_s") and po_cpu.get(s["rep"])
                ]
            ),
            # ... and in wall time at the client (moves with the whole machine)
            "prefill_slowdown_wall": spread(
                [s["p_latency_s"] / po[s["rep"]] - 1 for s in ok if po.get(s["rep"])]
            ),
            # post-hoc tail / layer-wise tail of the same repetition (on the posthoc row)
            "posthoc_over_layerwise": spread(
                [
                    s["tail_s"] / other_tail[s["rep"]]
                    for s in ok
                    if arm == POSTHOC and s["tail_s"] and other_tail.get(s["rep"])
                ]
            )
            if arm == POSTHOC
            else None,
            "share_before_prefill_end": spread(
                [s.get("share_before_prefill_end") for s in ok]
            ),
            "tail_split_ms": {k: spread([s.get(k) for s in ok]) for k in SPLIT_KEYS},
            # P's per-layer hook: its engine thread's own CPU time / P's prefill
            "layer_hook_cpu_share": spread(
                [
                    s["layer_hook_cpu_s"] / s["p_latency_s"]
                    for s in ok
                    if s.get("layer_hook_cpu_s") is not None and s.get("p_latency_s")
                ]
            ),
            # P's issuer thread (the per-transfer work of each layer) / P's prefill
            "layer_issue_cpu_share": spread(
                [
                    s["layer_issue_cpu_s"] / s["p_latency_s"]
                    for s in ok
                    if s.get("layer_issue_cpu_s") is not None and s.get("p_latency_s")
                ]
            ),
            # D's share once P answered, against the same step's local hit on D
            "end_to_first_token_over_local_hit": spread(
                [
                    s["end_to_d_first_token_ms"] / 1e3 / s["local_hit_s"]
                    for s in ok
                    if s.get("end_to_d_first_token_ms") is not None
                    and s.get("local_hit_s")
                ]
            ),
            # wrong KV in a completed request; failed requests are counted in "errors"
            "correct": bool(ok) and all(s["correct"] for s in ok),
            "problems": sorted({p for s in mine for p in s["problems"]})[:5],
            # demoted (JSON only): two prefills of seconds subtracted from each other
            "overhead_s": (_med([s["total_s"] for s in ok]) - _med(list(po.values())))
            if ok and po
            else None,
        }
        rows.append(row)
    return rows


def _get(row: dict | None, key: str, stat: str = "median") -> float | None:
    if row is None or row.get(key) is None:
        return None
    v = row[key]
    return v[stat] if isinstance(v, dict) else v


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("MET" if ok else "NOT MET")


def _at_every_size(
    load: int,
    target: str,
    per_size: dict[int, float | None],
    bound: float,
    fmt: Callable[[float], str],
) -> dict:
    """A target on the worst size: met if every size was measured and none
    exceeds ``bound``; not judged (None) if a size is missing."""
    vals = [v for v in per_size.values() if v is not None]
    return {
        "load": load,
        "target": target,
        "value": max(vals) if vals else None,
        "met": (max(vals) <= bound) if vals and len(vals) == len(per_size) else None,
        "detail": ", ".join(
            f"{n}: {fmt(v)}" for n, v in per_size.items() if v is not None
        ),
    }


def targets(rows: list[dict]) -> list[dict]:
    """Each target with its measured value and verdict (None: could not be measured)."""
    out = []

    def row(load, mode, n):
        return next(
            (
                r
                for r in rows
                if (r["load"], r["mode"], r["kv_tokens"]) == (load, mode, n)
                and r["tail_s"]
            ),
            None,
        )

    for load in sorted({r["load"] for r in rows}):
        tag = "idle" if load == 0 else f"{load} decode streams"
        sizes = sorted({r["kv_tokens"] for r in rows if r["load"] == load})
        bound = IDLE_TAIL_OVER_FLOOR if load == 0 else LOAD_TAIL_OVER_FLOOR
        tof = {n: _get(row(load, LAYERWISE, n), "tail_over_floor") for n in sizes}
        out.append(
            {
                **_at_every_size(
                    load,
                    f"{tag}: layer-wise tail/floor <= {bound} at every size",
                    tof,
                    bound,
                    lambda v: f"{v:.2f}",
                ),
                "worst_at": max(
                    (n for n in sizes if tof[n] is not None),
                    key=lambda n: tof[n],
                    default=None,
                ),
            }
        )
        if load == 0:
            tails = {n: _get(row(load, LAYERWISE, n), "tail_s") for n in sizes}
            t = [v for v in tails.values() if v]
            span = sizes[-1] / sizes[0] if sizes else 0
            flat = max(t) / min(t) if len(t) == len(sizes) and len(t) >= 2 else None
            out.append(
                {
                    "load": load,
                    "target": f"{tag}: layer-wise tail max/min <= {FLATNESS} "
                    f"over {span:.0f}x of KV",
                    "value": flat,
                    "met": (flat <= FLATNESS)
                    if flat is not None and span >= 4
                    else None,
                    "detail": ", ".join(
                        f"{n}: {1e3 * v:.0f} ms" for n, v in tails.items() if v
                    ),
                }
            )
            slow = {n: _get(row(load, LAYERWISE, n), "prefill_slowdown") for n in sizes}
            out.append(
                _at_every_size(
                    load,
                    f"{tag}: P's prefill slowdown (layer-wise, P's forward thread "
                    f"CPU time, paired by rep) <= {100 * SLOWDOWN:.0f}% at every size",
                    slow,
                    SLOWDOWN,
                    lambda v: f"{100 * v:+.1f}%",
                )
            )
        if load:
            notice = {
                n: _get(row(load, LAYERWISE, n), "end_to_first_token_over_local_hit")
                for n in sizes
            }
            out.append(
                _at_every_size(
                    load,
                    f"{tag}: layer-wise transfer end -> D's first token "
                    f"<= {NOTICE}x D's local-hit TTFT at every size",
                    notice,
                    NOTICE,
                    lambda v: f"{v:.2f}",
                )
            )
        at = IDLE_RATIO_AT if IDLE_RATIO_AT in sizes else (sizes[-1] if sizes else None)
        bound = IDLE_RATIO if load == 0 else LOAD_RATIO
        ph = row(load, POSTHOC, at)
        ratio = _get(ph, "posthoc_over_layerwise")
        out.append(
            {
                "load": load,
                "target": f"{tag}: post-hoc/layer-wise tail >= {bound:g}x "
                f"at {at} tokens",
                "value": ratio,
                "met": (ratio >= bound)
                if ratio is not None and at == IDLE_RATIO_AT
                else None,
                "detail": (
                    f"per rep min {_get(ph, 'posthoc_over_layerwise', 'min'):.1f}x, "
                    f"max {_get(ph, 'posthoc_over_layerwise', 'max'):.1f}x"
                )
                if ratio is not None
                else "",
            }
        )
    return out


def summary_lines(rows: list[dict], tgts: list[dict], held: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if r["errors"]:
            lines.append(
                f"[mb7] {len(r['errors'])} FAILED request(s) at load {r['load']} "
                f"{r['mode']} {r['kv_tokens']} tok: {r['errors'][0][:200]}"
            )
    for t in tgts:
        v = t["value"]
        shown = (
            "-"
            if v is None
            else (f"{100 * v:+.1f}%" if "slowdown" in t["target"] else f"{v:.2f}")
        )
        lines.append(
            f"[mb7] {_verdict(t['met']):>12}  {t['target']}: {shown}"
            + (f" ({t['detail']})" if t.get("detail") else "")
        )
    for r in rows:
        split = r.get("tail_split_ms") or {}
        if r["kv_tokens"] != max(x["kv_tokens"] for x in rows) or not split.get(
            "end_to_d_runnable_ms"
        ):
            continue
        med = {k: v["median"] for k, v in split.items() if v}
        tag = "idle" if r["load"] == 0 else f"load {r['load']}"
        nan = float("nan")
        lines.append(
            f"[mb7] where the tail goes, {tag} {r['mode']} {r['kv_tokens']} tok "
            "(median ms, engines' clock): P's last layer -> last write done "
            f"{med.get('prefill_end_to_last_write_ms', nan):.0f} -> P answered D "
            f"{med.get('last_write_to_end_ms', nan):.0f} -> D's request runnable "
            f"{med.get('end_to_d_runnable_ms', nan):.0f} -> scheduled "
            f"{med.get('d_runnable_to_scheduled_ms', nan):.0f} -> D's first token "
            f"{med.get('d_scheduled_to_first_token_ms', nan):.0f}; then -> D's "
            f"response at the client {med.get('d_first_token_to_client_ms', nan):.0f}"
        )
    hook = [r for r in rows if r.get("layer_hook_cpu_share") and r["load"] == 0]
    if hook:
        lines.append(
            "[mb7] P's per-layer hook, own CPU time on P's engine thread / P's prefill "
            "(idle, median; a cost no other process can add): "
            + ", ".join(
                f"{r['kv_tokens']}: {100 * r['layer_hook_cpu_share']['median']:.2f}%"
                for r in hook
            )
            + "; its issuer thread (each layer's writes, off the forward thread): "
            + ", ".join(
                f"{r['kv_tokens']}: {100 * r['layer_issue_cpu_share']['median']:.2f}%"
                for r in hook
                if r.get("layer_issue_cpu_share")
            )
        )
    for h in held:
        lines.append(
            f"[mb7] KV blocks held after the last {h['mode']} request ({h['phase']}"
            f"{', which FAILED' if h.get('request_error') else ''}): "
            f"P {100 * h['p_usage']:.1f}%, D {100 * h['d_usage']:.1f}% "
            f"{'after' if h['returned'] else 'still after'} {h['seconds']:.1f} s"
        )
    return lines


def _ms(row: dict, key: str) -> str:
    v = row.get(key)
    if not v:
        return "-"
    return f"{1e3 * v['min']:.0f}/{1e3 * v['median']:.0f}/{1e3 * v['max']:.0f}"


def table_rows(rows: list[dict]) -> list[dict]:
    """Display cells of the printed table (strings)."""
    out = []
    for r in rows:
        tof, ratio = r.get("tail_over_floor"), r.get("posthoc_over_layerwise")
        slow, share = r.get("prefill_slowdown"), r.get("share_before_prefill_end")
        wall = r.get("prefill_slowdown_wall")
        out.append(
            {
                "load": "idle" if r["load"] == 0 else str(r["load"]),
                "mode": r["mode"],
                "tokens": str(r["kv_tokens"]),
                "mib": f"{r['bytes'] / 2**20:.0f}",
                "tail": _ms(r, "tail_s"),
                "ctail": f"{1e3 * r['client_tail_s']['median']:.0f}"
                if r.get("client_tail_s")
                else "-",
                "floor": f"{1e3 * r['floor_s']:.0f}" if r.get("floor_s") else "-",
                "tof": f"{tof['min']:.2f}/{tof['median']:.2f}/{tof['max']:.2f}"
                if tof
                else "-",
                "ratio": f"{ratio['min']:.1f}/{ratio['median']:.1f}/{ratio['max']:.1f}"
                if ratio
                else "",
                "slow": f"{100 * slow['min']:+.1f}/{100 * slow['median']:+.1f}/"
                f"{100 * slow['max']:+.1f}"
                if slow
                else "-",
                "wall": f"{100 * wall['median']:+.1f}" if wall else "-",
                "share": f"{100 * share['median']:.0f}" if share else "",
                "correct": ("yes" if r["correct"] else "NO")
                + (f", {len(r['errors'])} failed" if r["errors"] else ""),
            }
        )
    return out


TABLE = [
    ("load", "load", ""),
    ("mode", "mode", ""),
    ("tokens", "KV tokens", ""),
    ("mib", "MiB", ""),
    ("tail", "tail ms min/med/max", ""),
    ("ctail", "client tail ms med", ""),
    ("floor", "floor ms", ""),
    ("tof", "tail/floor min/med/max", ""),
    ("ratio", "post/lw min/med/max", ""),
    ("slow", "P slowdown % (CPU) min/med/max", ""),
    ("wall", "P slowdown % (wall) med", ""),
    ("share", "written before P ended %", ""),
    ("correct", "correct", ""),
]


def plot(rows: list[dict], path: Path, facts: dict, origin: str) -> Path | None:
    if (made := figure(1, 2, (12, 4.8), tag="mb7")) is None:
        return None
    fig, axes = made
    rows = [r for r in rows if r.get("tail_s")]
    for load in sorted({r["load"] for r in rows}):
        ls = "-" if load == 0 else "--"
        tag = "idle" if load == 0 else f"{load} decode streams"
        for mode in (LAYERWISE, POSTHOC):
            sel = sorted(
                (r for r in rows if r["mode"] == mode and r["load"] == load),
                key=lambda r: r["bytes"],
            )
            if not sel:
                continue
            x = [r["bytes"] / 2**20 for r in sel]
            for ax, key, scale in (
                (axes[0], "tail_s", 1e3),
                (axes[1], "tail_over_floor", 1),
            ):
                sel2 = [(xi, r) for xi, r in zip(x, sel) if r.get(key)]
                med = [r[key]["median"] * scale for _, r in sel2]
                lo = [m - r[key]["min"] * scale for m, (_, r) in zip(med, sel2)]
                hi = [r[key]["max"] * scale - m for m, (_, r) in zip(med, sel2)]
                ax.errorbar(
                    [xi for xi, _ in sel2],
                    med,
                    yerr=[lo, hi],
                    capsize=3,
                    marker="o" if mode == LAYERWISE else "s",
                    linestyle=ls,
                    label=f"{mode}, {tag}",
                )
        floor = sorted(
            (
                r
                for r in rows
                if r["mode"] == LAYERWISE and r["load"] == load and r.get("floor_s")
            ),
            key=lambda r: r["bytes"],
        )
        if floor:
            axes[0].plot(
                [r["bytes"] / 2**20 for r in floor],
                [1e3 * r["floor_s"] for r in floor],
                color="gray",
                linestyle=ls,
                label=f"floor, {tag}",
            )
    axes[0].set_ylabel("tail = D's first token - P's last layer (ms)")
    axes[1].set_ylabel("tail / floor")
    for bound in (IDLE_TAIL_OVER_FLOOR, LOAD_TAIL_OVER_FLOOR):
        axes[1].axhline(bound, color="gray", linewidth=0.8, linestyle=":")
    for ax in axes:
        ax.set_xlabel("KV moved per request (MiB)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return save_figure(
        fig,
        path,
        f"mb7: {facts['layers']}-layer model, {facts['kv_bytes_per_token'] // 1024} KiB "
        "KV/token; bars min-max over reps",
        origin,
        fontsize=10,
    )
