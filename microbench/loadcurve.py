"""A latency-load curve's arithmetic: the offered loads, the SLO and goodput.

A load series runs one workload at offered loads from light to past the point
where the weakest arm saturates, and reads each arm's TTFT at each. The SLO is
per request: its TTFT at most SLO_COLD_PREFILLS idle cold prefills of a prompt
of its own length (:class:`ColdPrefill`, measured at the start). A load point
keeps it when 90% of its requests do (SLO_QUANTILE), i.e. when the p90 of the
requests' TTFT in units of their own cold prefill is at most
SLO_COLD_PREFILLS. Goodput is the highest offered load at which an arm keeps
it, counted from the lightest load up: a load past the first one that misses
does not count, even if noise brings a heavier one back under (DistServe's
goodput: the highest rate served at 90% SLO attainment).

Why per request: an agentic workload mixes cold first turns of 30k tokens with
cached turns that answer in a fraction of a second, so a p90 in seconds is the
cold prefill of its longest prompts at any load, and a single SLO in seconds is
either missed idle or never missed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# One cold prefill is what a request pays with no cache and no queue; three of
# them is a queue of about two such prefills ahead of it, the point past which
# users of an interactive agent see the wait grow with load rather than with
# their own prompt.
SLO_COLD_PREFILLS = 3.0
SLO_QUANTILE = 0.9  # the share of a load's requests that must keep the SLO


@dataclass(frozen=True)
class ColdPrefill:
    """An idle cold prefill's time for a prompt of ``n`` tokens: ``n (a + b n)``
    (a cost per token, and attention's part that grows with the length), fitted
    to idle cold prefills measured at two or more lengths (at one: b = 0)."""

    a: float
    b: float = 0.0

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> ColdPrefill:
        """From ``points`` ((tokens, seconds) of idle cold prefills): least squares
        of the seconds per token against the tokens."""
        pts = [(n, t / n) for n, t in points if n > 0 and t > 0]
        if not pts:
            raise ValueError(f"idle cold prefills: none measured in {points}")
        xs = [n for n, _ in pts]
        ys = [y for _, y in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = (
            0.0
            if var == 0
            else max(0.0, sum((x - mx) * (y - my) for x, y in pts) / var)
        )
        return cls(max(0.0, my - b * mx), b)

    def seconds(self, tokens: int) -> float:
        return tokens * (self.a + self.b * tokens)


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


def ttft_in_cold_prefills(
    outcomes: Sequence[dict], cold: ColdPrefill, q: float = SLO_QUANTILE
) -> float | None:
    """The ``q`` quantile of the requests' TTFT, each in idle cold prefills of its
    own prompt (``prompt_len`` tokens); a request without an answer counts as
    infinitely late. None: no request."""
    xs = [
        math.inf
        if o.get("error") or o.get("ttft_s") is None or not o.get("prompt_len")
        else o["ttft_s"] / cold.seconds(o["prompt_len"])
        for o in outcomes
    ]
    return quantile(xs, q) if xs else None


def within(p90: float | None, slo: float, errors: int = 0) -> bool:
    """A load point keeps the SLO: it answered (a p90 exists), without errors,
    and its p90 (of TTFT in cold prefills, ttft_in_cold_prefills) is at most the
    SLO (SLO_COLD_PREFILLS)."""
    return p90 is not None and errors == 0 and p90 <= slo


def goodput(points: Sequence[tuple[float, float | None, int]], slo: float) -> float:
    """The highest offered load of ``points`` ((load, p90, errors), as
    :func:`within` reads them) up to which every load keeps the SLO; 0 when even
    the lightest misses it."""
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
    "SLO_QUANTILE",
    "ColdPrefill",
    "goodput",
    "offered_loads",
    "parse_loads",
    "quantile",
    "throughput",
    "ttft_in_cold_prefills",
    "within",
]
