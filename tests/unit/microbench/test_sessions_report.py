"""microbench/sessions' report: the reuse accounting of an arm against the
unbounded cache, the noise bound of the kv_aware and P/D comparisons, and the
replay's P/D requests (stub P and D servers on 127.0.0.1)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from microbench.sessions.__main__ import (
    PUSH_REASONS,
    add_reuse,
    grown,
    targets,
    ttft_difference,
    where_the_time_goes,
)
from microbench.sessions.replay import replay
from microbench.sessions.trace import TraceRequest


def arm(ttfts):
    return {"outcomes": [{"ttft_s": t} for t in ttfts]}


def test_reuse_is_cache_hits_and_connector_tokens_against_the_unbounded_cache():
    row = {
        "tokens": {
            "local_compute": 700.0,
            "local_cache_hit": 200.0,
            "external_kv_transfer": 100.0,
        }
    }
    add_reuse(row, {"prompt_tokens": 1000, "hit_tokens": 400})
    assert row["reuse"] == pytest.approx(0.3)
    assert row["reuse_of_unbounded"] == pytest.approx(0.75)
    assert row["computed_tokens"] == 700
    # 600 tokens no cache could have saved; 100 more were computed
    assert row["recomputed_tokens"] == 100
    assert row["short_of_unbounded"] == {"requests": 0, "tokens": 0, "largest": []}


def test_the_requests_that_hit_less_than_the_unbounded_cache_are_named():
    row = {
        "tokens": {
            "local_compute": 700.0,
            "local_cache_hit": 200.0,
            "external_kv_transfer": 100.0,
        },
        "outcomes": [
            {"index": 0, "turn": 1, "cached_tokens": None},
            {"index": 1, "turn": 2, "cached_tokens": 128},
            {"index": 2, "turn": 3, "cached_tokens": 512},
            {"index": 3, "turn": 2, "cached_tokens": 0, "error": "HTTP 500"},
            {"index": 4, "turn": 2, "cached_tokens": 384},
        ],
    }
    unbounded = {
        "prompt_tokens": 1000,
        "hit_tokens": 400,
        "per_request": [0, 512, 384, 256, 512],
    }
    add_reuse(row, unbounded)
    assert row["short_of_unbounded"] == {
        "requests": 2,
        "tokens": 512,
        "largest": [
            {"index": 1, "turn": 2, "tokens": 384},
            {"index": 4, "turn": 2, "tokens": 128},
        ],
    }


def snap(computed: float, hits: float = 0.0) -> dict:
    return {
        "tokens": {
            "local_compute": computed,
            "local_cache_hit": hits,
            "external_kv_transfer": 0.0,
        },
        "decisions": dict.fromkeys(PUSH_REASONS, 0.0),
        "push_ok": 0,
        "push_failed": 0,
    }


def test_each_instances_share_of_the_prefill_is_kept_beside_the_total():
    before = {"a": snap(100.0), "b": snap(50.0)}
    after = {"a": snap(400.0, hits=30.0), "b": snap(150.0)}
    diff = grown(before, after)
    assert diff["tokens"]["local_compute"] == 400.0
    assert diff["computed_by_instance"] == {"a": 300.0, "b": 100.0}
    row = {"outcomes": [], "decisions": diff["decisions"]} | {
        "computed_by_instance": diff["computed_by_instance"]
    }
    assert where_the_time_goes(row).endswith("prefill computed by a 75%, b 25%")


def test_the_same_latencies_are_within_the_noise():
    ttfts = [0.1 * (i % 17) + 0.01 * i for i in range(40)]
    d, lo, hi = ttft_difference(arm(ttfts), arm(list(reversed(ttfts))))
    assert d == 0 and lo <= 0 <= hi


def test_latencies_all_a_second_longer_are_outside_it():
    ttfts = [0.1 * (i % 17) for i in range(40)]
    d, lo, hi = ttft_difference(arm([t + 1.0 for t in ttfts]), arm(ttfts))
    assert d == pytest.approx(1.0) and lo > 0


def pd_row(name, ttfts, share=0.8, prefill=None):
    return {
        "arm": name,
        "requests": len(ttfts),
        "errors": 0,
        "checks": [],
        "correct": True,
        "blocks_held_after": [0, 0],
        "ttft_p50_s": sorted(ttfts)[len(ttfts) // 2],
        "outcomes": [
            {"ttft_s": t, "prefill_s": None if prefill is None else prefill[i]}
            for i, t in enumerate(ttfts)
        ],
        "pd": {
            "transfers": {
                "share_before_prefill_end": share,
                "layerwise": len(ttfts),
                "destination_after_prefill": 0,
            },
            "prefill_p50_s": 0.1,
        },
    }


def pd_target(rows):
    return next(t for t in targets(rows) if t["target"].startswith("P/D"))


def test_pd_layerwise_is_below_posthoc_only_when_the_whole_interval_is():
    ttfts = [0.2 + 0.01 * (i % 13) for i in range(40)]
    faster = pd_target(
        {
            "pd-layerwise": pd_row("pd-layerwise", [t - 0.1 for t in ttfts]),
            "pd-posthoc": pd_row("pd-posthoc", ttfts),
        }
    )
    assert faster["met"] and "80%" in faster["why"]
    same = pd_target(
        {
            "pd-layerwise": pd_row("pd-layerwise", ttfts),
            "pd-posthoc": pd_row("pd-posthoc", list(reversed(ttfts))),
        }
    )
    assert not same["met"]


def test_pd_the_transfers_part_of_ttft_is_told_apart_from_ps_queue():
    """Under load P's queue spreads TTFT over seconds: layer-wise's shorter wait
    after P's answer is judged on that wait alone."""
    queue = [1.0 * (i % 40) for i in range(40)]  # P's answers 0-39 s after the send
    behind = list(reversed(queue))

    def judged(lw_after, post_after):
        rows = {
            "pd-layerwise": pd_row(
                "pd-layerwise", [p + lw_after for p in queue], prefill=queue
            ),
            "pd-posthoc": pd_row(
                "pd-posthoc", [p + post_after for p in behind], prefill=behind
            ),
        }
        return {t["target"]: t for t in targets(rows)}

    after = "P/D: D's first token after P's answer, layer-wise p50 below post-hoc's"
    got = judged(0.05, 0.8)
    assert not got["P/D layer-wise TTFT p50 below post-hoc's"]["met"]  # the queue
    assert got[after]["met"] and got[after]["value"].startswith("-750 ms")
    assert not judged(0.8, 0.8)[after]["met"]


