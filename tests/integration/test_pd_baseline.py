"""Baseline P->D transfer between two real vLLM instances and the real Mooncake engine.

P (kv_producer) prefills, D (kv_consumer) pulls the KV over the transfer engine
(TCP on loopback) and decodes. A second decode instance has the fault injection
armed (one received block zeroed) so the correctness check is seen going red.
P's max_num_batched_tokens is below the longer prompt, forcing chunked prefill.
The instances are the shared "push" cluster's (conftest.SHARED_CLUSTERS): C the
prefill, D and d_faulty the decode instances, on upstream's post-hoc path.
"""

from __future__ import annotations

import pytest

from harness.correctness import compare, reference_completion
from harness.launcher import Cluster, InstanceSpec, InstanceStartError
from harness.pd_client import bootstrap_headers, pd_generate, post_bootstrap
from harness.prompts import random_prompt as prompt
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

pytestmark = pytest.mark.integration

LONG = 600  # tokens: more than P prefills in one step


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """P prefills LONG tokens in chunks, on upstream's post-hoc path (no
    MOONCAKE_LAYERWISE); d_faulty zeroes the first block it receives."""
    cl = shared_cluster("push")
    assert cl["c"].spec.max_num_batched_tokens < LONG
    assert "MOONCAKE_LAYERWISE" not in cl["c"].spec.env
    assert cl["d_faulty"].spec.env["MOONCAKE_FAULT_ZERO_RECV_BLOCK"] == "0"
    assert "MOONCAKE_FAULT_ZERO_RECV_BLOCK" not in cl["d"].spec.env
    return cl


@pytest.mark.parametrize("n", [300, LONG], ids=["single-chunk", "chunked-prefill"])
def test_kv_lands_byte_exact(cluster, n):
    p, d = cluster["c"], cluster["d"]
    ids = prompt(n, seed=n)
    r = pd_generate(p.url, p.bootstrap_url, d.url, ids, max_tokens=4, logprobs=5)
    ref = reference_completion(p.url, ids, max_tokens=4)
    # vLLM recomputes the last prompt token to get logits: all others come from P.
    check = compare(
        r.decode, ref, expected_cached_tokens=cached_tokens_of_whole_prompt(n)
    )
    assert check.ok, check.problems
    assert check.compared_tokens == 4


def test_check_goes_red_when_a_transferred_block_is_zeroed(cluster):
    p, d = cluster["c"], cluster["d_faulty"]
    ids = prompt(LONG, seed=7)
    r = pd_generate(p.url, p.bootstrap_url, d.url, ids, max_tokens=4, logprobs=5)
    ref = reference_completion(p.url, ids, max_tokens=4)
    check = compare(
        r.decode, ref, expected_cached_tokens=cached_tokens_of_whole_prompt(LONG)
    )
    assert not check.ok
    assert any(
        "logprobs" in x or "top-k" in x or "tokens differ" in x for x in check.problems
    )
    # The transfer itself happened: the failure is the KV content, not a fallback.
    assert r.decode.cached_tokens == cached_tokens_of_whole_prompt(LONG)


def test_block_hash_sync_tracks_the_prefix_cache(cluster):
    """The worker's hash table (patch 0008) matches what the scheduler cached,
    hashed with the same cache_salt rules."""
    import httpx

    from harness.pd_client import complete, match_blocks, wait_for_matched_blocks

    p = cluster["c"]
    ids = prompt(LONG, seed=11)  # 4 full blocks of 128 tokens
    complete(p.url, ids, max_tokens=1, logprobs=None, cache_salt="salt-a")

    def match(token_ids, salt=None):
        return match_blocks(p.bootstrap_url, token_ids, salt)["matched_blocks"]

    assert (
        wait_for_matched_blocks(p.bootstrap_url, ids, 4, "salt-a")["matched_blocks"]
        == 4
    )
    assert match(ids, "salt-b") == 0  # never served across cache_salt
    assert match(ids) == 0
    assert (
        match(ids[:300] + prompt(300, seed=12), "salt-a") == 2
    )  # shared 2-block prefix
    dbg = httpx.get(
        p.bootstrap_url + "/hashsync", timeout=30, headers=bootstrap_headers()
    ).json()
    assert dbg["size"] >= 4 and dbg["hash_algo"]
    # signed: the cluster has a token
    bad = post_bootstrap(p.bootstrap_url, "/match_blocks", b'{"token_ids": []}')
    assert bad.status_code == 422 and "token_ids" in bad.text


def test_start_failure_reports_log_tail(tmp_path):
    spec = InstanceSpec("broken", model=str(tmp_path / "no-such-model"), role=None)
    c = Cluster([spec], tmp_path, startup_timeout_s=120)
    with pytest.raises(InstanceStartError) as e:
        c.start()
    msg = str(e.value)
    assert "broken" in msg and "Last lines" in msg and "no-such-model" in msg
    pgid = c["broken"].log_path  # the process is gone after a failed start
    assert c["broken"].proc is None, pgid
