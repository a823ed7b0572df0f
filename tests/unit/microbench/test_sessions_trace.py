"""microbench/sessions/trace.py: a Mooncake-format trace scaled to a small
machine keeps what the benchmark measures (equal ids give equal tokens, lengths
and arrival order kept), the window takes whole sessions, and the reuse an
unbounded prefix cache would get is counted as vLLM counts hits."""

from __future__ import annotations

import json

import pytest

from microbench.sessions import trace
from microbench.sessions.trace import PromptBuilder, TraceRequest

B = 16  # tokens a block after scaling (small, to keep the numbers readable)


def req(ts, length, ids, out=8):
    return TraceRequest(float(ts), length, out, tuple(ids))


def test_equal_ids_give_equal_tokens_and_nothing_else_is_shared():
    build = PromptBuilder(B, vocab_size=4096, seed=3)
    one = build.prompt(req(0, 3 * B, [0, 1, 2]))
    two = build.prompt(req(1, 4 * B, [0, 1, 7, 8]))
    assert one[: 2 * B] == two[: 2 * B]
    assert one[2 * B : 3 * B] != two[2 * B : 3 * B]
    # the same in another builder (another process) with the same seed, not another
    assert PromptBuilder(B, 4096, seed=3).prompt(req(5, 3 * B, [0, 1, 2])) == one
    assert PromptBuilder(B, 4096, seed=4).prompt(req(5, 3 * B, [0, 1, 2])) != one
    assert all(4 <= t < 4096 for t in one + two)  # clear of the special tokens


def test_a_partial_last_block_is_a_prefix_of_the_full_one():
    build = PromptBuilder(B, vocab_size=4096)
    full = build.prompt(req(0, 2 * B, [5, 6]))
    part = build.prompt(req(0, B + 3, [5, 6]))
    assert len(part) == B + 3 and part == full[: B + 3]


def test_scaling_keeps_lengths_order_and_gaps():
    raw = [
        req(1000, 1500, [0, 1, 2], out=300),
        req(4000, 2048, [0, 1, 2, 3], out=5),
        req(2500, 100, [9], out=0),
    ]
    got = trace.scale(
        raw,
        block_tokens=B,
        source_block_tokens=512,
        time_scale=0.5,
        output_divisor=10,
        max_output=16,
    )
    assert [r.hash_ids for r in got] == [(0, 1, 2), (9,), (0, 1, 2, 3)]
    assert [r.timestamp_ms for r in got] == [0.0, 750.0, 1500.0]
    for r, src in zip(got, (raw[0], raw[2], raw[1])):
        # the length shrinks by the block ratio, within one token of rounding
        assert abs(r.input_length - src.input_length * B / 512) <= 1
        assert (len(r.hash_ids) - 1) * B < r.input_length <= len(r.hash_ids) * B
    assert [r.output_length for r in got] == [16, 1, 1]


def test_window_takes_whole_sessions_from_the_start_time():
    reqs = [
        req(0, 64, [0, 1, 2]),  # session (0, 1) starts before the window
        req(10, 64, [0, 5, 6]),  # (0, 5): three turns
        req(11, 64, [0, 8]),  # (0, 8): one turn
        req(20, 64, [0, 5, 6, 7]),
        req(30, 64, [0, 1, 2, 3]),
        req(40, 64, [0, 5, 6, 7, 9]),
        req(50, 64, [0, 4, 4]),  # (0, 4): two turns
        req(60, 64, [0, 4, 4, 4]),
    ]
    got = trace.window(reqs, start_ms=5, max_requests=10, min_turns=2)
    assert [r.timestamp_ms for r in got] == [10, 20, 40, 50, 60]
    # a session that does not fit is left out whole, not cut
    assert [
        r.timestamp_ms
        for r in trace.window(reqs, start_ms=5, max_requests=4, min_turns=2)
    ] == [10, 20, 40]
    assert (
        len(trace.window(reqs, start_ms=5, max_requests=10, min_turns=2, max_turns=2))
        == 4
    )


def test_a_session_with_a_turn_over_the_limit_is_left_out():
    reqs = [
        req(0, 64, [0, 5]),
        req(10, 900, [0, 5, 6]),
        req(20, 64, [0, 8]),
        req(30, 64, [0, 8, 9]),
    ]
    got = trace.window(reqs, max_requests=10, min_turns=2, max_input=500)
    assert [r.timestamp_ms for r in got] == [20, 30]


