"""No byte after the end, with two real instances and the real Mooncake engine.

One cluster: P (kv_producer, also the push source C) and D (kv_consumer), both
with layer-wise push. D's KV cache is tiny (12 blocks of 128 tokens, 11 usable:
A 5 + B 4 + 2 free), so request N (5 blocks), sent after B ended, must take over
at least 3 of B's blocks. Writes of prompts of
DELAYED_LEN tokens are held back on P/C (MOONCAKE_FAULT_DELAY_WRITE: the engine
call returns, and its bytes land, DELAY_S seconds late).

Layer-wise: transfer A (DELAYED_LEN tokens) holds P's writer; transfer B is
queued behind it and times out on P (MOONCAKE_LAYERWISE_TIMEOUT_S); D fails B
and frees its blocks; request N on D takes them and is still decoding when A's
write returns. B's queued write must never run (it would land in N's KV).

Prefix push: D's push of a DELAYED_LEN-token turn 2 is still being written by C
past its budget (MOONCAKE_PUSH_TIMEOUT_S). D prefills turn 2 itself in other
blocks and keeps the ones C writes into until C answered; request N on D
meanwhile must decode from its own KV.

Every answer is checked with the KV-sensitive correctness check.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import kv_usage, wait_no_blocks_in_use
from harness.launcher import BLOCK
from harness.pd_client import (
    RequestFailed,
    bootstrap_headers,
    complete,
    model_name,
    pd_generate,
    wait_for_matched_blocks,
)
from harness.prompts import random_prompt as prompt

pytestmark = pytest.mark.integration

DELAYED_LEN = 600
D_BLOCKS = 12
DELAY_S = 12
P_TIMEOUT_S = 5
PUSH_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    return pd_cluster(
        kv_cache_gib=1,
        max_model_len=1024,
        env={
            "MOONCAKE_LAYERWISE": "1",
            "MOONCAKE_LAYERWISE_MIN_TOKENS": "256",
            "MOONCAKE_FAULT_DELAY_WRITE": f"{DELAYED_LEN}:{DELAY_S}",
            "MOONCAKE_LAYERWISE_TIMEOUT_S": str(P_TIMEOUT_S),
            "MOONCAKE_PUSH_TIMEOUT_S": str(PUSH_TIMEOUT_S),
            "MC_TRANSFER_TIMEOUT": "15",
            "MOONCAKE_PUSH_CLOCK_SKEW_S": "1",
            # every push held back DELAY_S: measured, the next would not be worth it
            "MOONCAKE_PUSH_POLICY": "always",
        },
        instances={
            "decode": {"extra_args": ["--num-gpu-blocks-override", str(D_BLOCKS)]}
        },
    )


def layerwise_stats(p) -> dict:
    r = httpx.get(
        p.bootstrap_url + "/layerwise/transfers",
        timeout=10,
        headers=bootstrap_headers(),
    )
    r.raise_for_status()
    return {t["transfer_id"]: t for t in r.json()["transfers"]}


def test_layerwise_write_of_a_timed_out_transfer_never_lands(cluster):
    p, d = cluster["prefill"], cluster["decode"]
    ids_a, ids_b = prompt(DELAYED_LEN, seed=9100), prompt(500, seed=9101)
    with cf.ThreadPoolExecutor(3) as pool:
        fa = pool.submit(
            pd_generate,
            p.url,
            p.bootstrap_url,
            d.url,
            ids_a,
            max_tokens=2,
            logprobs=5,
            timeout=120,
        )
        time.sleep(1.0)  # A's first write is inside the (delayed) engine call
        fb = pool.submit(
            pd_generate,
            p.url,
            p.bootstrap_url,
            d.url,
            ids_b,
            max_tokens=2,
            logprobs=5,
            timeout=120,
        )
        with pytest.raises(RequestFailed):
            fb.result(timeout=60)  # B timed out on P: D failed it and freed its blocks
        # N takes B's freed blocks on D and is still decoding when A's write returns
        # long enough to be still decoding when A's write returns (200 tokens ended
        # 1.5 s early on a fast run): + 500 generated, 8 blocks
        ids_n = prompt(400, seed=9102)
        n = complete(d.url, ids_n, max_tokens=500, logprobs=5, timeout=120)
        n_end = time.monotonic()  # CLOCK_MONOTONIC: comparable with P's timeline
        with pytest.raises(RequestFailed):
            fa.result(timeout=120)  # each of A's writes takes DELAY_S: A times out too
    stats = layerwise_stats(p)
    a = [t for t in stats.values() if t["prompt_len"] == DELAYED_LEN]
    b = [t for t in stats.values() if t["prompt_len"] == 500]
    assert len(a) == 1 and len(b) == 1, stats
    a, b = a[0], b[0]
    assert a["last_write_end"] is not None and n_end > a["last_write_end"], (
        "inconclusive: N ended before A's delayed write returned (when B's queued write "
        f"would have run): N {n_end:.1f}, A's write {a['last_write_end']}"
    )
    ref = reference_completion(d.url, ids_n, max_tokens=500)
    check = compare(n, ref, expected_cached_tokens=None)
    assert check.ok, (
        f"request N decoded from KV overwritten by a late write: {check.problems}"
    )
    assert b["outcome"] != "completed" and b["writes"] == 0, b
    assert b["writes_dropped"] >= 1, b
    # A's end was reported only after its in-flight write returned
    assert a["ended_at"] >= a["last_write_end"], a
    usage = wait_no_blocks_in_use(p.url, d.url, timeout=120)
    assert usage == (0.0, 0.0), f"KV blocks still allocated (P, D): {usage}"


def test_a_push_past_its_budget_is_prefilled_in_other_blocks_while_its_own_are_kept(
    cluster,
):
    """C's write of turn 2 is held back DELAY_S; the push's budget is
    PUSH_TIMEOUT_S. Past the budget D prefills turn 2 itself in other blocks,
    without waiting for C (before, it waited for C's answer: DELAY_S and more,
    up to the push's hold of minutes with a source that never answers), while
    the blocks C is writing into stay out of use until C's write returned."""
    c, d = cluster["prefill"], cluster["decode"]
    turn1 = prompt(DELAYED_LEN - 40, seed=9200)
    complete(c.url, turn1, max_tokens=1, timeout=120)  # C caches turn 1
    assert (
        wait_for_matched_blocks(c.bootstrap_url, turn1, len(turn1) // BLOCK)[
            "matched_blocks"
        ]
        == len(turn1) // BLOCK
    )
    turn2 = turn1 + prompt(40, seed=9201)
    assert len(turn2) == DELAYED_LEN
    started = time.monotonic()
    r1 = complete(
        d.url,
        turn2,
        max_tokens=2,
        logprobs=5,
        timeout=120,
        kv_transfer_params={"push_from": c.bootstrap_url},
    )
    took = time.monotonic() - started
    assert took < DELAY_S - 3, (
        f"turn 2 ended {took:.1f} s after it was sent: it waited for C's write "
        f"({DELAY_S} s) instead of being prefilled locally past the push's budget "
        f"({PUSH_TIMEOUT_S} s)"
    )
    # the blocks C is writing into are held (and turn 2's, until the push ended)
    held = kv_usage(d.url)
    assert held > 0, "D gave back the blocks C is still writing into"
    # N right away, in the 2 blocks left: it must be given none C writes into
    ids_n = prompt(150, seed=9202)
    n = complete(d.url, ids_n, max_tokens=100, logprobs=5, timeout=120)
    usage = wait_no_blocks_in_use(d.url, timeout=120)
    released = time.monotonic() - started
    assert usage == (0.0,), f"D still holds blocks: {usage}"
    assert released > DELAY_S - 1, (
        f"D gave the pushed blocks back {released:.1f} s after turn 2 was sent, "
        f"before C's write ({DELAY_S} s) could have returned"
    )
    check = compare(
        r1,
        reference_completion(d.url, turn2, max_tokens=2),
        expected_cached_tokens=None,
    )
    assert check.ok, check.problems
    check = compare(
        n,
        reference_completion(d.url, ids_n, max_tokens=100),
        expected_cached_tokens=None,
    )
    assert check.ok, (
        f"request N decoded from KV overwritten by a late push: {check.problems}"
    )
    usage = wait_no_blocks_in_use(c.url, d.url, timeout=120)
    assert usage == (0.0, 0.0), f"KV blocks still allocated (C, D): {usage}"


def test_aborted_push_releases_its_blocks_on_an_idle_instance(cluster):
    """The client gives up on a push request while C is still writing. D keeps the
    blocks while C may write, then frees them with no further request arriving:
    the engine keeps stepping while finished requests hold blocks, whatever the
    feature that holds them (here prefix push, not layer-wise)."""
    c, d = cluster["prefill"], cluster["decode"]
    turn1 = prompt(DELAYED_LEN - 40, seed=9300)
    complete(c.url, turn1, max_tokens=1, timeout=120)
    assert (
        wait_for_matched_blocks(c.bootstrap_url, turn1, len(turn1) // BLOCK)[
            "matched_blocks"
        ]
        == len(turn1) // BLOCK
    )
    turn2 = turn1 + prompt(40, seed=9301)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            d.url + "/v1/completions",
            timeout=PUSH_TIMEOUT_S - 1.0,  # within the push's budget
            json={
                "model": model_name(d.url),
                "prompt": turn2,
                "max_tokens": 2,
                "kv_transfer_params": {"push_from": c.bootstrap_url},
            },
        )
    aborted = time.monotonic()
    usage = wait_no_blocks_in_use(d.url, timeout=60)
    assert usage == (0.0,), f"D still holds the aborted push's blocks: {usage}"
    # not before C's delayed write could have landed
    assert time.monotonic() - aborted > DELAY_S - 6
    ids = prompt(300, seed=9302)
    n = complete(d.url, ids, max_tokens=20, logprobs=5, timeout=120)
    check = compare(
        n, reference_completion(d.url, ids, max_tokens=20), expected_cached_tokens=None
    )
    assert check.ok, check.problems
