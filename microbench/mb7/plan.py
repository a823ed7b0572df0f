"""What mb7 measures, in which order, and how far along it is.

One measurement = one prompt length, one repetition, one arm:

  prefill_only  P alone computes a fresh prompt (no transfer): P's own latency
  layerwise     P -> D with kv_transfer_params {"mooncake_mode": "layerwise"}
  posthoc       P -> D with {"mooncake_mode": "posthoc"} (whole KV after the prefill)

Both transfer arms run in the same cluster, interleaved: within a repetition
every size runs its arms in one order, the next repetition in the reverse
order (ABBA), so a drift of the machine over the run lands on both modes
alike. Every measurement uses a fresh prompt (no prefix-cache hit on P).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

PREFILL_ONLY, LAYERWISE, POSTHOC = "prefill_only", "layerwise", "posthoc"
TRANSFER_ARMS = (LAYERWISE, POSTHOC)


@dataclass(frozen=True)
class Step:
    load: int  # background decode streams per instance
    kv_tokens: int  # tokens whose KV moves (the prompt is one token longer)
    rep: int
    arm: str

    @property
    def kind(self) -> tuple[int, str]:
        """Steps whose durations scale with each other (the ETA's cost model): the same
        load level and the same requests. Both transfer arms send the same requests
        (measure.py: P -> D, the local hit on D, the reference on P); prefill-only
        sends one. Load slows everything by a factor known only once measured."""
        return (self.load, PREFILL_ONLY if self.arm == PREFILL_ONLY else "transfer")

    @property
    def weight(self) -> float:
        """Relative cost within a kind: prefill time grows with the prompt, plus a
        fixed part (HTTP, scheduling, one decode step)."""
        return float(self.kv_tokens + 256)


def arm_order(rep: int, arms: tuple[str, ...]) -> tuple[str, ...]:
    """ABBA: even repetitions in the given order, odd ones reversed."""
    return arms if rep % 2 == 0 else tuple(reversed(arms))


def plan(
    sizes: list[int], reps: int, load: int, modes: tuple[str, ...], prefill_only: bool
) -> list[Step]:
    """The steps of one load level: repetitions outermost, so every size and arm
    is sampled across the whole phase rather than in one burst."""
    arms = ((PREFILL_ONLY,) if prefill_only else ()) + tuple(modes)
    return [
        Step(load, n, rep, arm)
        for rep in range(reps)
        for n in sizes
        for arm in arm_order(rep, arms)
    ]


class Progress:
    """One line per measurement with the elapsed time and an ETA for the run.

    The ETA counts measurements only: start-up, warm-up and probes (the time
    between a note and the next step) never enter a rate. Each remaining step
    is estimated from the measured steps of its kind (Step.kind), scaled by
    weight. Printed as "ETA m:ss" when every remaining step's kind has been
    measured, "ETA >m:ss" (the part that can be estimated: a lower bound) while
    some kinds, e.g. a load level not reached yet, have not, and "ETA ~" before
    any remaining kind has been measured.
    """

    def __init__(
        self,
        steps: list[Step],
        tag: str = "mb7",
        clock: Callable[[], float] = time.monotonic,
        out: TextIO | None = None,
    ):
        self.remaining: Counter[Step] = Counter(steps)
        self.count = len(steps)
        self.done = 0
        self.tag = tag
        self.clock = clock
        self.out = out if out is not None else sys.stdout
        self.t0 = self.last_line = clock()
        self.measured: dict[
            tuple[int, str], tuple[float, float]
        ] = {}  # kind -> (s, weight)

    def _remaining_s(self) -> tuple[float, bool]:
        """(estimated seconds of the remaining steps whose kind was measured,
        whether every remaining step's kind was)."""
        known, complete = 0.0, True
        for step, n in self.remaining.items():
            if (seen := self.measured.get(step.kind)) is None:
                complete = False
            else:
                known += n * step.weight * seen[0] / seen[1]
        return known, complete

    def eta_s(self) -> float | None:
        """Seconds left for the remaining measurements; None while some kind among
        them has not been measured."""
        known, complete = self._remaining_s()
        return known if complete else None

    def eta_text(self) -> str:
        known, complete = self._remaining_s()
        if complete:
            return fmt_duration(known)
        return ">" + fmt_duration(known) if known > 0 else "~"

    def step_done(self, step: Step, message: str, seconds: float | None = None) -> None:
        """Record one measurement and print its line. ``seconds``: how long the
        measurement took (default: the time since this progress's previous line)."""
        now = self.clock()
        took = now - self.last_line if seconds is None else seconds
        self.last_line = now
        self.done += 1
        if self.remaining[step] > 1:
            self.remaining[step] -= 1
        else:
            self.remaining.pop(step, None)
        secs, weight = self.measured.get(step.kind, (0.0, 0.0))
        self.measured[step.kind] = (secs + max(0.0, took), weight + step.weight)
        print(
            f"[{self.tag} {self.done}/{self.count} {fmt_duration(now - self.t0)}, ETA "
            f"{self.eta_text()}] {'idle' if not step.load else f'load {step.load}'} "
            f"{step.kv_tokens} tok rep {step.rep + 1} {step.arm}: {message}",
            file=self.out,
            flush=True,
        )

    def note(self, message: str) -> None:
        self.last_line = self.clock()
        print(
            f"[{self.tag} {fmt_duration(self.last_line - self.t0)}] {message}",
            file=self.out,
            flush=True,
        )


def fmt_duration(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}:{s % 60:02d}"
