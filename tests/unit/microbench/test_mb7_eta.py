"""mb7's ETA (microbench/mb7/plan.py Progress): made of measured steps only, per kind.

A run of mb7 spends minutes before its first measurement (the engine probe, a
cluster's start-up, warm-up) and starts a second cluster before its load phase.
An ETA that spreads that time over the few steps done so far reads hours for a
run of minutes; these tests play a whole default plan on a synthetic clock and
hold every printed ETA to the time the remaining measurements really take.
"""

from __future__ import annotations

import io
import re

from microbench.mb7.plan import LAYERWISE, POSTHOC, PREFILL_ONLY, Progress, Step, plan

SIZES = [512, 1024, 2048]
ETA = re.compile(r"ETA ([^\]]+)\]")


def true_seconds(step: Step) -> float:
    """The synthetic machine: not the ETA's own cost model (a fixed part, a slope of
    its own per kind, load 3x slower)."""
    base = (
        0.4 + step.kv_tokens / 1500
        if step.arm == PREFILL_ONLY
        else 1.0 + step.kv_tokens / 700
    )
    return base * (3.0 if step.load else 1.0)


def parse_eta(text: str) -> tuple[str, float | None]:
    """ "~" -> ("~", None); ">1:05" -> (">", 65.0); "1:05" -> ("=", 65.0)."""
    if text == "~":
        return "~", None
    kind = ">" if text.startswith(">") else "="
    m, s = text.lstrip(">").split(":")
    return kind, 60.0 * int(m) + int(s)


def play_default_run(progress_cls=Progress) -> list[tuple[str, float | None, float]]:
    """mb7's default plan (sizes 512-2048, 3 reps, idle then load 8) as __main__
    runs it, with start-up and warm-up between notes. Per printed step line:
    (ETA kind, ETA seconds, seconds the remaining measurements really take)."""
    t = [0.0]
    out = io.StringIO()
    arms = (LAYERWISE, POSTHOC)
    phases = {
        0: plan(SIZES, 3, 0, arms, prefill_only=True),
        8: plan(SIZES, 3, 8, arms, prefill_only=False),
    }
    every = [s for steps in phases.values() for s in steps]
    p = progress_cls(every, clock=lambda: t[0], out=out)
    p.note("model ...; 45 measurements")
    for load, steps in phases.items():
        t[0] += (
            8.0 if load == 0 else 5.0
        )  # engine probe; blocks held after the idle phase
        p.note(
            "one layer's write on the engine: ..." if load == 0 else "blocks held: ..."
        )
        t[0] += 100.0  # a cluster's start-up
        p.note("P and D ready")
        t[0] += 20.0  # warm-up requests
        p.note("warm-up P->D requests after start: ...")
        for step in steps:
            t[0] += true_seconds(step)
            p.step_done(step, "ok")
    lines = [ln for ln in out.getvalue().splitlines() if " tok rep " in ln]
    assert len(lines) == len(every)
    result = []
    for i, line in enumerate(lines):
        m = ETA.search(line)
        kind, eta = parse_eta(m.group(1)) if m else ("~", None)
        result.append((kind, eta, sum(true_seconds(s) for s in every[i + 1 :])))
    return result


def test_no_eta_line_of_a_default_run_is_wild():
    for i, (kind, eta, truth) in enumerate(play_default_run()):
        where = f"line {i + 1}: ETA {kind} {eta} with {truth:.0f}s of measurements left"
        if kind == "=":  # a full ETA: within a factor of two of the truth
            assert 0.5 * truth - 2 <= eta <= 2 * truth + 2, where
        elif kind == ">":  # a lower bound must be one
            assert eta <= truth + 2, where


def test_the_full_eta_waits_for_every_kind_left_to_be_measured():
    lines = play_default_run()
    # idle: prefill-only is measured first, transfers and the load phase are not yet
    assert lines[0][0] == ">" and lines[0][1] <= lines[0][2]
    # through the idle phase some work left (the load phase) has never been measured
    assert all(kind != "=" for kind, _, _ in lines[:27])
    # the first step under load measures the last kind: a full ETA from then on
    assert all(kind == "=" for kind, _, _ in lines[27:])
    assert lines[-1][1] == 0


def test_nothing_measured_means_no_eta():
    steps = plan(SIZES, 1, 0, (LAYERWISE, POSTHOC), prefill_only=False)
    p = Progress(steps, clock=lambda: 500.0, out=io.StringIO())
    assert p.eta_s() is None and p.eta_text() == "~"


def test_given_seconds_replace_the_time_since_the_previous_line():
    t = [0.0]
    out = io.StringIO()
    steps = [Step(0, 512, 0, LAYERWISE), Step(0, 512, 0, POSTHOC)]
    p = Progress(steps, clock=lambda: t[0], out=out)
    t[0] = 300.0  # start-up, not a measurement
    p.step_done(steps[0], "ok", seconds=4.0)
    assert p.eta_s() == 4.0
    assert "1/2 5:00, ETA 0:04]" in out.getvalue()