def test_sessions_are_spaced_evenly_and_keep_their_rhythm():
    reqs = [
        req(0, 64, [0, 1]),
        req(100, 64, [0, 2]),
        req(60_000, 64, [0, 1, 3]),  # session (0, 1): its turn 2 a minute later
        req(60_500, 64, [0, 2, 4]),
        req(200_000, 64, [0, 1, 3, 5]),
    ]
    got = trace.space_sessions(reqs, interval_ms=5_000, gap_scale=0.01)
    times = {(r.hash_ids[:2], len(r.hash_ids)): r.timestamp_ms for r in got}
    assert times[((0, 1), 2)] == 0 and times[((0, 2), 2)] == 5_000
    assert times[((0, 1), 3)] == pytest.approx(600)
    assert times[((0, 1), 4)] == pytest.approx(2_000)
    assert times[((0, 2), 3)] == pytest.approx(5_000 + 604)
    assert [r.timestamp_ms for r in got] == sorted(r.timestamp_ms for r in got)
    held = trace.space_sessions(
        reqs, interval_ms=5_000, gap_scale=0.01, max_gap_ms=1_000
    )
    times = {(r.hash_ids[:2], len(r.hash_ids)): r.timestamp_ms for r in held}
    assert times[((0, 1), 3)] == pytest.approx(600)  # under the limit: kept
    assert times[((0, 1), 4)] == pytest.approx(1_600)  # 1,400 ms held to 1,000


def test_unbounded_reuse_counts_leading_full_blocks_as_vllm_hits():
    reqs = [
        req(0, 3 * B, [0, 1, 2]),  # nothing seen: 0
        req(1, 4 * B + 5, [0, 1, 2, 3, 4]),  # 3 leading blocks seen: 3 * B
        req(2, 3 * B, [0, 1, 2]),  # all 3 seen, but the last token is computed: 2 * B
        req(3, 2 * B, [0, 9]),  # first block seen, second not: B
        req(4, 4 * B, [7, 1, 2, 3]),  # block 1 seen only after another first: 0
    ]
    got = trace.unbounded_reuse(reqs, B)
    assert got["per_request"] == [0, 3 * B, 2 * B, B, 0]
    assert got["hit_tokens"] == 6 * B
    assert got["prompt_tokens"] == sum(r.input_length for r in reqs)
    assert got["fraction"] == pytest.approx(6 * B / got["prompt_tokens"])


def test_a_partial_block_is_never_counted_as_seen():
    reqs = [req(0, B + 4, [0, 1]), req(1, 3 * B, [0, 1, 2])]
    assert trace.unbounded_reuse(reqs, B)["per_request"] == [0, B]


def test_unbounded_reuse_of_prompts_counts_what_earlier_requests_left_cached():
    def toks(*blocks):  # a block of B tokens per value
        return [v for b in blocks for v in [b] * B]

    served = [
        # turn 1: prompt of 2 blocks and a bit; its answer completes a third block
        (toks(1, 2) + [3] * 5, toks(1, 2, 3)),
        # turn 2: turn 1, its answer, one block more: 3 blocks seen
        (toks(1, 2, 3, 4) + [9], toks(1, 2, 3, 4) + [9]),
        # the same prompt again: all 4 seen, but the last token is computed: 4
        (toks(1, 2, 3, 4) + [9], toks(1, 2, 3, 4) + [9]),
        # a block seen only after another first block is not a hit
        (toks(7, 2, 3), toks(7, 2, 3)),
        # a prompt of whole blocks, all seen: its last block is computed
        (toks(1, 2, 3), toks(1, 2, 3)),
    ]
    got = trace.unbounded_reuse_of_prompts(served, B)
    assert got["per_request"] == [0, 3 * B, 4 * B, 0, 2 * B]
    assert got["hit_tokens"] == 9 * B
    assert got["prompt_tokens"] == sum(len(p) for p, _ in served)


def test_unbounded_reuse_of_prompts_tells_equal_blocks_apart_by_what_precedes():
    a, b = [1] * B + [2] * B, [2] * B + [1] * B
    served = [(a + [0], a), (b + [0], b), ([1] * B + [1] * B + [0], [])]
    assert trace.unbounded_reuse_of_prompts(served, B)["per_request"] == [0, 0, B]


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        json.dumps({"timestamp": 0, "input_length": 10}),
        json.dumps(
            {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}
        ),
        json.dumps(
            {"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}
        ),
        json.dumps(
            {"timestamp": "nan", "input_length": 5, "output_length": 1, "hash_ids": [1]}
        ),
        json.dumps(
            {
                "timestamp": 0,
                "input_length": 5,
                "output_length": 1,
                "hash_ids": list(range(trace.MAX_LINE_IDS + 1)),
            }
        ),
    ],
)
def test_a_bad_line_is_refused_with_its_place(line):
    with pytest.raises(trace.TraceError, match="t.jsonl:7"):
        trace.parse_line(line, "t.jsonl:7")


def test_a_written_trace_loads_back_unchanged(tmp_path):
    reqs = [req(0, 40, [0, 1, 2]), req(12.5, 20, [0, 3])]
    path = trace.write(tmp_path / "s.jsonl", reqs)
    assert trace.load(path) == reqs