class Stub:
    """An OpenAI-style completion endpoint on 127.0.0.1 that records the bodies it
    gets; streams when asked; answers HTTP ``status``."""

    def __init__(self, status=200, delay_s=0.0):
        self.bodies: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                stub.bodies.append(body)
                time.sleep(delay_s)
                self.send_response(status)
                self.end_headers()
                if status != 200:
                    self.wfile.write(b"refused")
                elif body.get("stream"):
                    for chunk in (
                        {"choices": [{"text": "a", "token_ids": [7]}]},
                        {"choices": [{"text": "b", "token_ids": [8]}]},
                        {
                            "choices": [],
                            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                        },
                    ):
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                else:
                    self.wfile.write(json.dumps({"choices": [{"text": "a"}]}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs():
    made: list[Stub] = []
    yield lambda status=200, delay_s=0.0: made.append(Stub(status, delay_s)) or made[-1]
    for s in made:
        s.close()


def requests(n):
    return [TraceRequest(float(10 * i), 3, 2, (i,)) for i in range(n)]


def test_a_pd_request_goes_to_p_and_d_at_once_with_each_ones_params(stubs):
    p, d = stubs(), stubs()
    out = replay(
        lambda i: d.url,
        "m",
        requests(2),
        [[1, 2, 3], [4, 5, 6]],
        deadline_s=10,
        prefill=lambda i: (p.url, {"side": "p", "i": i}, {"side": "d", "i": i}),
    )
    assert [o.error for o in out] == [None, None]
    assert all(o.ttft_s is not None and o.prefill_s is not None for o in out)
    assert sorted(b["kv_transfer_params"]["i"] for b in p.bodies) == [0, 1]
    for b in p.bodies:  # P: one token, not streamed, its own params
        assert b["max_tokens"] == 1 and "stream" not in b
        assert b["kv_transfer_params"]["side"] == "p"
    for b in d.bodies:  # D: streamed, the request's output, D's params
        assert b["stream"] and b["max_tokens"] == 2
        assert b["kv_transfer_params"]["side"] == "d"
        assert (
            b["prompt"] == p.bodies[0]["prompt"] or b["prompt"] == p.bodies[1]["prompt"]
        )


def test_a_pd_request_whose_p_fails_is_an_error_though_d_answered(stubs):
    p, d = stubs(500), stubs()
    out = replay(
        lambda i: d.url,
        "m",
        requests(1),
        [[1, 2, 3]],
        deadline_s=10,
        prefill=lambda i: (p.url, {}, {}),
    )
    assert out[0].error and "P: HTTP 500" in out[0].error


def test_a_turn_is_sent_only_once_its_previous_turn_has_answered(stubs):
    slow, fast = stubs(delay_s=0.4), stubs()
    reqs = [TraceRequest(ms, 3, 2, (i,)) for i, ms in enumerate((0.0, 50.0, 100.0))]
    out = replay(
        lambda i: slow.url if i == 0 else fast.url,
        "m",
        reqs,
        [[1, 2, 3]] * 3,
        deadline_s=10,
        after=[None, None, 0],  # request 2 is request 0's next turn
    )
    assert [o.error for o in out] == [None, None, None]
    first, other, next_turn = out
    assert next_turn.sent_at_s >= first.sent_at_s + first.e2e_s
    assert 0.2 < next_turn.held_s < 1.0 and next_turn.late_s < 0.1
    assert other.held_s == 0.0 and other.sent_at_s < 0.2  # another session: on time


def test_requests_of_no_session_are_sent_on_the_clock_alone(stubs):
    slow = stubs(delay_s=0.4)
    out = replay(
        lambda i: slow.url,
        "m",
        [TraceRequest(0.0, 3, 2, ()) for _ in range(3)],  # a burst of forks
        [[1, 2, 3]] * 3,
        deadline_s=10,
    )
    assert [o.error for o in out] == [None, None, None]
    assert max(o.sent_at_s for o in out) < 0.2 and all(o.held_s == 0 for o in out)


def test_a_failed_turn_releases_the_next_one(stubs):
    broken, fine = stubs(500, delay_s=0.2), stubs()
    out = replay(
        lambda i: broken.url if i == 0 else fine.url,
        "m",
        [TraceRequest(0.0, 3, 2, (1,)), TraceRequest(10.0, 3, 2, (1,))],
        [[1, 2, 3]] * 2,
        deadline_s=10,
        after=[None, 0],
    )
    assert "HTTP 500" in out[0].error and out[1].error is None
    assert out[1].held_s > 0.1


def test_a_turn_cannot_follow_a_later_one():
    with pytest.raises(ValueError, match="request 0 cannot follow request 1"):
        replay(
            lambda i: "http://127.0.0.1:9",
            "m",
            requests(2),
            [[1], [2]],
            deadline_s=1,
            after=[1, None],
        )


def curve_row(p90, *, errors=0, reuse=1.0, spread=0.0):
    ttfts = [p90 - spread * (i % 5) for i in range(40)]
    return {
        "ttft_p90_s": p90,
        "ttft_p90_cold": p90,  # in cold prefills: the SLO is given in the same unit
        "errors": errors,
        "reuse_of_unbounded": reuse,
        "outcomes": [{"ttft_s": t} for t in ttfts],
    }


def by_name(targets_):
    return {t["target"].split(" (")[0].split(" >=")[0]: t for t in targets_}


def test_the_load_curve_gives_goodput_per_arm_and_its_targets():
    from microbench.sessions.__main__ import curve_targets

    slo = 5.0
    by_load = {
        2: {
            "sticky": curve_row(2.0),
            "rr": curve_row(3.0),
            "rr+push": curve_row(2.0),
        },
        4: {
            "sticky": curve_row(4.0),
            "rr": curve_row(9.0),  # round robin saturates first
            "rr+push": curve_row(3.0),
        },
        8: {
            "sticky": curve_row(20.0),
            "rr": curve_row(30.0),
            "rr+push": curve_row(4.5, reuse=0.9),
        },
    }
    met, gp = curve_targets(by_load, slo)
    assert gp == {"sticky": 4, "rr": 2, "rr+push": 8}
    got = {t["target"]: t["met"] for t in met}
    assert got["goodput of the best push arm (rr+push) >= 1.5x round robin's"]
    assert got["goodput of the best push arm (rr+push) >= session-sticky's"]
    assert got["at sticky's goodput (4/min) the best push arm's TTFT p90 <= sticky's"]
    assert got["rr+push TTFT p90 <= rr's at every load, beyond the run's noise"]
    # reuse fell to 90% at the heaviest load
    assert not got["rr+push: reuse >= 95% of the unbounded cache's at every load"]


def test_a_goodput_kept_at_the_heaviest_load_is_a_lower_bound():
    """Every arm kept the SLO at every load: the goodput is at least the heaviest
    load, and the 1.5x target says the knee was not reached, not that push lost."""
    from microbench.sessions.__main__ import curve_targets

    by_load = {
        x: {"rr": curve_row(1.0), "rr+push": curve_row(1.0), "sticky": curve_row(1.0)}
        for x in (6, 12)
    }
    met, gp = curve_targets(by_load, 3.0)
    assert gp == {"sticky": 12, "rr": 12, "rr+push": 12}
    [t] = [t for t in met if "1.5x round robin" in t["target"]]
    assert not t["met"]
    assert t["value"].startswith(">=12 / >=12 sessions/min (both kept the SLO")


def test_a_push_arm_worse_than_its_policy_at_one_load_misses_its_target():
    from microbench.sessions.__main__ import curve_targets

    by_load = {
        2: {"rr": curve_row(1.0, spread=0.01), "rr+push": curve_row(1.0, spread=0.01)},
        4: {"rr": curve_row(1.0, spread=0.01), "rr+push": curve_row(3.0, spread=0.01)},
    }
    met, _ = curve_targets(by_load, 10.0)
    [t] = [t for t in met if t["target"].startswith("rr+push TTFT p90")]
    assert not t["met"] and t["value"].startswith("4/min")


def test_each_load_spaces_the_same_sessions_further_apart_or_closer():
    import argparse

    from microbench.sessions import trace
    from microbench.sessions.__main__ import workload

    raw = [
        TraceRequest(0, 1100, 40, (1, 2, 3), "s1"),
        TraceRequest(60_000, 1600, 40, (1, 2, 3, 4), "s1"),
        TraceRequest(1_000, 900, 40, (7, 8), "s2"),
    ]
    args = argparse.Namespace(
        gap_scale=0.1,
        max_gap_s=100.0,
        id_tokens=512,
        source_block_tokens=512,
        output_divisor=1.0,
        max_output=32,
        samples=4,
    )
    builder = trace.PromptBuilder(512, 1000)
    light, heavy = workload(raw, 2, args, builder), workload(raw, 6, args, builder)
    assert [r.timestamp_ms for r in light["reqs"]] == [0, 6_000, 30_000]
    assert [r.timestamp_ms for r in heavy["reqs"]] == [0, 6_000, 10_000]
    # the same prompts at every load: only the clock changes
    assert sorted(map(len, light["prompts"])) == sorted(map(len, heavy["prompts"]))
    assert light["sampled"] == {1} and light["unbounded"]["hit_tokens"] == 1024


def test_a_figure_names_its_machine_commit_and_run():
    from microbench.common import provenance

    machine = {"cores": 2, "model_name": "AMD EPYC 7B13", "avx512": False}
    assert provenance(machine, {"commit": "5c843bc", "changed": False}, "20261204") == (
        "2-core AMD EPYC 7B13, no AVX-512; commit 5c843bc; run 20261204"
    )
    title = provenance({"cores": 2}, {"commit": "abc1234", "changed": True}, "r")
    assert title == "2-core ?; commit abc1234 with changes; run r"
