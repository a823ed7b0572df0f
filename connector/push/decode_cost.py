# SPDX-License-Identifier: Apache-2.0
"""D decides whether a prefix push pays: its expected transfer against the local
prefill of the same tokens, both measured on D.

A push, per source: one ``/match_blocks`` round trip; a line fitted to pushes'
times against the blocks on the link (its own times the pushes sharing it), whose
fixed part is the step whose end a landing waits for, kept apart for a source
that was prefilling or not; and the tail it adds: the worker's
report to the first token, less the local prefill of the request's own tokens
(the suffix after the pushed prefix, which a local prefill computes too). A local
prefill: a fresh prefill's time per token, in power-of-two length buckets; between
two buckets' mean lengths the time goes in a straight line from one's to the
other's (so a token costs more after a longer prefix, as attention does); tokens
after a cached prefix cost the difference of two fresh prefills (they attend to
the prefix), at least their own fresh prefill; weighted by the requests of D's
own it would delay (MAX_QUEUED at most). The tail is the median of the last TAIL_SAMPLES, 0 before
TAIL_MIN_SAMPLES.
Unmeasured, a push goes ahead; below MOONCAKE_PUSH_MIN_TOKENS or to a full
source, never. A source whose last FAILURES_TO_DEMOTE pushes landed nothing is
failing, whatever the policy, until one probe PROBE_AFTER_S later. Sources are
keyed by origin, so a client cannot add entries. Pure logic, injected clock.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

logger = logging.getLogger(__name__)

ALPHA = 0.2  # weight of a new observation in a moving average
PROBE_AFTER_S = 60.0  # a source's transfer measurement older than this is tried again
MIN_BUCKET = 6  # 64 tokens: shorter prefills share this bucket
MAX_BUCKET = 20  # 1,048,576 tokens
MAX_TRACKED = 4096  # local prefills timed at once (more are not timed)
FAILURES_TO_DEMOTE = 3  # pushes in a row that landed nothing: the source is failing
BUDGET_FACTOR = 4.0  # a push's budget: its expected transfer times this,
BUDGET_FLOOR_S = 5.0  # plus one round trip and this
MAX_QUEUED = 16  # requests behind a local prefill that its cost counts, at most
TAIL_SAMPLES = 15  # landed pushes whose tails make the median
TAIL_MIN_SAMPLES = 3  # fewer: the tail counts 0 (one long turn is not the median)
# pushes' sizes vary less than this (standard deviation over mean): no fixed part
SIZE_SPREAD = 0.25
# D waits for a /match_blocks answer at least this long before the local prefill
# it would save bounds the wait (below it, a busy host's ordinary round trip)
MATCH_WAIT_FLOOR_S = 1.0


class Decision(str, Enum):
    """Why a request was or was not pushed: the ``reason`` label of D's
    ``push_decisions_total`` (metrics.py)."""

    PUSHED = "pushed"  # every promised block landed
    NO_HOLDER = "no_holder"  # no source holds more than D's own hit
    BELOW_MINIMUM = "below_minimum"  # fewer tokens than MOONCAKE_PUSH_MIN_TOKENS
    # expected transfer >= expected local prefill, or the source is failing
    NOT_WORTH_IT = "not_worth_it"
    # the source's /match_blocks answer was later than the local prefill it would save
    SLOW_MATCH = "slow_match"
    # the source refused or was busy (or said every slot was taken), or D refused it
    REFUSED = "refused"
    FELL_BACK = "fell_back"  # match failed, or fewer blocks landed: local prefill
    # waited for another request's push of its prefix (decode_coalesce.py)
    COALESCED = "coalesced"


@dataclass(frozen=True)
class SourceLoad:
    """A source's load as its /match_blocks answer reports it, bounded by D
    (decode_scheduler.py), merged with D's own pushes in flight from it."""

    pushes_in_flight: int = 0  # within their bound, every destination's
    push_slots: int | None = None  # its MOONCAKE_PUSH_MAX_CONCURRENT (None: unknown)
    backlog_tokens: int = 0  # prompt tokens admitted and not yet computed

    @property
    def prefilling(self) -> bool:
        return self.backlog_tokens > 0

    @property
    def full(self) -> bool:
        """Every slot taken: a push now would be answered busy (429)."""
        return self.push_slots is not None and self.pushes_in_flight >= self.push_slots

    @property
    def idle(self) -> bool:
        return self.pushes_in_flight == 0 and not self.prefilling

    @property
    def sharing(self) -> int:
        """Pushes that would share the source's link with one more."""
        return 1 + max(0, self.pushes_in_flight)


