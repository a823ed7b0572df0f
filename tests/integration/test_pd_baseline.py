"""Baseline P->D transfer between two real vLLM instances and the real Mooncake engine.

P (kv_producer) prefills, D (kv_consumer) pulls the KV over the transfer engine
(TCP on loopback) and decodes. A second decode instance has the fault injection
armed (one received block zeroed) so the correctness check is seen going red.
max_num_batched_tokens is below the longer prompt, forcing chunked prefill.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harness.correctness import compare, reference_completion
from harness.launcher import Cluster, InstanceSpec, InstanceStartError
from harness.pd_client import bootstrap_headers, pd_generate
from harness.prompts import random_prompt as prompt
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

pytestmark = pytest.mark.integration

MAX_BATCHED = 256  # below the 600-token prompt: chunked prefill on P


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    return pd_cluster(
        {
            "prefill": "kv_producer",
            "decode": "kv_consumer",
            "decode_faulty": "kv_consumer",
        },
        max_num_batched_tokens=MAX_BATCHED,
        instances={"decode_faulty": {"env": {"MOONCAKE_FAULT_ZERO_RECV_BLOCK": "0"}}},
    )


@pytest.mark.parametrize("n", [300, 600], ids=["single-chunk", "chunked-prefill"])
def test_kv_lands_byte_exact(cluster, n):
    p, d = cluster["prefill"], cluster["decode"]
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
    p, d = cluster["prefill"], cluster["decode_faulty"]
    ids = prompt(600, seed=7)
    r = pd_generate(p.url, p.bootstrap_url, d.url, ids, max_tokens=4, logprobs=5)
    ref = reference_completion(p.url, ids, max_tokens=4)
    check = compare(
        r.decode, ref, expected_cached_tokens=cached_tokens_of_whole_prompt(600)
    )
    assert not check.ok
    assert any(
        "logprobs" in x or "top-k" in x or "tokens differ" in x for x in check.problems
    )
    # The transfer itself happened: the failure is the KV content, not a fallback.
    assert r.decode.cached_tokens == cached_tokens_of_whole_prompt(600)


def test_block_hash_sync_tracks_the_prefix_cache(cluster):
    """The worker's hash table (patch 0008) matches what the scheduler cached,
    hashed with the same cache_salt rules."""
    import httpx

    from harness.pd_client import complete, match_blocks, wait_for_matched_blocks

    p = cluster["prefill"]
    ids = prompt(600, seed=11)  # 4 full blocks of 128 tokens
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
    bad = httpx.post(
        p.bootstrap_url + "/match_blocks",
        json={"token_ids": []},
        timeout=30,
        headers=bootstrap_headers(),
    )
    assert bad.status_code == 422 and "token_ids" in bad.text


def live_processes_in_group(pgid: int) -> list[int]:
    """Pids of the process group that are still running (zombies count as gone)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def test_teardown_leaves_no_processes(cluster):
    pgids = [inst.proc.pid for inst in cluster.instances.values()]
    assert all(
        live_processes_in_group(g) for g in pgids
    )  # API server + EngineCore each
    cluster.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        live_processes_in_group(g) for g in pgids
    ):
        time.sleep(0.5)
    assert not any(live_processes_in_group(g) for g in pgids)


def test_start_failure_reports_log_tail(tmp_path):
    spec = InstanceSpec("broken", model=str(tmp_path / "no-such-model"), role=None)
    c = Cluster([spec], tmp_path, startup_timeout_s=120)
    with pytest.raises(InstanceStartError) as e:
        c.start()
    msg = str(e.value)
    assert "broken" in msg and "Last lines" in msg and "no-such-model" in msg
    pgid = c["broken"].log_path  # the process is gone after a failed start
    assert c["broken"].proc is None, pgid
