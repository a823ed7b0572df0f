"""Mooncake-format request traces, scaled to a small machine (pure: no I/O but
reading and writing the JSONL).

A trace line is one request: ``timestamp`` (ms from the start), ``input_length``
and ``output_length`` (tokens) and ``hash_ids``: the prompt as a list of blocks of
``source_block_tokens`` tokens (512 in Mooncake's FAST'25 release), where equal ids
mean equal content. Scaling keeps that structure:

- **blocks**: each id becomes ``block_tokens`` tokens (one vLLM KV block), and a
  request's input length shrinks by the same factor (its last block may stay
  partial, as in the trace); equal ids stay equal, so two prompts share exactly
  the leading blocks the trace says they share;
- **outputs**: divided by ``output_divisor`` and clamped to ``[1, max_output]``;
- **time**: shifted to start at 0 and multiplied by ``time_scale``; order kept.

A window is chosen by session, not by time slice: a run of a few dozen
consecutive requests of a one-hour production trace shares almost nothing (4-8%
prefix reuse in the conversation trace), because a conversation's turns lie
minutes apart. ``sessions()`` groups requests by their first two ids (the shared
system prompt is the first; the conversation's opening the second), and
``window()`` takes whole sessions, in order of their first request, from a given
time on. This grouping is a heuristic of ours, not a field of the trace.

A trace whose lines carry a ``session_id`` is the multi-turn form AIPerf writes
(``aiperf synthesize agentic-code``): a line is one turn, its ``input_length``
and ``hash_ids`` only what the turn adds, its time a ``timestamp`` on a session's
first turn and a ``delay`` (ms after the previous turn) on the others.
``load()`` turns it into whole prompts: turn k's ids are the session's ids of
turns 0..k in order, its length covers them (every earlier turn's last, partial
block counted whole: at most one block a turn more than the trace's sum), its
time the previous turn's plus the delay, and the session is the ``session_id``
(not the heuristic above).

``unbounded_reuse()`` is the prefix reuse one instance with an unbounded prefix
cache would get: per request, the leading full blocks whose whole prefix an
earlier request already had, as vLLM's prefix cache counts them (a prompt's last
token is always computed, so a prompt of exactly k blocks can hit k - 1).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.model import SPECIAL_TOKENS

SOURCE_BLOCK_TOKENS = 512  # Mooncake's FAST'25 traces
MAX_LINE_IDS = 100_000  # a line with more ids than this is refused


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None  # the trace's session_id, if it has one

    def as_line(self) -> dict:
        line = {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session is not None:
            line["session_id"] = self.session
        return line


class TraceError(ValueError):
    pass


def parse_line(line: str, where: str) -> TraceRequest:
    """One line; a multi-turn line (``session_id``) gives its turn's own ids and
    length, its ``delay`` as the timestamp when it has no ``timestamp``."""
    return parse_turn(line, where)[0]


def parse_turn(line: str, where: str) -> tuple[TraceRequest, bool]:
    """parse_line's request, and whether the line has a ``timestamp``."""
    try:
        obj = json.loads(line)
        session = obj.get("session_id")
        if session is not None:
            session = str(session)
        if session is not None and "timestamp" not in obj:
            ts = float(obj["delay"])
        else:
            ts = float(obj["timestamp"])
        inp = int(obj["input_length"])
        out = int(obj["output_length"])
        ids = obj["hash_ids"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise TraceError(
            f"{where}: not a Mooncake trace line (timestamp, input_length, "
            f"output_length, hash_ids; or session_id with timestamp or delay): {e}"
        ) from e
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    if len(ids) > MAX_LINE_IDS or inp < 1 or out < 0 or not math.isfinite(ts):
        raise TraceError(
            f"{where}: out of range (input_length {inp}, output_length {out}, "
            f"{len(ids)} hash_ids, timestamp {ts})"
        )
    return TraceRequest(ts, inp, out, tuple(ids), session), "timestamp" in obj


def load(
    path: Path, source_block_tokens: int = SOURCE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """A trace's requests: a multi-turn trace (its sessions' later turns carry a
    ``delay``, not a ``timestamp``) as whole prompts, any other as written."""
    turns, timed = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                turn, has_ts = parse_turn(line, f"{path}:{n}")
                turns.append(turn)
                timed.append(has_ts)
    if all(timed):
        return turns
    firsts: set[str] = set()
    for n, (r, has_ts) in enumerate(zip(turns, timed), 1):
        if r.session is None:
            raise TraceError(
                f"{path}: request {n}: no session_id in a multi-turn trace (one "
                "whose later turns carry a delay)"
            )
        first = r.session not in firsts
        firsts.add(r.session)
        if first != has_ts:
            raise TraceError(
                f"{path}: request {n}: in a multi-turn trace a session's first turn "
                "has a timestamp and its later turns a delay"
            )
    return whole_prompts(turns, source_block_tokens)


def whole_prompts(
    turns: Sequence[TraceRequest], source_block_tokens: int
) -> list[TraceRequest]:
    """A multi-turn trace's turns (each with its own ids and length, a session's
    later turns' ``timestamp_ms`` its delay) as whole prompts, in time order (see
    the module's doc)."""
    state: dict[str, tuple[float, tuple[int, ...], int]] = {}
    out = []
    for t in turns:
        assert t.session is not None
        at, ids, length = state.get(t.session, (0.0, (), 0))
        at = at + t.timestamp_ms  # a first turn: its timestamp; else: the delay
        ids += t.hash_ids
        if len(ids) > MAX_LINE_IDS:
            raise TraceError(
                f"session {t.session}: more than {MAX_LINE_IDS} ids in one prompt"
            )
        if t.hash_ids:  # every earlier block whole; this turn's last as given
            last = t.input_length - (len(t.hash_ids) - 1) * source_block_tokens
            length = (len(ids) - 1) * source_block_tokens + min(
                max(last, 1), source_block_tokens
            )
        else:
            length += t.input_length
        state[t.session] = (at, ids, length)
        out.append(TraceRequest(at, length, t.output_length, ids, t.session))
    return sorted(out, key=lambda r: r.timestamp_ms)


def write(path: Path, reqs: Iterable[TraceRequest]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r.as_line()) + "\n" for r in reqs))
    return path