IDLE = SourceLoad()


class _Average:
    __slots__ = ("value", "at", "n")

    def __init__(self) -> None:
        self.value = 0.0
        self.at = 0.0
        self.n = 0

    def add(self, x: float, now: float) -> None:
        self.value = x if self.n == 0 else self.value + ALPHA * (x - self.value)
        self.n += 1
        self.at = now


class _Line:
    """A push's seconds against the blocks on the link: the least-squares line
    through moving averages of both (and of their squares and product), so that
    recent pushes weigh most. A fixed part (the step whose end a landing waits
    for) and a part per block, neither below 0; pushes all of about one size tell
    no fixed part apart, and go through the origin as one time per block."""

    __slots__ = ("_x", "_y", "_xx", "_xy", "at")

    def __init__(self) -> None:
        self._x, self._y, self._xx, self._xy = (_Average() for _ in range(4))
        self.at = 0.0

    def add(self, seconds: float, blocks: float, now: float) -> None:
        for avg, v in (
            (self._x, blocks),
            (self._y, seconds),
            (self._xx, blocks * blocks),
            (self._xy, blocks * seconds),
        ):
            avg.add(v, now)
        self.at = now

    def seconds(self, blocks: float) -> float:
        mx, my = self._x.value, self._y.value
        spread = self._xx.value - mx * mx
        if spread <= (SIZE_SPREAD * mx) ** 2:
            return my * blocks / mx
        slope = (self._xy.value - mx * my) / spread
        if slope <= 0:  # longer pushes no slower: their time is the fixed part
            return my
        fixed = my - slope * mx
        if fixed < 0:
            return my * blocks / mx
        return fixed + slope * blocks


@dataclass
class _Failures:
    """A source's pushes in a row that landed nothing, and when last counted."""

    in_a_row: int = 0
    at: float = 0.0


@dataclass(frozen=True)
class Estimate:
    """One decision's figures (seconds; None: not measured yet)."""

    decision: Decision | None  # None: push
    transfer_s: float | None
    prefill_s: float | None


def bucket(tokens: int) -> int:
    return min(MAX_BUCKET, max(MIN_BUCKET, math.ceil(math.log2(max(1, tokens)))))


