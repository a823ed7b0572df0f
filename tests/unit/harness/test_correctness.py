"""harness/correctness.py: the comparison goes red on every kind of difference."""

from harness.correctness import compare
from harness.pd_client import Completion


def completion(token_ids, top, cached=99):
    return Completion(
        token_ids=list(token_ids),
        logprobs=[dict(t) for t in top],
        token_logprobs=[max(t.values()) for t in top],
        prompt_tokens=100,
        cached_tokens=cached,
        kv_transfer_params=None,
        latency_s=0.0,
    )


REF_TOP = [{"w1": -1.0, "w2": -2.0}, {"w1": -1.5, "w3": -2.5}]


def test_identical_results_pass():
    ref = completion([5, 5], REF_TOP)
    got = completion(
        [5, 5], [{"w1": -1.0 + 1e-6, "w2": -2.0}, {"w1": -1.5, "w3": -2.5}]
    )
    r = compare(got, ref, expected_cached_tokens=99)
    assert r.ok, r.problems
    assert r.compared_tokens == 2


def test_logprob_drift_fails_even_with_equal_tokens():
    ref = completion([5, 5], REF_TOP)
    got = completion([5, 5], [{"w1": -1.05, "w2": -2.0}, {"w1": -1.5, "w3": -2.5}])
    r = compare(got, ref, expected_cached_tokens=99)
    assert not r.ok
    assert any("logprobs differ" in p for p in r.problems)


def test_topk_set_change_fails():
    ref = completion([5, 5], REF_TOP)
    got = completion([5, 5], [{"w1": -1.0, "w9": -2.0}, {"w1": -1.5, "w3": -2.5}])
    assert not compare(got, ref, expected_cached_tokens=99).ok


def test_cached_tokens_mismatch_fails():
    ref = completion([5, 5], REF_TOP)
    got = completion([5, 5], REF_TOP, cached=0)
    r = compare(got, ref, expected_cached_tokens=99)
    assert not r.ok
    assert any("cached tokens" in p for p in r.problems)


def test_missing_logprobs_fail():
    ref = completion([5, 5], REF_TOP)
    got = completion([5, 5], [])
    assert not compare(got, ref, expected_cached_tokens=None).ok
