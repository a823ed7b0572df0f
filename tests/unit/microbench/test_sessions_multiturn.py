"""microbench/sessions/multiturn.py: the text and conversations it gives vLLM's
multi-turn benchmark, the wrapper that keeps the benchmark's per-request figures
(run against a stand-in benchmark module), and the report's figures."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from harness.model import SPECIAL_TOKENS
from microbench.sessions import multiturn


def test_the_text_is_words_of_the_vocabulary_and_the_same_for_a_seed(tmp_path):
    one = multiturn.write_text(tmp_path / "a.txt", 100, 640, seed=1).read_text()
    two = multiturn.write_text(tmp_path / "b.txt", 100, 640, seed=1).read_text()
    other = multiturn.write_text(tmp_path / "c.txt", 100, 640, seed=2).read_text()
    words = one.split()
    assert one == two != other and len(words) == 640
    assert all(
        w[0] == "w" and 0 <= int(w[1:]) < 100 - len(SPECIAL_TOKENS) for w in words
    )


def test_the_conversations_follow_the_benchmarks_format(tmp_path):
    cfg = multiturn.conversations_config(
        tmp_path / "t.txt", 5, (6, 8), 512, (512, 1024), (128, 512), (16, 64)
    )
    assert cfg["filetype"] == "generate_conversations"
    assert cfg["num_conversations"] == 5
    p = cfg["prompt_input"]
    assert p["common_prefix_num_tokens"] == {"distribution": "constant", "value": 512}
    assert p["num_turns"] == {"distribution": "uniform", "min": 6, "max": 8}
    assert p["num_tokens"]["min"] == 128 and p["num_tokens"]["max"] == 512
    assert cfg["prompt_output"]["num_tokens"] == {
        "distribution": "uniform",
        "min": 16,
        "max": 64,
    }


STAND_IN = textwrap.dedent(
    """
    import collections, sys
    Stats = collections.namedtuple("Stats", "ttft_ms input_num_turns conversation_id")
    def generate_conversations(args, tokenizer):
        return {"c0": [{"role": "user"}, {"role": "assistant"}] * 2,
                "c1": [{"role": "user"}, {"role": "assistant"}]}
    def process_statistics(client_metrics, **kwargs):
        print("summary of", len(client_metrics), kwargs["verbose"])
    Response = collections.namedtuple("Response", "valid content")
    async def send_request(session, messages, url, model):
        return Response(len(messages) < 3, "answer %d" % len(messages))
    async def main():
        assert sys.argv[1:] == ["--url", "http://x"], sys.argv
        generate_conversations(None, None)
        msgs = [{"role": "user", "content": "hi"}]
        assert (await send_request(None, msgs, "u", "m")).content == "answer 1"
        msgs.append({"role": "assistant", "content": "a"})
        msgs.append({"role": "user", "content": "more"})
        await send_request(None, msgs, "u", "m")
        msgs[0]["content"] = "changed after the call"
        # the benchmark's clients are processes of their own
        import multiprocessing
        child = multiprocessing.get_context("fork").Process(target=client)
        child.start()
        child.join()
        process_statistics(
            [Stats(10.0, 1, "c0"), Stats(12.5, 3, "c0")], verbose=False
        )
    def client():
        import asyncio
        asyncio.run(send_request(None, [{"role": "user", "content": "child"}], "u", "m"))
    """
)


def test_the_runner_keeps_the_benchmarks_figures_and_its_summary(tmp_path):
    (tmp_path / "benchmark_serving_multi_turn.py").write_text(STAND_IN)
    runner = tmp_path / "runner.py"
    runner.write_text(multiturn.RUNNER)
    out = tmp_path / "requests.json"
    got = subprocess.run(
        [sys.executable, str(runner), str(tmp_path), str(out), "--url", "http://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 0, got.stderr
    assert "summary of 2 False" in got.stdout  # the benchmark's own report, unchanged
    import json

    assert json.loads(out.read_text()) == [
        {"ttft_ms": 10.0, "input_num_turns": 1, "conversation_id": "c0"},
        {"ttft_ms": 12.5, "input_num_turns": 3, "conversation_id": "c0"},
    ]
    assert json.loads((tmp_path / "requests.json.planned").read_text()) == {
        "c0": 2,
        "c1": 1,
    }
    # each request as it was sent and the answer it got (None: not valid)
    lines = (tmp_path / "requests.json.sent").read_text().splitlines()
    sent = [json.loads(line) for line in lines]
    assert [(s["messages"], s["answer"]) for s in sent] == [
        ([{"role": "user", "content": "hi"}], "answer 1"),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "more"},
            ],
            None,
        ),
        ([{"role": "user", "content": "child"}], "answer 1"),
    ]
    assert sent[0]["started"] <= sent[1]["started"] <= sent[2]["started"]


def metric(ttft, turns, conv="c0", start_ms=0.0):
    return {
        "ttft_ms": ttft,
        "tpot_ms": 5.0,
        "latency_ms": ttft + 100,
        "start_time_ms": start_ms,
        "input_num_turns": turns,
        "input_num_tokens": 1000 * turns,
        "output_num_tokens": 20,
        "conversation_id": conv,
    }


def diff(computed, hit=1000.0):
    return {
        "tokens": {
            "local_compute": computed,
            "local_cache_hit": hit,
            "external_kv_transfer": 0.0,
        },
        "decisions": {"pushed": 0.0},
        "push_ok": 0,
        "push_failed": 0,
    }


def test_a_request_that_did_not_end_fails_the_arms_target():
    ms = [metric(100 + i, 1 + 2 * (i % 3)) for i in range(30)]
    rows = {
        "rr": multiturn.row_of("rr", ms, 30, diff(4000.0), [0, 0]),
        "rr+push": multiturn.row_of("rr+push", ms[:29], 30, diff(1000.0), [0, 0]),
    }
    assert rows["rr+push"]["not_ended"] == 1
    assert rows["rr"]["reuse"] == 0.2 and rows["rr"]["ttft_later_p50_ms"] is not None
    got = {t["target"]: t["met"] for t in multiturn.targets(rows)}
    assert got["rr: every request ended, 0 blocks held"]
    assert not got["rr+push: every request ended, 0 blocks held"]


def test_reuse_is_judged_against_the_unbounded_cache_on_the_same_requests():
    ms = [metric(100 + i, 1 + 2 * (i % 3)) for i in range(30)]
    # 5,000 prompt tokens each arm; an unbounded cache would reuse 2,000 of them
    unbounded = {"prompt_tokens": 5000, "hit_tokens": 2000, "fraction": 0.4}
    rows = {
        "rr": multiturn.row_of("rr", ms, 30, diff(4000.0), [0, 0], unbounded),
        "rr+push": multiturn.row_of(
            "rr+push", ms, 30, diff(3100.0, 1900.0), [0, 0], unbounded
        ),
    }
    # rr recomputed 4,000 - 3,000 = 1,000 that a cache held; rr+push 100
    assert rows["rr"]["recomputed_tokens"] == 1000
    assert rows["rr+push"]["recomputed_tokens"] == 100
    assert rows["rr+push"]["reuse_of_unbounded"] == pytest.approx(1900 / 2000)
    got = {t["target"]: t["met"] for t in multiturn.targets(rows)}
    assert got["rr+push reuse >= 90% of the unbounded cache's"]
    assert got["rr+push recomputes >= 3x fewer prefill tokens than rr"]
    rows["rr+push"] = multiturn.row_of(
        "rr+push", ms, 30, diff(3500.0, 1500.0), [0, 0], unbounded
    )
    got = {t["target"]: t["met"] for t in multiturn.targets(rows)}
    assert not got["rr+push reuse >= 90% of the unbounded cache's"]
    assert not got["rr+push recomputes >= 3x fewer prefill tokens than rr"]


def test_a_sampled_answer_unlike_its_reference_fails_the_arms_target():
    ms = [metric(100 + i, 1 + 2 * (i % 3)) for i in range(30)]
    row = multiturn.row_of("rr+push", ms, 30, diff(1000.0), [0, 0])
    good = {"ok": True, "problems": [], "max_logprob_diff": 1e-6, "cached_tokens": 1024}
    bad = good | {"ok": False, "problems": ["token 0: top-k sets differ"]}
    name = "rr+push: sampled answers from the arm's cached KV match from-scratch"
    for checked, met in (([good, good], True), ([good, bad], False), ([], False)):
        row["checked"] = checked
        (t,) = [t for t in multiturn.targets({"rr+push": row}) if t["target"] == name]
        assert t["met"] is met, checked
        assert ("top-k sets differ" in t["why"]) is (bad in checked)


def test_the_client_counts_are_whole_numbers_in_increasing_order():
    assert multiturn.parse_clients("8,2,4,4") == [2, 4, 8]
    for bad in ("2.5", "0,2", "", "two"):
        with pytest.raises(ValueError):
            multiturn.parse_clients(bad)


def test_a_count_is_read_as_a_load_point():
    from microbench.loadcurve import ColdPrefill

    # 10 requests, one every second, each 2 s end to end: 2 in flight over 11 s
    ms = [metric(1000.0 * (1 + i % 2), 1, start_ms=1000.0 * i) for i in range(10)]
    for m in ms:
        m["latency_ms"] = 2000.0
    row = multiturn.row_of("rr", ms, 10, diff(4000.0), [0, 0], clients=4)
    multiturn.add_load_point(row, ColdPrefill(a=1e-3))  # 1,000 tokens: 1 s
    assert row["clients"] == 4
    assert row["requests_per_s"] == pytest.approx(10 / 11)
    assert row["in_flight_per_instance"] == pytest.approx(20 / 11 / 2)
    assert row["prompt_tokens_per_s"] == pytest.approx(10_000 / 11)
    # half the requests took 1 cold prefill, half 2: p90 (nearest rank) is 2
    assert row["ttft_p90_cold"] == pytest.approx(2.0)
    assert row["ttft_p90_s"] == pytest.approx(2.0)


def load_point(arm, clients, ttft_ms, ended=30, cold_p90=None):
    ms = [metric(ttft_ms + i, 1 + i % 3, start_ms=100.0 * i) for i in range(30)]
    row = multiturn.row_of(arm, ms[:ended], 30, diff(1000.0), [0, 0], clients=clients)
    row["ttft_p90_cold"] = cold_p90
    return row


def test_goodput_is_the_most_clients_every_count_up_to_kept_the_slo():
    by_clients = {
        2: {
            "rr": load_point("rr", 2, 500, cold_p90=1.0),
            "rr+push": load_point("rr+push", 2, 400, cold_p90=0.8),
        },
        4: {
            "rr": load_point("rr", 4, 900, cold_p90=3.5),
            "rr+push": load_point("rr+push", 4, 600, cold_p90=2.0),
        },
        8: {
            "rr": load_point("rr", 8, 1500, cold_p90=2.9),  # back under: not counted
            "rr+push": load_point("rr+push", 8, 800, ended=29, cold_p90=2.0),
        },
    }
    met, gp = multiturn.series_targets(by_clients, 3.0)
    # rr lost the SLO at 4; rr+push left a request unanswered at 8
    assert gp == {"rr": 2, "rr+push": 4}
    got = {t["target"]: t["met"] for t in met}
    assert got[
        "rr+push's goodput >= rr's (the most clients keeping TTFT p90 within "
        "3 idle cold prefills)"
    ]
    for c in (2, 4, 8):
        # push's TTFT is lower at every count, beyond any resampling
        assert got[
            f"at {c} clients: rr+push TTFT p90 not above rr's beyond the run's noise"
        ]
        assert got[f"at {c} clients: rr: every request ended, 0 blocks held"]
    assert not got["at 8 clients: rr+push: every request ended, 0 blocks held"]


def test_push_slower_at_one_count_fails_that_counts_p90_target():
    by_clients = {
        2: {"rr": load_point("rr", 2, 500), "rr+push": load_point("rr+push", 2, 400)},
        4: {"rr": load_point("rr", 4, 500), "rr+push": load_point("rr+push", 4, 900)},
    }
    met, _ = multiturn.series_targets(by_clients, 3.0)
    got = {t["target"]: t["met"] for t in met}
    name = "rr+push TTFT p90 not above rr's beyond the run's noise"
    assert got[f"at 2 clients: {name}"] and not got[f"at 4 clients: {name}"]


def test_main_runs_both_arms_at_each_count_and_reports_the_series(
    tmp_path, monkeypatch
):
    """The run's wiring, with each (arm, count) stood in for: both arms at one
    count before the next, the SLO from the first start's cold prefills, the
    goodput, the JSON and its figure."""
    import json
    from types import SimpleNamespace

    ran = []

    def stand_in(arm, env, clients, args, facts, work, run, warm):
        ran.append((arm, clients, env))
        slow = 1.0 if arm == "rr" else 0.7
        ms = [
            metric(400.0 * clients * slow + i, 1 + i % 3, start_ms=100.0 * i)
            for i in range(30)
        ]
        unbounded = {"prompt_tokens": 5000, "hit_tokens": 1000, "fraction": 0.2}
        row = multiturn.row_of(arm, ms, 30, diff(4000.0), [0, 0], unbounded, clients)
        good = {"ok": True, "problems": [], "max_logprob_diff": 0, "cached_tokens": 0}
        row["checked"] = [good]
        # the first start's: 1 s for 1,000 tokens
        return row, {1000: [1.0, 1.0], 4000: [4.0, 4.0]}

    monkeypatch.setattr(multiturn, "run_arm", stand_in)
    monkeypatch.setattr(multiturn.aiperf, "ensure", lambda: tmp_path / "bin/aiperf")
    monkeypatch.setattr(multiturn, "ensure_model", lambda shape: str(tmp_path))
    facts = {"vocab_size": 100, "layers": 8, "path": str(tmp_path), "dtype": "bf16"}
    monkeypatch.setattr(multiturn, "model_facts", lambda path: facts)
    monkeypatch.setattr(multiturn, "selected", lambda: SimpleNamespace(tree=tmp_path))
    out = tmp_path / "run.json"
    assert multiturn.main(["--clients", "4,2", "--out", str(out)]) == 0
    assert [(a, c) for a, c, _ in ran] == [
        ("rr", 2),
        ("rr+push", 2),
        ("rr", 4),
        ("rr+push", 4),
    ]
    assert [env for _, _, env in ran][1] == {"MOONCAKE_PUSH_AUTO": "1"}
    got = json.loads(out.read_text())
    assert [(r["arm"], r["clients"]) for r in got["rows"]] == [
        ("rr", 2),
        ("rr", 4),
        ("rr+push", 2),
        ("rr+push", 4),
    ]
    # TTFT p90 of turns of 1,000-3,000 tokens at 1 ms a token: rr at 4 clients
    # waits 1.6 s for a 1,000-token prompt (1.6 cold prefills); within 3 at both
    assert got["goodput_clients"] == {"rr": 4, "rr+push": 4}
    assert got["rows"][1]["ttft_p90_cold"] == pytest.approx(1.6, abs=0.05)
    assert out.with_suffix(".png").stat().st_size > 0
    assert got["code"]["commit"]