def session_key(r: TraceRequest) -> tuple:
    """The trace's session_id where it has one, else the first two ids."""
    return ("session", r.session) if r.session is not None else r.hash_ids[:2]


def previous_turns(reqs: Sequence[TraceRequest]) -> list[int | None]:
    """Per request the index of its session's turn before it (None: a first
    turn), ``reqs`` in the order they are sent."""
    last: dict[tuple, int] = {}
    out: list[int | None] = []
    for i, r in enumerate(reqs):
        out.append(last.get(session_key(r)))
        last[session_key(r)] = i
    return out


def sessions(reqs: Sequence[TraceRequest]) -> list[list[TraceRequest]]:
    """Requests grouped by their first two ids, each group in trace order, the
    groups in order of their first request."""
    groups: dict[tuple, list[TraceRequest]] = {}
    for r in sorted(reqs, key=lambda r: r.timestamp_ms):
        groups.setdefault(session_key(r), []).append(r)
    return list(groups.values())


def window(
    reqs: Sequence[TraceRequest],
    *,
    start_ms: float = 0.0,
    max_requests: int,
    min_turns: int = 1,
    max_turns: int | None = None,
    max_input: int | None = None,
) -> list[TraceRequest]:
    """Whole sessions of at least ``min_turns`` requests (their first
    ``max_turns``, none longer than ``max_input`` tokens), starting at or after
    ``start_ms``, in order of their first request, until ``max_requests`` would
    be exceeded; the requests in time order."""
    picked: list[TraceRequest] = []
    for group in sessions(reqs):
        if group[0].timestamp_ms < start_ms or len(group) < min_turns:
            continue
        group = group[:max_turns] if max_turns else group
        if max_input is not None and max(r.input_length for r in group) > max_input:
            continue
        if len(picked) + len(group) > max_requests:
            if picked:
                break
            continue
        picked.extend(group)
    return sorted(picked, key=lambda r: r.timestamp_ms)