# ---- multi-turn traces (AIPerf's agentic-code): one line per turn, its own ids ----

SRC = 512  # the multi-turn trace's tokens a block


def turn(session, ids, length, ts=None, delay=None, out=100):
    line = {
        "session_id": session,
        "input_length": length,
        "output_length": out,
        "hash_ids": ids,
    }
    if ts is not None:
        line["timestamp"] = ts
    if delay is not None:
        line["delay"] = delay
    return json.dumps(line)


def load_lines(tmp_path, lines):
    path = tmp_path / "multi.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return trace.load(path)


def test_a_multi_turn_trace_becomes_whole_prompts_per_session(tmp_path):
    reqs = load_lines(
        tmp_path,
        [
            # two sessions sharing a tools prefix (ids 0, 1), as agentic-code writes
            turn("a", [0, 1, 2], 2 * SRC + 100, ts=0.0),
            turn("b", [0, 1, 3], 3 * SRC, ts=500.0),
            turn("a", [10, 11], SRC + 7, delay=2000.0),
            turn("b", [12], 40, delay=100.0),
            turn("a", [13], SRC, delay=50.0),
        ],
    )
    by = {(r.session, r.timestamp_ms): r for r in reqs}
    assert [r.timestamp_ms for r in reqs] == sorted(r.timestamp_ms for r in reqs)
    a2, a3 = by[("a", 2000.0)], by[("a", 2050.0)]
    b2 = by[("b", 600.0)]
    # turn k's ids: the session's turns 0..k in order
    assert a2.hash_ids == (0, 1, 2, 10, 11) and a3.hash_ids == (0, 1, 2, 10, 11, 13)
    assert b2.hash_ids == (0, 1, 3, 12)
    # lengths: earlier turns' partial last blocks count whole, the last as given
    assert a2.input_length == 4 * SRC + 7 and a3.input_length == 6 * SRC
    assert b2.input_length == 3 * SRC + 40
    # at most one block a turn over the trace's own sum
    assert 0 <= a2.input_length - (2 * SRC + 100 + SRC + 7) <= SRC
    # sessions are the trace's, though both start with the same two ids
    assert len(trace.sessions(reqs)) == 2
    # and scaled, equal ids still give equal tokens: the shared prefix, a's history
    scaled = trace.scale(reqs, block_tokens=B, source_block_tokens=SRC)
    build = PromptBuilder(B, vocab_size=4096)
    prompts = {(r.session, len(r.hash_ids)): build.prompt(r) for r in scaled}
    assert prompts[("a", 3)][: 2 * B] == prompts[("b", 3)][: 2 * B]
    assert prompts[("a", 3)][2 * B : 3 * B] != prompts[("b", 3)][2 * B : 3 * B]
    earlier = prompts[("a", 5)]  # the turn before: a prefix of the next one
    assert len(earlier) == 4 * B + 1 and prompts[("a", 6)][: len(earlier)] == earlier
    assert all(r.session for r in scaled)


def test_a_multi_turn_trace_keeps_its_sessions_through_spacing_and_writing(tmp_path):
    reqs = load_lines(
        tmp_path,
        [
            turn("a", [0, 1], 2 * SRC, ts=0.0),
            turn("b", [0, 2], 2 * SRC, ts=10.0),
            turn("a", [3], SRC, delay=1000.0),
        ],
    )
    spaced = trace.space_sessions(reqs, interval_ms=100.0, gap_scale=0.5)
    assert [(r.session, r.timestamp_ms) for r in spaced] == [
        ("a", 0.0),
        ("b", 100.0),
        ("a", 500.0),
    ]
    out = trace.write(tmp_path / "w.jsonl", spaced)
    assert trace.load(out) == spaced


@pytest.mark.parametrize(
    "lines",
    [
        [turn("a", [0], 10, delay=5.0)],  # a first turn without a timestamp
        [  # a later turn with a timestamp of its own
            turn("a", [0], 10, ts=0.0),
            turn("a", [1], 10, delay=5.0),
            turn("a", [2], 10, ts=9.0),
        ],
    ],
)
def test_a_multi_turn_trace_with_a_bad_session_is_refused(tmp_path, lines):
    with pytest.raises(trace.TraceError):
        load_lines(tmp_path, lines)


def test_each_turn_follows_its_sessions_turn_before_it():
    reqs = [
        TraceRequest(0.0, 4, 1, (1, 2, 3)),
        TraceRequest(1.0, 4, 1, (5, 6)),
        TraceRequest(2.0, 4, 1, (1, 2, 3, 4)),
        TraceRequest(3.0, 4, 1, (7, 8), session="s"),
        TraceRequest(4.0, 4, 1, (9,), session="s"),
        TraceRequest(5.0, 4, 1, (1, 2, 3, 4, 9)),
    ]
    assert trace.previous_turns(reqs) == [None, None, 0, None, 3, 2]
