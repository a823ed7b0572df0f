"""mb7's concurrency sweep: N P -> D requests in flight into one D at once.

Per level N and mode, rounds of N requests sent together (``pd_generate`` from
N threads), each with a fresh prompt, the lengths cycling through mb7's sizes
(mixed at every level), until at least :data:`MIN_SAMPLES` requests ran. With
two P instances (mb7 --two-prefill-levels) the requests of a round alternate
between them, so two P's write into one D at once. Per
request: the tail on the engines' clock (D's first token - P's last layer,
measure.where_the_tail_goes), tail / floor (the idle floor of its size from
mb7's rows), the longest wait of its writes in P's per-peer writer FIFO
(``queue_wait_max_s`` on P's timeline), D's cached tokens (== the KV tokens
sent, the cheap correctness check; mb7's single-request steps hold the full
token + logprob comparison), and any error. Per level: those as p50 / p90 /
max, the aggregate write rate of the transfers in flight together (a round's
bytes / (its last write end - its first write start), P's timelines; median
over rounds) against the engine's rate for one
layer of the same size and layout, P's prefill time (layer-wise against
post-hoc at the same level: P's slowdown from writing while it computes), and
KV blocks held on P and D after the level.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from harness.kv_usage import wait_no_blocks_in_use
from harness.pd_client import RequestFailed, pd_generate
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.decode_timeline import (
    TIMELINE_PARAM,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

from .measure import transfer_timelines, where_the_tail_goes
from .plan import LAYERWISE, POSTHOC

MIN_SAMPLES = 8  # requests per (level, mode) at least
HELD_WAIT_S = 30.0


def rounds_for(level: int) -> int:
    return max(1, math.ceil(MIN_SAMPLES / level))


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of the values present."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def p50_p90_max(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {
        "p50": statistics.median(xs),
        "p90": percentile(xs, 90),
        "max": max(xs),
        "n": len(xs),
    }


def one_round(
    ps: list, d, mode: str, sizes: list[int], prompts, level: int, timeout, first=0
):
    """``level`` P -> D requests sent at once, spread over the P instances ``ps``
    in turn, into one D; one dict per request. Request i of the sweep (``first``
    + i) has the size sizes[i % len(sizes)], so lengths mix at every level."""
    jobs = []
    for i in range(level):
        n = sizes[(first + i) % len(sizes)]
        jobs.append((i % len(ps), n, prompts(n + 1)))

    def run(job):
        which, kv_tokens, prompt = job
        p = ps[which]
        out = {
            "mode": mode,
            "level": level,
            "prefills": len(ps),
            "p": which,
            "kv_tokens": kv_tokens,
            "error": None,
        }
        try:
            r = pd_generate(
                p.url,
                p.bootstrap_url,
                d.url,
                prompt,
                max_tokens=1,
                logprobs=None,
                extra_prefill_params={"mooncake_mode": mode},
                timeout=timeout,
            )
        except RequestFailed as e:
            out["error"] = str(e)[:300]
            return out
        out.update(
            transfer_id=r.transfer_id,
            started_monotonic=r.started_monotonic,
            p_latency_s=r.prefill.latency_s,
            total_s=r.total_s,
            client_tail_s=r.total_s - r.prefill.latency_s,
            d_timeline=(r.decode.kv_transfer_params or {}).get(TIMELINE_PARAM),
            cached_tokens=r.decode.cached_tokens,
            cached_ok=r.decode.cached_tokens
            == cached_tokens_of_whole_prompt(kv_tokens + 1),
        )
        return out

    with ThreadPoolExecutor(level) as ex:
        return list(ex.map(run, jobs))


def sweep(
    ps: list,
    d,
    levels: list[int],
    modes: tuple[str, ...],
    sizes: list[int],
    prompts,
    timeout: float,
    note: Callable[[str], None],
) -> tuple[list[dict], list[dict]]:
    """Every level and mode with the P instances ``ps`` (one, or several writing
    into one D); (samples, blocks held after each level and mode)."""
    samples, held = [], []
    tag = f"{len(ps)} P" if len(ps) > 1 else ""
    for level in levels:
        for mode in modes:
            got = []
            for i in range(rounds_for(level)):
                batch = one_round(
                    ps, d, mode, sizes, prompts, level, timeout, first=i * level
                )
                got += [{**s, "round": i} for s in batch]
            tl = [transfer_timelines(p.bootstrap_url) for p in ps]
            for s in got:
                t = tl[s["p"]].get(s.get("transfer_id"))
                s.update(where_the_tail_goes(s, t))
                s["queue_wait_max_s"] = t.get("queue_wait_max_s") if t else None
                s["timeline"] = (
                    {
                        k: t.get(k)
                        for k in (
                            "first_write_start",
                            "last_write_end",
                            "bytes_written",
                        )
                    }
                    if t
                    else None
                )
            *pu, du = wait_no_blocks_in_use(
                *(p.url for p in ps), d.url, timeout=HELD_WAIT_S, poll=0.2
            )
            held.append(
                {
                    "prefills": len(ps),
                    "level": level,
                    "mode": mode,
                    "p_usage": max(pu),
                    "d_usage": du,
                }
            )
            errors = sum(1 for s in got if s["error"])
            tails = [s.get("tail_s") for s in got]
            note(
                f"concurrency {level} {mode}{' from ' + tag if tag else ''}: "
                f"{len(got)} requests, {errors} failed, "
                f"tail p50 {_ms(percentile(tails, 50))} p90 {_ms(percentile(tails, 90))}, "
                f"blocks held after: P {100 * max(pu):.1f}%, D {100 * du:.1f}%"
            )
            samples += got
    return samples, held


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.0f}ms"


def admission_wait(d_timeline: dict | None) -> float | None:
    """How long D kept a request waiting for a slot before its pull (0: none)."""
    if not d_timeline:
        return None
    queued = d_timeline.get("queued")
    return 0.0 if queued is None else d_timeline["allocated"] - queued


def write_rate(round_samples: list[dict]) -> float | None:
    """Bytes/s the transfers of one round wrote together: their bytes over
    first write start .. last write end (P's timelines)."""
    tls = [s["timeline"] for s in round_samples if s.get("timeline")]
    tls = [t for t in tls if t["first_write_start"] and t["last_write_end"]]
    if not tls:
        return None
    span = max(t["last_write_end"] for t in tls) - min(
        t["first_write_start"] for t in tls
    )
    return sum(t["bytes_written"] for t in tls) / span if span > 0 else None


def _key(x: dict) -> tuple[int, int, str]:
    """(P instances, level, mode) of a sample, a held record or a row (one P when a
    record predates two-P levels)."""
    return (x.get("prefills", 1), x["level"], x["mode"])


def level_rows(
    samples: list[dict],
    held: list[dict],
    floors: dict[int, float],
    layer_rates: dict[int, float],
) -> list[dict]:
    """One row per (level, mode). ``floors``: idle floor (s) per KV size;
    ``layer_rates``: the engine's bytes/s writing one layer of that size."""
    rows = []
    for prefills, level in sorted(
        {(s.get("prefills", 1), s["level"]) for s in samples}
    ):
        p_lat = {}
        for mode in (LAYERWISE, POSTHOC):
            mine = [s for s in samples if _key(s) == (prefills, level, mode)]
            if not mine:
                continue
            ok = [s for s in mine if not s["error"]]
            p_lat[mode] = [s["p_latency_s"] for s in ok]
            rates = [
                rate
                for i in sorted({s.get("round", 0) for s in ok})
                if (rate := write_rate([s for s in ok if s.get("round", 0) == i]))
            ]
            sizes = sorted({s["kv_tokens"] for s in mine})
            engine_rate = statistics.median(
                [layer_rates[n] for n in sizes if n in layer_rates] or [float("nan")]
            )
            h = next(
                (x for x in held if _key(x) == (prefills, level, mode)),
                None,
            )
            rows.append(
                {
                    "prefills": prefills,
                    "level": level,
                    "mode": mode,
                    "requests": len(mine),
                    "errors": [s["error"] for s in mine if s["error"]],
                    "cached_wrong": sum(1 for s in ok if not s.get("cached_ok")),
                    "tail_s": p50_p90_max([s.get("tail_s") for s in ok]),
                    "client_tail_s": p50_p90_max([s.get("client_tail_s") for s in ok]),
                    "tail_over_floor": p50_p90_max(
                        [
                            s["tail_s"] / floors[s["kv_tokens"]]
                            for s in ok
                            if s.get("tail_s") and floors.get(s["kv_tokens"])
                        ]
                    ),
                    "queue_wait_s": p50_p90_max(
                        [s.get("queue_wait_max_s") for s in ok]
                    ),
                    # D held the request back for a slot (decode_admission.py)
                    "admission_wait_s": p50_p90_max(
                        [admission_wait(s.get("d_timeline")) for s in ok]
                    ),
                    # the client's whole request: both sent -> D's answer
                    "total_s": p50_p90_max([s.get("total_s") for s in ok]),
                    # per round (requests in flight together), median over rounds
                    "bytes_per_s": statistics.median(rates) if rates else None,
                    "engine_layer_bytes_per_s": engine_rate,
                    "p_latency_s": p50_p90_max(p_lat[mode]),
                    "blocks_held_after": None
                    if h is None
                    else {"p": h["p_usage"], "d": h["d_usage"]},
                }
            )
        lw = next(
            (r for r in rows if _key(r) == (prefills, level, LAYERWISE)),
            None,
        )
        if lw and p_lat.get(LAYERWISE) and p_lat.get(POSTHOC):
            lw["prefill_slowdown_vs_posthoc"] = (
                statistics.median(p_lat[LAYERWISE]) / statistics.median(p_lat[POSTHOC])
                - 1
            )
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    head = (
        "P's  level       mode  reqs  failed  tail ms p50/p90/max  tail/floor p50/p90/max  "
        "queue wait ms p90/max  D admission wait s p90/max  request s p50/p90  "
        "write GB/s (engine)  P slowdown vs post-hoc  held after"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        t, f, q = r["tail_s"], r["tail_over_floor"], r["queue_wait_s"]
        a, e2e = r.get("admission_wait_s"), r.get("total_s")
        rate = r["bytes_per_s"]
        slow = r.get("prefill_slowdown_vs_posthoc")
        held = r["blocks_held_after"]
        lines.append(
            f"{r.get('prefills', 1):>3}  {r['level']:>5}  {r['mode']:>9}  {r['requests']:>4}  {len(r['errors']):>6}  "
            + (
                f"{1e3 * t['p50']:.0f}/{1e3 * t['p90']:.0f}/{1e3 * t['max']:.0f}"
                if t
                else "-"
            ).rjust(20)
            + "  "
            + (f"{f['p50']:.2f}/{f['p90']:.2f}/{f['max']:.2f}" if f else "-").rjust(22)
            + "  "
            + (f"{1e3 * q['p90']:.0f}/{1e3 * q['max']:.0f}" if q else "-").rjust(21)
            + "  "
            + (f"{a['p90']:.1f}/{a['max']:.1f}" if a else "-").rjust(26)
            + "  "
            + (f"{e2e['p50']:.1f}/{e2e['p90']:.1f}" if e2e else "-").rjust(17)
            + "  "
            + (
                f"{rate / 1e9:.2f} ({r['engine_layer_bytes_per_s'] / 1e9:.2f})"
                if rate
                else "-"
            ).rjust(19)
            + "  "
            + (f"{100 * slow:+.1f}%" if slow is not None else "").rjust(22)
            + "  "
            + (f"P {100 * held['p']:.1f}% D {100 * held['d']:.1f}%" if held else "-")
        )
    return lines