def space_sessions(
    reqs: Sequence[TraceRequest],
    *,
    interval_ms: float,
    gap_scale: float,
    max_gap_ms: float | None = None,
) -> list[TraceRequest]:
    """The sessions started ``interval_ms`` apart, in order of their first
    request, each keeping its turns' order and the trace's gaps between them
    multiplied by ``gap_scale`` (and held to ``max_gap_ms``); the requests in
    time order.

    Shrinking the whole time axis of a window of whole sessions would send every
    session's first turn at once (in the trace they are seconds apart among
    other sessions' requests, which the window leaves out), and the later turns
    minutes after; this keeps the sessions' arrival even and their rhythm."""
    out: list[TraceRequest] = []
    for k, group in enumerate(sessions(reqs)):
        at, prev = k * interval_ms, group[0].timestamp_ms
        for r in group:
            gap = (r.timestamp_ms - prev) * gap_scale
            at += gap if max_gap_ms is None else min(gap, max_gap_ms)
            prev = r.timestamp_ms
            out.append(
                TraceRequest(at, r.input_length, r.output_length, r.hash_ids, r.session)
            )
    return sorted(out, key=lambda r: r.timestamp_ms)


def scale(
    reqs: Sequence[TraceRequest],
    *,
    block_tokens: int,
    source_block_tokens: int = SOURCE_BLOCK_TOKENS,
    time_scale: float = 1.0,
    output_divisor: float = 1.0,
    max_output: int | None = None,
) -> list[TraceRequest]:
    """The requests with ``block_tokens`` tokens per id (see the module's doc)."""
    if not reqs:
        return []
    t0 = min(r.timestamp_ms for r in reqs)
    out = []
    for r in sorted(reqs, key=lambda r: r.timestamp_ms):
        n_ids = len(r.hash_ids)
        length = math.ceil(r.input_length * block_tokens / source_block_tokens)
        if n_ids:  # within the blocks the ids cover
            length = min(
                max(length, (n_ids - 1) * block_tokens + 1), n_ids * block_tokens
            )
        output = max(1, round(r.output_length / output_divisor))
        if max_output is not None:
            output = min(output, max_output)
        out.append(
            TraceRequest(
                (r.timestamp_ms - t0) * time_scale,
                max(1, length),
                output,
                r.hash_ids,
                r.session,
            )
        )
    return out


class PromptBuilder:
    """Token ids for a scaled request: block ``i`` of every prompt is the same
    ``block_tokens`` tokens for the same id (drawn from a generator seeded by the
    id and ``seed``, the same in every process), cut at the input length."""

    def __init__(self, block_tokens: int, vocab_size: int, seed: int = 0):
        self.block_tokens, self.vocab_size, self.seed = block_tokens, vocab_size, seed
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        got = self._blocks.get(hash_id)
        if got is None:
            digest = hashlib.blake2b(
                f"{self.seed}:{hash_id}".encode(), digest_size=8
            ).digest()
            rng = random.Random(int.from_bytes(digest, "little"))
            # clear of the generated vocabulary's special tokens
            low = len(SPECIAL_TOKENS)
            got = [
                rng.randrange(low, self.vocab_size) for _ in range(self.block_tokens)
            ]
            self._blocks[hash_id] = got
        return got

    def prompt(self, r: TraceRequest) -> list[int]:
        ids: list[int] = []
        for h in r.hash_ids:
            if len(ids) >= r.input_length:
                break
            ids.extend(self.block(h))
        if len(ids) < r.input_length:  # a trace line with too few ids: pad uniquely
            pad = PromptBuilder(1, self.vocab_size, seed=hash((self.seed, r)))
            ids.extend(pad.block(i)[0] for i in range(r.input_length - len(ids)))
        return ids[: r.input_length]