class PushCostModel:
    """D's measured costs of a push (per source) and of a local prefill (per length)."""

    def __init__(
        self,
        min_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        always: bool = False,
    ) -> None:
        self.min_tokens = min_tokens
        self.always = always  # MOONCAKE_PUSH_POLICY=always: the minimum only
        self._clock = clock
        self._round_trip: dict[str, _Average] = {}
        # (source, prefilling) -> a push's seconds beyond the round trip
        self._pushes: dict[tuple[str, bool], _Line] = {}
        # length bucket -> (its prefills' mean length, seconds per token)
        self._per_token: dict[int, tuple[_Average, _Average]] = {}
        # landed pushes: the report to the first token, beyond their own tokens
        self._tails: deque[float] = deque(maxlen=TAIL_SAMPLES)
        self._failures: dict[str, _Failures] = {}

    # ---- observations ------------------------------------------------------------
    def observe_round_trip(self, source: str, seconds: float) -> None:
        self._round_trip.setdefault(source, _Average()).add(
            max(0.0, seconds), self._clock()
        )

    def observe_push(
        self, source: str, blocks: int, seconds: float, load: SourceLoad = IDLE
    ) -> None:
        """A push that landed whole, ``seconds`` from allocation to the worker's
        report; it ends the source's failures."""
        if blocks <= 0:
            return
        self._failures.pop(source, None)
        self._add_push(source, blocks, seconds, load)

    def observe_shortfall(
        self,
        source: str,
        blocks: int,
        landed: int,
        seconds: float,
        block_size: int,
        load: SourceLoad = IDLE,
    ) -> None:
        """A push of which only the first ``landed`` blocks landed: it cost the
        wait plus the local prefill of the rest, so a source whose pushes do not
        land costs more than the prefill they were to save."""
        if blocks <= 0:
            return
        landed = max(0, min(landed, blocks))
        if landed:
            self._failures.pop(source, None)
        rest = self.prefill_s((blocks - landed) * block_size) or 0.0
        self._add_push(source, blocks, max(0.0, seconds) + rest, load)

    def failed(self, source: str) -> int:
        """A push from ``source`` landed nothing, or is late: its failures in a row."""
        f = self._failures.setdefault(source, _Failures())
        f.in_a_row += 1
        f.at = self._clock()
        return f.in_a_row

    def failing(self, source: str) -> bool:
        """Whether ``source`` is failing and not yet due for its probe."""
        f = self._failures.get(source)
        return (
            f is not None
            and f.in_a_row >= FAILURES_TO_DEMOTE
            and self._clock() - f.at < PROBE_AFTER_S
        )

    def _add_push(
        self, source: str, blocks: int, seconds: float, load: SourceLoad
    ) -> None:
        rtt = self._round_trip.get(source)
        fixed = rtt.value if rtt is not None else 0.0
        # NOTE: a line, not a time per block: a push's landing is reported at the
        # end of D's step, which is most of a short push's time (on the CPU backend
        # pushes of 2-8 blocks took 12-1,010 ms, of 40-192 blocks 26-1,006 ms). As
        # a mean per block, one push of 4 blocks in 585 ms priced pushes of 44-48
        # at 1.3-1.4 s against 0.66-0.80 s of prefill; weighed by blocks, 4-8
        # blocks were priced at a few ms and took 0.29-2.37 s against 0.16-1.72 s
        # of the prefill they saved (19 of 81 pushes at 8-24 sessions a minute)
        self._pushes.setdefault((source, load.prefilling), _Line()).add(
            max(0.0, seconds - fixed), blocks * load.sharing, self._clock()
        )

    def _push_line(self, source: str, load: SourceLoad) -> _Line | None:
        """A push's line from ``source`` in ``load``'s state, else in the other's."""
        return self._pushes.get((source, load.prefilling)) or self._pushes.get(
            (source, not load.prefilling)
        )

    def observe_tail(
        self, seconds: float, own_tokens: int = 0, held_tokens: int = 0
    ) -> float | None:
        """A landed push: ``seconds`` from the worker's report to the first token,
        in which the request computed ``own_tokens`` beyond the ``held_tokens``
        it held. Returns the tail kept (None: none)."""
        if seconds < 0:
            return None
        # NOTE: its own tokens, and the steps it shared doing so, a local prefill
        # computes as well: the tail is what the push added (the step boundary).
        # They attend to the held ones: timed as a fresh prefill of their own
        # length, a turn of 7.5k tokens after 7.5k held read 1.4 s more tail on
        # the CPU backend's test model than there was, and its pushes not worth it
        own = self.span_s(held_tokens, own_tokens) if own_tokens > 0 else None
        tail = max(0.0, seconds - (own or 0.0))
        self._tails.append(tail)
        return tail

    def observe_prefill(self, tokens: int, seconds: float, start: int = 0) -> None:
        """A local prefill of ``tokens`` after ``start`` cached ones that took
        ``seconds`` to its first token."""
        if tokens <= 0 or seconds <= 0:
            return
        before = self.prefill_s(start) if start > 0 else 0.0
        if before is None:  # nothing to tell the cached prefix's part by
            self._add_prefill(tokens, seconds)
            return
        # a fresh prefill of start + tokens: the cached part's and this one's
        self._add_prefill(start + tokens, seconds + before)

    def _add_prefill(self, tokens: int, seconds: float) -> None:
        now = self._clock()
        length, per_token = self._per_token.setdefault(
            bucket(tokens), (_Average(), _Average())
        )
        length.add(tokens, now)
        per_token.add(seconds / tokens, now)

    # ---- estimates ---------------------------------------------------------------
    def write_s(self, source: str, blocks: int, load: SourceLoad) -> float | None:
        """Expected time from D's allocation to the worker's report."""
        rtt, line = self._round_trip.get(source), self._push_line(source, load)
        if rtt is None or line is None:
            return None
        return rtt.value + line.seconds(blocks * load.sharing)

    def transfer_s(
        self, source: str, blocks: int, load: SourceLoad = IDLE
    ) -> float | None:
        """Expected push to the first token, as a local prefill is timed: its
        write and the tail (0 until TAIL_MIN_SAMPLES pushes have landed)."""
        write = self.write_s(source, blocks, load)
        if write is None:
            return None
        return write + self.tail_s

    @property
    def tail_s(self) -> float:
        """A landed push's report to its first token, beyond its own tokens."""
        # NOTE: the median: a tail is what is left after D's estimate of the
        # request's own tokens, whose error grows with them (a turn of 14.5k own
        # tokens read 4.2 s of tail on the CPU backend, the turns around it 0-0.7 s);
        # averaged, one such turn priced every short push out for minutes; a
        # median of two is their mean, so the tail counts from the third on
        if len(self._tails) < TAIL_MIN_SAMPLES:
            return 0.0
        return statistics.median(self._tails)

    def prefill_s(self, tokens: int) -> float | None:
        """A fresh prefill of ``tokens``: on the straight line between the
        prefills measured at the lengths around it; beyond the ends, a token's
        time at the nearest length measured."""
        if not self._per_token:
            return None
        points = sorted((n.value, t.value) for n, t in self._per_token.values())
        below = [p for p in points if p[0] <= tokens]
        above = [p for p in points if p[0] > tokens]
        if not below or not above:
            return tokens * (above[0] if not below else below[-1])[1]
        # NOTE: the line's slope is a token's time between the two lengths, not
        # the bucket's mean: with the mean, the tokens after a long cached prefix
        # (span_s) cost what an average token of that length does, not what the
        # last ones do (on the CPU backend a turn's 543 tokens after 25k held
        # left 186 ms of tail, and pushes of 4 blocks were judged not worth it)
        (n0, t0), (n1, t1) = below[-1], above[0]
        return n0 * t0 + (n1 * t1 - n0 * t0) * (tokens - n0) / (n1 - n0)

    def span_s(self, start: int, tokens: int) -> float | None:
        """``tokens`` computed after ``start`` cached ones: what a fresh prefill of
        all of them takes more than one of the cached ones, at least a fresh
        prefill of their own length."""
        own = self.prefill_s(tokens)
        if own is None or start <= 0:
            return own
        end, before = self.prefill_s(start + tokens), self.prefill_s(start)
        assert end is not None and before is not None  # measured: own is
        return max(own, end - before)

    def local_cost_s(
        self, tokens: int, queued: int = 0, start: int = 0
    ) -> float | None:
        """A local prefill's time (of ``tokens`` after ``start`` cached ones), once
        for itself and once for each of ``queued`` requests it delays (steps are
        shared; a push's write is not)."""
        prefill = self.span_s(start, tokens)
        if prefill is None:
            return None
        return prefill * (1 + max(0, min(queued, MAX_QUEUED)))

    def match_wait_s(
        self, tokens: int, cap: float, queued: int = 0, start: int = 0
    ) -> float:
        """How long D waits for a source's /match_blocks answer for a push of
        ``tokens``: the push saves at most their local prefill, so D waits that
        long (MATCH_WAIT_FLOOR_S at least) and then prefills, at most twice the
        better choice's time (as in ski rental); at most ``cap``
        (MOONCAKE_PUSH_MATCH_TIMEOUT_S), which is also the unmeasured wait."""
        local = self.local_cost_s(max(0, tokens), queued, start)
        if local is None:
            return cap
        return min(cap, max(MATCH_WAIT_FLOOR_S, local))

    def budget_s(
        self, source: str, blocks: int, cap: float, load: SourceLoad = IDLE
    ) -> float:
        """The push's timeout (how long it may take to start writing): at most
        ``cap`` (MOONCAKE_PUSH_TIMEOUT_S), which is also the unmeasured budget."""
        expected = self.write_s(source, blocks, load)
        if expected is None:
            return cap
        rtt = self._round_trip[source].value
        return min(cap, BUDGET_FACTOR * expected + rtt + BUDGET_FLOOR_S)

    def decide(
        self,
        source: str,
        blocks: int,
        block_size: int,
        judge: bool = True,
        load: SourceLoad = IDLE,
        queued: int = 0,
        start: int = 0,
    ) -> Estimate:
        """Whether to push ``blocks`` from ``source`` after ``start`` tokens D holds
        (``judge`` False: granted already; only the minimum, a full source and a
        loaded source's cost apply). prefill_s is the local prefill's weighted
        cost."""
        tokens = blocks * block_size
        if tokens < max(1, self.min_tokens):
            return Estimate(Decision.BELOW_MINIMUM, None, None)
        if load.full:
            # NOTE: under "always" too: the source would answer busy, after D had
            # allocated the blocks and the request had waited for nothing
            return Estimate(Decision.REFUSED, None, None)
        if not judge:
            if load.idle or self.always:
                return Estimate(None, None, None)
            transfer = self.transfer_s(source, blocks, load)
            prefill = self.local_cost_s(tokens, queued, start)
            if transfer is None or prefill is None or transfer < prefill:
                return Estimate(None, transfer, prefill)
            return Estimate(Decision.NOT_WORTH_IT, transfer, prefill)
        f = self._failures.get(source)
        if f is not None and f.in_a_row >= FAILURES_TO_DEMOTE:
            # NOTE: under "always" too: a push that lands nothing saves no compute
            if self._clock() - f.at < PROBE_AFTER_S:
                return Estimate(Decision.NOT_WORTH_IT, None, None)
            f.at = self._clock()  # one probe: a landing ends the failures
            return Estimate(None, None, None)
        if self.always:
            return Estimate(None, None, None)
        transfer = self.transfer_s(source, blocks, load)
        prefill = self.local_cost_s(tokens, queued, start)
        if transfer is None or prefill is None or transfer < prefill:
            return Estimate(None, transfer, prefill)
        line = self._push_line(source, load)
        assert line is not None  # transfer_s had it
        if self._clock() - line.at >= PROBE_AFTER_S:
            # measured long ago: push once more, which measures it again
            line.at = self._clock()
            return Estimate(None, transfer, prefill)
        return Estimate(Decision.NOT_WORTH_IT, transfer, prefill)


