"""Layer-wise push between instances of TP 2 (two real instances, P and D each two
ranks, MOONCAKE_LAYERWISE=1).

Each of D's ranks pulls its heads' shard from P's rank of the same number, and
each of P's ranks writes its shard layer by layer as it is computed; D's request
becomes runnable only when both ranks' pulls completed (vLLM counts every
worker's end). A write failing on one rank ends the request with an error in
bounded time, with nothing stranded on either side, and both keep serving.
"""

from __future__ import annotations

import pytest
from test_layerwise import (
    FAULTY_PROMPT_LEN,
    failed_write_ends_the_request,
    written_layer_by_layer,
)

from harness.kv_usage import wait_no_blocks_in_use
from harness.prompts import random_prompt as prompt

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    cl = pd_cluster(
        {"prefill": "kv_producer", "decode": "kv_consumer"},
        kv_cache_gib=1,
        max_model_len=2048,
        max_num_batched_tokens=256,
        env={
            "MOONCAKE_LAYERWISE": "1",
            "MOONCAKE_LAYERWISE_MIN_TOKENS": "256",
            "MOONCAKE_LAYERWISE_TIMEOUT_S": "20",
        },
        instances={
            "prefill": {
                "tp": 2,
                "env": {
                    "MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN": f"{FAULTY_PROMPT_LEN}@1"
                },
            },
            "decode": {"tp": 2},
        },
    )
    return cl["prefill"], cl["decode"]


def test_each_rank_writes_its_shard_layer_by_layer(cluster):
    p, d = cluster
    ids = prompt(700, seed=9700)  # 3 chunks of 256 tokens on P
    # rank 0's timeline (its bootstrap server's): written layer-wise, during the prefill
    written_layer_by_layer(p, d, ids, "tp2", max_tokens=4, reference_url=d.url)
    assert wait_no_blocks_in_use(p.url, d.url) == (0.0, 0.0)


def test_a_write_failing_on_one_rank_ends_the_request_and_strands_nothing(cluster):
    failed_write_ends_the_request(*cluster, seed=9701)
