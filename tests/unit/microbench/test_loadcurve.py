"""The latency-load curve's arithmetic (microbench/loadcurve.py) and a fork
burst's accounting (microbench/fork/accounting.py)."""

import pytest

from microbench.fork.accounting import burst_accounting
from microbench.loadcurve import (
    SLO_COLD_PREFILLS,
    ColdPrefill,
    goodput,
    offered_loads,
    parse_loads,
    quantile,
    ttft_in_cold_prefills,
    within,
)


def test_offered_loads_are_a_geometric_series_from_light_to_heavy():
    assert offered_loads(2, 16, 4) == [2.0, 4.0, 8.0, 16.0]
    assert offered_loads(3, 3, 1) == [3.0]
    for bad in [(0, 4, 3), (4, 2, 3), (1, 4, 0)]:
        with pytest.raises(ValueError):
            offered_loads(*bad)


def test_parse_loads_sorts_and_refuses_what_is_not_a_load():
    assert parse_loads("8,2,4,2") == [2.0, 4.0, 8.0]
    for bad in ["", "0,2", "-1", "a,b", "inf"]:
        with pytest.raises(ValueError):
            parse_loads(bad)


def test_quantile_is_the_nearest_rank_of_the_answered():
    assert quantile([None, 3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile(list(range(11)), 0.9) == 9
    assert quantile([None], 0.9) is None


def test_an_idle_cold_prefill_grows_with_its_length_as_measured():
    """Fitted to two measured lengths: n (a + b n) passes through both."""
    cold = ColdPrefill.fit([(8000, 0.64), (29000, 4.0)])
    assert cold.seconds(8000) == pytest.approx(0.64)
    assert cold.seconds(29000) == pytest.approx(4.0)
    assert cold.b > 0
    assert ColdPrefill.fit([(1000, 1.0)]) == ColdPrefill(0.001)  # one length
    # a longer prompt never measured cheaper per token
    assert ColdPrefill.fit([(1000, 1.0), (2000, 1.0)]).b == 0.0
    with pytest.raises(ValueError):
        ColdPrefill.fit([(0, 1.0)])


def test_the_slo_counts_each_request_in_cold_prefills_of_its_own_prompt():
    """A 30k-token cold turn that took its idle time and a cached 8k turn both
    keep a 3x SLO; a request that waited is counted late; one with no answer
    infinitely late."""
    cold = ColdPrefill(0.0001)  # 0.1 ms a token
    idle = [
        {"ttft_s": 3.0, "prompt_len": 30_000},  # 1 cold prefill
        {"ttft_s": 0.2, "prompt_len": 8_000},  # 0.25
    ]
    assert ttft_in_cold_prefills(idle, cold) == pytest.approx(1.0)
    waited = idle + [{"ttft_s": 4.0, "prompt_len": 8_000}]  # 5 cold prefills
    assert ttft_in_cold_prefills(waited, cold) == pytest.approx(5.0)
    assert not within(ttft_in_cold_prefills(waited, cold), SLO_COLD_PREFILLS)
    failed = idle + [{"ttft_s": None, "prompt_len": 8_000, "error": "HTTP 500"}]
    assert ttft_in_cold_prefills(failed, cold) == float("inf")
    assert ttft_in_cold_prefills([], cold) is None
    # 90%: one late request in ten is allowed
    ten = [{"ttft_s": 0.1, "prompt_len": 1000}] * 9 + [
        {"ttft_s": 10.0, "prompt_len": 1000}
    ]
    assert ttft_in_cold_prefills(ten, cold) == pytest.approx(1.0)


def test_goodput_is_the_highest_load_up_to_which_every_load_keeps_the_slo():
    slo = 1.0
    assert goodput([(4, 0.9, 0), (2, 0.5, 0), (8, 1.5, 0)], slo) == 4
    # a heavier load back under the SLO after a miss does not count (noise)
    assert goodput([(2, 0.5, 0), (4, 1.2, 0), (8, 0.9, 0)], slo) == 2
    # errors, or no answer at all, miss it whatever the latency
    assert goodput([(2, 0.5, 0), (4, 0.5, 1)], slo) == 2
    assert goodput([(2, None, 0)], slo) == 0
    assert goodput([(2, 2.0, 0), (4, 0.1, 0)], slo) == 0


def test_a_fork_burst_counts_contexts_computed_away_and_bytes_per_destination():
    kvt = 1000  # KV bytes per token
    ctx = 1024
    z = dict.fromkeys(("local_compute", "local_cache_hit", "external_kv_transfer"), 0)
    before = {"a": dict(z), "b": dict(z), "c": dict(z)}
    after = {
        # the holder: the forks' own tokens computed, the context hit
        "a": {"local_compute": 300, "local_cache_hit": 2048, "external_kv_transfer": 0},
        # b: one push of the context, the other fork took it from b's cache
        "b": {
            "local_compute": 300,
            "local_cache_hit": 1024,
            "external_kv_transfer": 1024,
        },
        # c: computed the context twice (two forks at once)
        "c": {
            "local_compute": 2 * ctx + 300,
            "local_cache_hit": 0,
            "external_kv_transfer": 0,
        },
    }
    got = burst_accounting(
        before,
        after,
        {"b:1": 5 * ctx * kvt},  # an earlier burst's bytes
        {"b:1": 6 * ctx * kvt, "d:1": 1.5 * ctx * kvt, "e:1": 0},
        holder="a",
        context_tokens=ctx,
        kv_bytes_per_token=kvt,
    )
    assert got["contexts_computed_away"] == pytest.approx((300 + 2 * ctx + 300) / ctx)
    assert got["computed_tokens"] == 300 + 300 + 2 * ctx + 300
    assert got["bytes_ratio_by_destination"] == {"b:1": 1.0, "d:1": 1.5}
    assert got["bytes_ratio_max"] == 1.5 and not got["bytes_ok"]
    assert got["instances"]["b"]["external_kv_transfer"] == 1024


def test_throughput_counts_what_was_answered_over_the_replay_span():
    from microbench.loadcurve import throughput

    outcomes = [
        {"sent_at_s": 0.0, "e2e_s": 2.0, "prompt_tokens": 100, "output_tokens": 10},
        {"sent_at_s": 1.0, "e2e_s": 3.0, "prompt_tokens": 300, "output_tokens": 30},
        {"sent_at_s": 2.0, "e2e_s": None, "error": "HTTP 500"},
    ]
    got = throughput(outcomes)
    assert got["span_s"] == 4.0
    assert got["requests_per_s"] == 0.5
    assert got["prompt_tokens_per_s"] == 100.0 and got["output_tokens_per_s"] == 10.0
    assert got["in_flight_mean"] == 1.25  # (2 + 3) s of requests over 4 s
    assert throughput([{"sent_at_s": 0.0, "error": "x"}])["requests_per_s"] == 0.0
