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
from dataclasses import dataclass

PREFILL_ONLY, LAYERWISE, POSTHOC = "prefill_only", "layerwise", "posthoc"
TRANSFER_ARMS = (LAYERWISE, POSTHOC)


@dataclass(frozen=True)
class Step:
    load: int  # background decode streams per instance
    kv_tokens: int  # tokens whose KV moves (the prompt is one token longer)
    rep: int
    arm: str

    @property
    def weight(self) -> float:
        """Rough cost, for the ETA: prefill time grows with the prompt; load slows it."""
        return (self.kv_tokens + 256) * (2.0 if self.load else 1.0)


def arm_order(rep: int, arms: tuple[str, ...]) -> tuple[str, ...]:
    """ABBA: even repetitions in the given order, odd ones reversed."""
    return arms if rep % 2 == 0 else tuple(reversed(arms))


def plan(sizes: list[int], reps: int, load: int, modes: tuple[str, ...],
         prefill_only: bool) -> list[Step]:
    """The steps of one load level: repetitions outermost, so every size and arm
    is sampled across the whole phase rather than in one burst."""
    arms = ((PREFILL_ONLY,) if prefill_only else ()) + tuple(modes)
    return [Step(load, n, rep, arm)
            for rep in range(reps) for n in sizes for arm in arm_order(rep, arms)]


class Progress:
    """One line per measurement with the elapsed time and an ETA for the run."""

    def __init__(self, steps: list[Step], tag: str = "mb7", clock=time.monotonic,
                 out=sys.stdout):
        self.total = sum(s.weight for s in steps)
        self.count = len(steps)
        self.done_weight = 0.0
        self.done = 0
        self.tag = tag
        self.clock = clock
        self.t0 = clock()
        self.out = out

    def eta_s(self) -> float | None:
        if not self.done_weight:
            return None
        rate = (self.clock() - self.t0) / self.done_weight
        return rate * (self.total - self.done_weight)

    def step_done(self, step: Step, message: str) -> None:
        self.done += 1
        self.done_weight += step.weight
        eta = self.eta_s()
        print(f"[{self.tag} {self.done}/{self.count} {fmt_duration(self.clock() - self.t0)}"
              f"{'' if eta is None else ', ETA ' + fmt_duration(eta)}] "
              f"{'idle' if not step.load else f'load {step.load}'} {step.kv_tokens} tok "
              f"rep {step.rep + 1} {step.arm}: {message}", file=self.out, flush=True)

    def note(self, message: str) -> None:
        print(f"[{self.tag} {fmt_duration(self.clock() - self.t0)}] {message}", file=self.out,
              flush=True)


def fmt_duration(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}:{s % 60:02d}"