class PrefillTimer:
    """Times D's local prefills (allocation to first output token) and the tails
    of landed pushes (worker's report to first token)."""

    def __init__(
        self, model: PushCostModel, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._model = model
        self._clock = clock
        # req id -> (request, allocated at, its own hit: None until the step's
        # scheduler output says it)
        self._running: dict[str, tuple[object, float, int | None]] = {}
        # req id -> (request, its push landed at, its hit and when it was
        # scheduled: None until then)
        self._tails: dict[str, tuple[object, float, int | None, float | None]] = {}

    def allocated(self, request: object, num_external_tokens: int) -> None:
        rid = request.request_id  # type: ignore[attr-defined]
        if (
            num_external_tokens  # loaded from elsewhere: not a local prefill
            or rid in self._running  # allocated again: preempted before its token
            or getattr(request, "num_output_tokens", 0) > 0  # resumed
        ):
            self._running.pop(rid, None)
            return
        if len(self._running) < MAX_TRACKED:
            self._running[rid] = (request, self._clock(), None)

    def landed(self, request: object) -> None:
        """Its push landed whole (the worker's report): its tail starts."""
        if len(self._tails) < MAX_TRACKED:
            self._tails[request.request_id] = (request, self._clock(), None, None)  # type: ignore[attr-defined]

    def step(self, scheduler_output: object) -> None:
        """Once a step: the new requests' own hits, and first tokens produced."""
        news = getattr(scheduler_output, "scheduled_new_reqs", None) or ()
        for new in news if self._tails else ():
            tail = self._tails.get(new.req_id)
            if tail is not None and tail[2] is None:
                hit = int(new.num_computed_tokens)
                self._tails[new.req_id] = (*tail[:2], hit, self._clock())
        for rid, (request, *_) in list(self._tails.items()):
            self._check_tail(rid, request)
        if not self._running:
            return
        for new in news:
            entry = self._running.get(new.req_id)
            if entry is not None and entry[2] is None:
                # both supported releases fill it before the step's tokens count
                hit = int(new.num_computed_tokens)
                prompt = len(getattr(entry[0], "prompt_token_ids", None) or ())
                if prompt - hit < 2**MIN_BUCKET:
                    del self._running[new.req_id]  # too short to say much
                else:
                    self._running[new.req_id] = (entry[0], entry[1], hit)
        for rid, (request, _, hit) in list(self._running.items()):
            if hit is None:
                del self._running[rid]  # not scheduled as a new request
            else:
                self._check(rid, request)

    def finished(self, request: object) -> None:
        rid = request.request_id  # type: ignore[attr-defined]
        if rid in self._tails:
            self._check_tail(rid, request)
            self._tails.pop(rid, None)
        if rid in self._running:
            self._check(rid, request)
            self._running.pop(rid, None)

    def _check_tail(self, rid: str, request: object) -> None:
        if getattr(request, "num_output_tokens", 0) >= 1:
            _, landed, hit, scheduled = self._tails.pop(rid)
            if hit is None:  # its first token came before a later step
                hit = getattr(request, "num_cached_tokens", -1)
            prompt = len(getattr(request, "prompt_token_ids", None) or ())
            own = prompt - hit if hit is not None and hit >= 0 else 0
            seconds, held = self._clock() - landed, max(0, hit or 0)
            tail = self._model.observe_tail(seconds, own, held)
            if tail is not None and logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "Prefix push for %s: first token %.0f ms after the landing "
                    "(scheduled after %s; %d own tokens after %d held): tail %.0f "
                    "ms, the median now %.0f ms",
                    rid,
                    1e3 * seconds,
                    "?"
                    if scheduled is None
                    else f"{1e3 * (scheduled - landed):.0f} ms",
                    own,
                    held,
                    1e3 * tail,
                    1e3 * self._model.tail_s,
                )

    def _check(self, rid: str, request: object) -> None:
        _, started, computed = self._running[rid]
        if computed is None:
            return
        if getattr(request, "num_output_tokens", 0) < 1:
            return
        del self._running[rid]
        prompt = len(getattr(request, "prompt_token_ids", None) or ())
        self._model.observe_prefill(
            prompt - computed, self._clock() - started, computed
        )


__all__ = [
    "BUDGET_FACTOR",
    "BUDGET_FLOOR_S",
    "FAILURES_TO_DEMOTE",
    "MAX_QUEUED",
    "Decision",
    "Estimate",
    "PrefillTimer",
    "IDLE",
    "PushCostModel",
    "SourceLoad",
    "bucket",
]