def cacheable_blocks(r: TraceRequest, block_tokens: int) -> int:
    """Full blocks vLLM may take from a prefix cache for this prompt (its last
    token is always computed)."""
    return min(len(r.hash_ids), (r.input_length - 1) // block_tokens)


def _reuse_in_order(
    served: Iterable[tuple[int, Iterable[Hashable], Iterable[Hashable]]],
    block_tokens: int,
) -> dict:
    """The unbounded cache's reuse, requests in the order served: each a (prompt
    length, its usable leading blocks' keys, the keys it leaves cached); per
    request the leading keys an earlier request left cached."""
    seen: set[Hashable] = set()
    hit_tokens = prompt_tokens = 0
    per_request = []
    for length, keys, stored in served:
        k = 0
        for key in keys:
            if key not in seen:
                break
            k += 1
        per_request.append(k * block_tokens)
        hit_tokens += k * block_tokens
        prompt_tokens += length
        seen.update(stored)
    return {
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "fraction": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "per_request": per_request,
    }


def unbounded_reuse(reqs: Sequence[TraceRequest], block_tokens: int) -> dict:
    """Prefix reuse on one instance with an unbounded cache, requests served in
    time order: per request the leading full blocks whose prefix was seen."""

    def prefixes(r: TraceRequest, n: int):
        return (r.hash_ids[:i] for i in range(1, n + 1))

    return _reuse_in_order(
        (
            (
                r.input_length,
                prefixes(r, cacheable_blocks(r, block_tokens)),
                prefixes(r, min(len(r.hash_ids), r.input_length // block_tokens)),
            )
            for r in sorted(reqs, key=lambda r: r.timestamp_ms)
        ),
        block_tokens,
    )


def unbounded_reuse_of_prompts(
    served: Sequence[tuple[Sequence[int], Sequence[int]]], block_tokens: int
) -> dict:
    """``unbounded_reuse`` for requests known by their tokens, in the order served:
    each a (prompt, tokens it leaves cached) pair, the second its prompt and answer
    (a prefix of them: vLLM caches the full blocks of both). Per request the
    leading full blocks of its prompt that an earlier request left cached, at most
    all but its last token."""

    def chain(tokens: Sequence[int], blocks: int):
        h = b""
        for i in range(blocks):
            block = tokens[i * block_tokens : (i + 1) * block_tokens]
            h = hashlib.blake2b(
                h + b"".join(t.to_bytes(8, "little") for t in block), digest_size=16
            ).digest()
            yield h

    return _reuse_in_order(
        (
            (
                len(prompt),
                chain(prompt, max(0, (len(prompt) - 1) // block_tokens)),
                chain(cached, len(cached) // block_tokens),
            )
            for prompt, cached in served
        ),
        block_tokens,
    )


def describe(reqs: Sequence[TraceRequest]) -> dict:
    """Counts, lengths and span of a (scaled) trace, for the result's JSON."""
    if not reqs:
        return {"requests": 0}
    ins = sorted(r.input_length for r in reqs)
    outs = sorted(r.output_length for r in reqs)
    return {
        "requests": len(reqs),
        "sessions": len(sessions(reqs)),
        "input_median": ins[len(ins) // 2],
        "input_max": ins[-1],
        "output_median": outs[len(outs) // 2],
        "span_s": (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1e3,
    }


__all__ = [
    "PromptBuilder",
    "TraceError",
    "TraceRequest",
    "cacheable_blocks",
    "describe",
    "load",
    "scale",
    "sessions",
    "unbounded_reuse",
    "unbounded_reuse_of_prompts",
    "window",
    "write",
]
