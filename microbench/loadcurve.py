"""A latency-load curve's arithmetic: the offered loads, the SLO and goodput.

A load series runs one workload at offered loads from light to past the point
where the weakest arm saturates, and reads each arm's TTFT p90 at each. Goodput
is the highest offered load at which an arm keeps its TTFT p90 within the SLO,
counted from the lightest load up: a load past the first one that misses does
not count, even if noise brings a heavier one back under.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# The SLO: TTFT p90 at most this many idle cold prefills of the workload's
# median prompt. One cold prefill is what a request pays with no cache and no
# queue; three of them is a queue of about two requests' prefill ahead of it,
# the point past which users of an interactive agent see the wait grow with load
# rather than with their own prompt.
SLO_COLD_PREFILLS = 3.0


def offered_loads(lightest: float, heaviest: float, points: int) -> list[float]:
    """``points`` loads from ``lightest`` to ``heaviest``, evenly spaced on a log
    scale (each the same factor above the one before), rounded to 3 digits."""
    if points < 1 or lightest <= 0 or heaviest < lightest:
        raise ValueError(
            f"offered loads: need 0 < lightest <= heaviest and points >= 1, got "
            f"{lightest}, {heaviest}, {points}"
        )
    if points == 1:
        return [lightest]
    step = (heaviest / lightest) ** (1 / (points - 1))
    return [float(f"{lightest * step**i:.3g}") for i in range(points)]


def parse_loads(text: str) -> list[float]:
    """``--loads``: comma-separated positive numbers, returned in increasing order."""
    try:
        loads = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise ValueError(f"--loads {text!r}: not a list of numbers ({e})") from None
    if not loads or loads[0] <= 0 or not all(math.isfinite(x) for x in loads):
        raise ValueError(f"--loads {text!r}: give one or more positive numbers")
    return loads


def quantile(xs: Sequence[float | None], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of the values that are not None."""
    got = sorted(x for x in xs if x is not None)
    if not got:
        return None
    return got[min(len(got) - 1, max(0, round(q * (len(got) - 1))))]


def slo_s(cold_prefill_s: float, cold_prefills: float = SLO_COLD_PREFILLS) -> float:
    """The TTFT p90 SLO for a workload whose median prompt prefills in
    ``cold_prefill_s`` on an idle instance."""
    if cold_prefill_s <= 0:
        raise ValueError(f"an idle cold prefill of {cold_prefill_s} s")
    return cold_prefills * cold_prefill_s


def within(p90_s: float | None, slo: float, errors: int = 0) -> bool:
    """A load point keeps the SLO: it answered (a p90 exists), without errors,
    and its TTFT p90 is at most the SLO."""
    return p90_s is not None and errors == 0 and p90_s <= slo


def goodput(points: Sequence[tuple[float, float | None, int]], slo: float) -> float:
    """The highest offered load of ``points`` ((load, TTFT p90, errors)) up to
    which every load keeps the SLO; 0 when even the lightest misses it."""
    best = 0.0
    for load, p90, errors in sorted(points, key=lambda p: p[0]):
        if not within(p90, slo, errors):
            break
        best = load
    return best


def throughput(outcomes: Sequence[dict]) -> dict:
    """What a replay served (``outcomes``: its requests' ``sent_at_s``, ``e2e_s``,
    ``prompt_tokens``, ``output_tokens``, ``error``), over the span from its first
    send to its last answer: requests and tokens a second, and the requests in
    flight on average (Little's law: the sum of their latencies over the span)."""
    done = [o for o in outcomes if not o.get("error") and o.get("e2e_s") is not None]
    if not done:
        return {
            "span_s": None,
            "requests_per_s": 0.0,
            "prompt_tokens_per_s": 0.0,
            "output_tokens_per_s": 0.0,
            "in_flight_mean": 0.0,
        }
    start = min(o["sent_at_s"] for o in outcomes)
    span = max(o["sent_at_s"] + o["e2e_s"] for o in done) - start
    span = max(span, 1e-9)
    return {
        "span_s": span,
        "requests_per_s": len(done) / span,
        "prompt_tokens_per_s": sum(o.get("prompt_tokens") or 0 for o in done) / span,
        "output_tokens_per_s": sum(o.get("output_tokens") or 0 for o in done) / span,
        "in_flight_mean": sum(o["e2e_s"] for o in done) / span,
    }


__all__ = [
    "SLO_COLD_PREFILLS",
    "goodput",
    "offered_loads",
    "parse_loads",
    "quantile",
    "slo_s",
    "throughput",
    "within",
]
