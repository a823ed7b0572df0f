"""C evicts the blocks it is pushing, on two hosts (network namespaces).

C's KV cache is tiny (16 blocks of 128 tokens). C's write of a push is held back
(MOONCAKE_FAULT_DELAY_WRITE: it reads the blocks only when the delay is over) and
meanwhile a flood of other prompts on C takes every block, so the session's cached
blocks are evicted and overwritten before C reads them. C must notice (the blocks'
generations changed) and report the push failed; D must prefill locally and answer
from correct KV; no block may stay allocated on either instance.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK
from harness.pd_client import (
    complete,
    match_blocks,
    push_stats,
    wait_for_matched_blocks,
)
from harness.prompts import random_prompt as prompt

pytestmark = [pytest.mark.integration, pytest.mark.hosts]

C_BLOCKS = 16
TURN1, TURN2 = 5 * BLOCK, 5 * BLOCK + 60
# C's write waits this long: the flood must evict the session's blocks first (it took
# 24.9 s on a loaded AVX2-only 2-core machine); under D's 30 s push budget, which C
# checks before it writes
DELAY_S = 25
FLOOD_LEN = 12 * BLOCK  # each flood prompt needs 12 of C's 16 blocks


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    return pd_cluster(
        {"c": "kv_producer", "d": "kv_consumer"},
        hosts=True,
        kv_cache_gib=1,
        # 15 of C's 16 blocks: vLLM 0.32.0 refuses to start when one request of
        # max_model_len would not fit the blocks left beside the null block
        max_model_len=(C_BLOCKS - 1) * BLOCK,
        instances={
            "c": {
                "env": {
                    "MOONCAKE_FAULT_DELAY_WRITE": f"{TURN2}:{DELAY_S}",
                    "MOONCAKE_PUSH_TIMEOUT_S": "30",
                },
                "extra_args": ["--num-gpu-blocks-override", str(C_BLOCKS)],
            }
        },
    )


def test_blocks_evicted_during_the_push_are_never_used_by_d(cluster):
    c, d = cluster["c"], cluster["d"]
    turn1 = prompt(TURN1, seed=7100)
    complete(c.url, turn1, max_tokens=1, logprobs=None, timeout=120)
    assert (
        wait_for_matched_blocks(c.bootstrap_url, turn1, TURN1 // BLOCK)[
            "matched_blocks"
        ]
        == TURN1 // BLOCK
    )
    before = push_stats(c.bootstrap_url)
    turn2 = turn1 + prompt(TURN2 - TURN1, seed=7101)
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            complete,
            d.url,
            turn2,
            max_tokens=4,
            logprobs=5,
            timeout=300,
            kv_transfer_params={"push_from": c.bootstrap_url},
        )
        time.sleep(1.5)  # D asked; C matched the blocks and sits in its delayed write
        t_flood = time.monotonic()
        for i in range(2):  # each takes 12 of 16 blocks: the session's 5 are reused
            complete(
                c.url,
                prompt(FLOOD_LEN, seed=7200 + i),
                max_tokens=1,
                logprobs=None,
                timeout=120,
            )
        flood_s = time.monotonic() - t_flood
        matched = match_blocks(c.bootstrap_url, turn1)["matched_blocks"]
        got = fut.result(timeout=300)
    assert flood_s < DELAY_S, (
        f"inconclusive: the flood took {flood_s:.1f} s, C's write ({DELAY_S} s) may have "
        "read the blocks before they were evicted"
    )
    assert matched < TURN1 // BLOCK, (
        f"inconclusive: C still holds {matched} blocks of the session after the flood"
    )
    after = push_stats(c.bootstrap_url)
    assert after["failed"] == before["failed"] + 1 and after["ok"] == before["ok"], (
        after
    )
    assert not got.cached_tokens, f"D used {got.cached_tokens} tokens of a failed push"
    check = compare(
        got,
        reference_completion(d.url, turn2, max_tokens=4),
        expected_cached_tokens=None,
    )
    assert check.ok, check.problems
    assert wait_no_blocks_in_use(c.url, d.url, timeout=120) == (0.0, 0.0)
