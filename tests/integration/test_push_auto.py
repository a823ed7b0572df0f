"""Prefix push with ``push_from: "auto"``: D finds the holder itself.

C serves a prompt; D, asked for the same prompt with ``{"push_from": "auto"}``
and nothing naming C, picks C from its index of the allowed sources' feeds
(POST /hashsync/feed on each source's bootstrap server, followed by D's
scheduler) and C pushes the held blocks: D's cached tokens cover them and its
answer matches a from-scratch reference. Without push_from D prefills locally
(the feature off). A prompt no source holds is prefilled locally without a
single /match_blocks call to any source. D's other allowed sources are an
instance of another block size (never indexed), an address where nothing
listens and this process's test source (404): D's feed threads keep failing on
them with backoff and nothing of that reaches a request.
"""

from __future__ import annotations

import time

import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK
from harness.pd_client import complete, push_stats, wait_for_matched_blocks
from harness.prompts import random_prompt as prompt
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_index import (
    FEED_BACKOFF_MAX_S,
)

pytestmark = pytest.mark.integration

AUTO = {"push_from": "auto"}
# D's feed threads start with the first request that asks for "auto" and ask a
# source that has not run a step yet again every few seconds (FEED_BACKOFF_MAX_S);
# then a snapshot of its mirror arrives within one round trip (long poll)
INDEX_FILLS_S = FEED_BACKOFF_MAX_S + 2


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    cl = shared_cluster("push")
    c, d = cl["c"], cl["d"]
    on_c(c, prompt(2 * BLOCK + 3, seed=5899))  # C has run a step: its feed serves
    assert "MOONCAKE_PUSH_AUTO" not in d.spec.env  # auto only where a request asks
    # D starts following the feeds: this first request finds no holder yet
    got = complete(
        d.url,
        prompt(2 * BLOCK + 3, seed=5900),
        max_tokens=1,
        timeout=300,
        kv_transfer_params=AUTO,
    )
    assert not got.cached_tokens
    time.sleep(INDEX_FILLS_S)
    return cl


def on_c(c, ids):
    complete(c.url, ids, max_tokens=1, logprobs=None, timeout=300)
    r = wait_for_matched_blocks(c.bootstrap_url, ids, len(ids) // BLOCK)
    assert r["matched_blocks"] == len(ids) // BLOCK, r


def ask_d(d, ids, params):
    return complete(
        d.url, ids, max_tokens=4, logprobs=5, timeout=300, kv_transfer_params=params
    )


def test_auto_pushes_from_the_instance_that_holds_the_prefix(cluster):
    c, d = cluster["c"], cluster["d"]
    ids = prompt(8 * BLOCK + 37, seed=5901)
    on_c(c, ids)
    time.sleep(1.0)  # C's new blocks reach D's index (a long poll answers at once)
    before = push_stats(c.bootstrap_url)
    got = ask_d(d, ids, AUTO)
    check = compare(
        got,
        reference_completion(c.url, ids, max_tokens=4),
        expected_cached_tokens=8 * BLOCK,
    )
    assert check.ok, check.problems
    after = push_stats(c.bootstrap_url)
    assert after["ok"] == before["ok"] + 1, (before, after)
    assert after["matches"] == before["matches"] + 1, (before, after)
    assert wait_no_blocks_in_use(c.url, d.url) == (0.0, 0.0)


def test_without_push_from_nothing_is_pushed(cluster):
    """The feature off: the same situation, no push_from, a local prefill."""
    c, d = cluster["c"], cluster["d"]
    ids = prompt(6 * BLOCK + 11, seed=5902)
    on_c(c, ids)
    time.sleep(1.0)
    before = push_stats(c.bootstrap_url)
    got = ask_d(d, ids, None)
    assert not got.cached_tokens, got.cached_tokens
    after = push_stats(c.bootstrap_url)
    assert (after["matches"], after["pushes"]) == (before["matches"], before["pushes"])


def test_a_prefix_no_source_holds_costs_no_call(cluster):
    c, d = cluster["c"], cluster["d"]
    ids = prompt(5 * BLOCK + 2, seed=5903)  # never sent to C
    before = push_stats(c.bootstrap_url)
    got = ask_d(d, ids, AUTO)
    assert not got.cached_tokens, got.cached_tokens
    check = compare(
        got, reference_completion(c.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, check.problems
    assert push_stats(c.bootstrap_url)["matches"] == before["matches"]
    log = d.log_text()
    assert "following the feeds of" in log
    # a source where nothing listens is asked again, and harms nothing
    assert "the feed of http://127.0.0.1:9 failed" in log
    assert wait_no_blocks_in_use(c.url, d.url) == (0.0, 0.0)
