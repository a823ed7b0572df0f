"""mb7's concurrency sweep: percentiles, rounds, and the per-level rows."""

from microbench.mb7.concurrency import (
    level_rows,
    percentile,
    rounds_for,
    table_lines,
)


def test_nearest_rank_percentile():
    xs = [float(x) for x in range(1, 11)]
    assert percentile(xs, 50) == 5.0 and percentile(xs, 90) == 9.0
    assert percentile(xs, 100) == 10.0 and percentile([None, 3.0], 90) == 3.0
    assert percentile([], 50) is None


def test_every_level_runs_at_least_eight_requests():
    assert [rounds_for(n) for n in (1, 3, 4, 8, 16)] == [8, 3, 2, 1, 1]


def _s(mode, kv, tail, p_lat, first, last, nbytes, wait, error=None):
    return {
        "level": 4,
        "mode": mode,
        "kv_tokens": kv,
        "error": error,
        "tail_s": tail,
        "client_tail_s": tail,
        "p_latency_s": p_lat,
        "cached_ok": True,
        "queue_wait_max_s": wait,
        "timeline": {
            "first_write_start": first,
            "last_write_end": last,
            "bytes_written": nbytes,
        },
    }


def test_a_level_row_aggregates_its_requests():
    samples = [
        _s("layerwise", 512, 0.1, 1.1, 10.0, 10.5, 100, 0.0),
        _s("layerwise", 1024, 0.2, 1.3, 10.2, 11.0, 300, 0.05),
        _s("layerwise", 512, None, None, None, None, 0, None, error="boom"),
        _s("posthoc", 512, 0.4, 1.0, 20.0, 20.2, 100, 0.0),
        _s("posthoc", 1024, 0.6, 1.0, 20.1, 20.4, 300, 0.1),
    ]
    held = [
        {"level": 4, "mode": "layerwise", "p_usage": 0.0, "d_usage": 0.0},
        {"level": 4, "mode": "posthoc", "p_usage": 0.0, "d_usage": 0.01},
    ]
    rows = level_rows(samples, held, {512: 0.05, 1024: 0.1}, {512: 1e9, 1024: 2e9})
    lw, ph = rows
    assert lw["requests"] == 3 and lw["errors"] == ["boom"]
    assert lw["tail_s"]["p50"] == 0.15000000000000002 and lw["tail_s"]["max"] == 0.2
    assert lw["tail_over_floor"]["max"] == 2.0 and lw["tail_over_floor"]["n"] == 2
    assert lw["bytes_per_s"] == 400 / 1.0  # one round: 10.0 .. 11.0
    assert lw["engine_layer_bytes_per_s"] == 1.5e9
    assert lw["queue_wait_s"]["max"] == 0.05
    assert abs(lw["prefill_slowdown_vs_posthoc"] - 0.2) < 1e-9  # 1.2 / 1.0 - 1
    assert "prefill_slowdown_vs_posthoc" not in ph
    assert ph["blocks_held_after"] == {"p": 0.0, "d": 0.01}
    lines = table_lines(rows)
    assert len(lines) == 4 and "D 1.0%" in lines[3]


def test_the_write_rate_counts_only_requests_in_flight_together():
    # two rounds 10 s apart, 100 bytes in 0.5 s each: 200 B/s, not 200 B / 10.5 s
    a = _s("posthoc", 512, 0.4, 1.0, 10.0, 10.5, 100, 0.0)
    b = {**_s("posthoc", 512, 0.4, 1.0, 20.0, 20.5, 100, 0.0), "round": 1}
    (row,) = level_rows([{**a, "round": 0}, b], [], {}, {})
    assert row["bytes_per_s"] == 200.0


def test_ds_admission_wait_and_the_whole_request_are_reported():
    waited = {
        **_s("layerwise", 512, 0.1, 1.0, 10.0, 10.5, 100, 0.0),
        "d_timeline": {"queued": 100.0, "allocated": 103.5},
        "total_s": 5.0,
    }
    at_once = {
        **_s("layerwise", 512, 0.1, 1.0, 10.0, 10.5, 100, 0.0),
        "d_timeline": {"queued": None, "allocated": 100.0},
        "total_s": 1.0,
    }
    (row,) = level_rows([waited, at_once], [], {}, {})
    assert row["admission_wait_s"]["max"] == 3.5 and row["admission_wait_s"]["n"] == 2
    assert row["total_s"]["max"] == 5.0
    assert "3.5/3.5" in table_lines([row])[2]


class _Instance:
    def __init__(self, name):
        self.url = f"http://{name}"
        self.bootstrap_url = f"http://{name}-bootstrap"


def _sent(monkeypatch):
    """Stand-in for pd_generate: records (P's URL, prompt length) of each request."""
    from types import SimpleNamespace

    from microbench.mb7 import concurrency

    sent = []

    def fake_pd_generate(p_url, p_bootstrap_url, d_url, prompt, **kw):
        sent.append((p_url, len(prompt)))
        done = SimpleNamespace(
            latency_s=1.0, kv_transfer_params={}, cached_tokens=len(prompt) - 1
        )
        return SimpleNamespace(
            prefill=done,
            decode=done,
            transfer_id=f"t{len(sent)}",
            total_s=1.1,
            started_monotonic=0.0,
        )

    monkeypatch.setattr(concurrency, "pd_generate", fake_pd_generate)
    monkeypatch.setattr(concurrency, "transfer_timelines", lambda url: {})
    monkeypatch.setattr(
        concurrency,
        "wait_no_blocks_in_use",
        lambda *urls, **kw: tuple(0.0 for _ in urls),
    )
    return sent


def test_prompt_lengths_mix_at_every_level_one_included(monkeypatch):
    from microbench.mb7.concurrency import sweep

    sent = _sent(monkeypatch)
    samples, _ = sweep(
        [_Instance("p")],
        _Instance("d"),
        [1],
        ("layerwise",),
        [512, 1024],
        lambda n: [7] * n,
        10,
        lambda m: None,
    )
    assert sorted({n for _, n in sent}) == [513, 1025], (
        "level 1 sent one prompt length only: its rounds each restarted the mix"
    )
    assert len(samples) == 8


def test_two_prefills_write_into_one_decode_at_once(monkeypatch):
    from microbench.mb7.concurrency import sweep

    sent = _sent(monkeypatch)
    samples, held = sweep(
        [_Instance("p1"), _Instance("p2")],
        _Instance("d"),
        [4],
        ("layerwise", "posthoc"),
        [512, 1024],
        lambda n: [7] * n,
        10,
        lambda m: None,
    )
    by_p = {url: sum(1 for u, _ in sent if u == url) for url, _ in sent}
    assert by_p == {"http://p1": 8, "http://p2": 8}
    assert {s["prefills"] for s in samples} == {2}
    assert {(h["prefills"], h["level"]) for h in held} == {(2, 4)}
    rows = level_rows(samples, held, {}, {})
    assert [(r["prefills"], r["level"], r["mode"]) for r in rows] == [
        (2, 4, "layerwise"),
        (2, 4, "posthoc"),
    ]
    assert all(r["requests"] == 8 and not r["errors"] for r in rows)
    assert table_lines(rows)[2].split()[:2] == ["2", "4"]
