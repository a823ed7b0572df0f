"""Prefix push refuses tensor parallelism > 1 (two real instances, TP=2 source).

Only one worker of a TP=2 instance serves the bootstrap server, so a push would
move one rank's head shard into every destination rank: push is refused until
TP > 1 is implemented. D sees C's TP in C's /match_blocks fingerprint and
prefills locally; C refuses (409) a push naming TP=2 even when D claims to match.
"""

from __future__ import annotations

import time

import httpx
import pytest

from harness.correctness import compare, reference_completion
from harness.launcher import BLOCK
from harness.pd_client import complete, match_blocks
from harness.prompts import random_prompt as prompt

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    cl = pd_cluster(
        {"c": "kv_producer", "d": "kv_consumer"},
        kv_cache_gib=1,
        max_model_len=2048,
        instances={"c": {"tp": 2}},
    )
    return cl["c"], cl["d"]


def test_push_from_a_tp2_source_is_refused_and_d_prefills_locally(cluster):
    c, d = cluster
    ids = prompt(4 * BLOCK + 3, seed=8800)
    complete(c.url, ids, max_tokens=1, logprobs=None, timeout=300)
    match = match_blocks(c.bootstrap_url, ids)
    fp = match["fingerprint"]
    assert fp["tp_size"] == 2, fp
    got = complete(
        d.url,
        ids,
        max_tokens=4,
        logprobs=5,
        timeout=300,
        kv_transfer_params={"push_from": c.bootstrap_url},
    )
    assert not got.cached_tokens, got.cached_tokens
    check = compare(
        got, reference_completion(d.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, check.problems
    assert "tp_size 1 (this instance) != 2" in d.log_path.read_text()
    # C itself refuses a push even from a destination claiming the same TP=2
    body = {
        "token_ids": ids,
        "block_size": BLOCK,
        "dst_session": "127.0.0.1:1",
        "dst_kv_base_addrs": [(i + 1) << 32 for i in range(fp["num_kv_tensors"])],
        "dst_block_ids": [0, 1, 2, 3],
        "deadline_unix_ms": int(time.time() * 1000) + 60_000,
        "dst_num_blocks": 64,
        "fingerprint": fp,
        "source_id": match["source_id"],
    }
    r = httpx.post(c.bootstrap_url + "/push_blocks", json=body, timeout=30)
    assert r.status_code == 409 and "TP=1" in r.text, r.text
