"""microbench/sessions' report: the reuse accounting of an arm against the
unbounded cache, and the noise bound of the kv_aware comparison."""

from __future__ import annotations

import pytest

from microbench.sessions.__main__ import add_reuse, p90_difference


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


def test_the_same_latencies_are_within_the_noise():
    ttfts = [0.1 * (i % 17) + 0.01 * i for i in range(40)]
    d, lo, hi = p90_difference(arm(ttfts), arm(list(reversed(ttfts))))
    assert d == 0 and lo <= 0 <= hi


def test_latencies_all_a_second_longer_are_outside_it():
    ttfts = [0.1 * (i % 17) for i in range(40)]
    d, lo, hi = p90_difference(arm([t + 1.0 for t in ttfts]), arm(ttfts))
    assert d == pytest.approx(1.0) and lo > 0
