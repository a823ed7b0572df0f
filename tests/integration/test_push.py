"""Prefix push migration (POST /push_blocks) between two real vLLM instances.

C serves a prompt (its prefix cache now holds the prompt's full blocks); D is
then asked for the same prompt with kv_transfer_params {"push_from": C's
bootstrap URL}: C's bootstrap server writes the held blocks into D's KV cache
with the real Mooncake engine (TCP, loopback) and D prefills only the rest.
D's cached tokens must equal the matched tokens and its result must pass the
KV-sensitive correctness check against a local run. Prefixes C does not hold
(other tokens, other cache_salt) match nothing and D still answers; a push
that fails after the match falls back to local prefill; no blocks stay
allocated on either side.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path

import httpx
import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK
from harness.pd_client import (
    complete,
    match_blocks,
    post_bootstrap,
    push_stats,
    wait_for_matched_blocks,
)
from harness.prompts import random_prompt as prompt
from microbench.common import model_facts
from microbench.fork.accounting import burst_accounting
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

pytestmark = pytest.mark.integration

UNREACHABLE = "http://127.0.0.1:9"  # allowed on D, nothing listens there


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """C fails every push of one prompt length (faulty_prompt_len); D also takes
    pushes from UNREACHABLE (conftest.SHARED_CLUSTERS["push"])."""
    cl = shared_cluster("push")
    assert UNREACHABLE in cl["d"].spec.extra_push_sources
    return cl


def faulty_prompt_len(c) -> int:
    return int(c.spec.env["MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN"])


def turn_on_c(c, ids, salt=None):
    complete(c.url, ids, max_tokens=1, logprobs=None, cache_salt=salt, timeout=300)
    r = wait_for_matched_blocks(c.bootstrap_url, ids, len(ids) // BLOCK, salt)
    assert r["matched_blocks"] == len(ids) // BLOCK, r


def push_request(d, c, ids, salt=None, source=None):
    return complete(
        d.url,
        ids,
        max_tokens=4,
        logprobs=5,
        cache_salt=salt,
        timeout=300,
        kv_transfer_params={"push_from": source or c.bootstrap_url},
    )


def check_local(got, ids, c):
    """Nothing came from C: vLLM reports no cached tokens (it omits a zero)."""
    assert not got.cached_tokens, f"{got.cached_tokens} cached tokens, expected none"
    check = compare(
        got, reference_completion(c.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, check.problems


def test_pushed_blocks_land_byte_exact(cluster):
    c, d = cluster["c"], cluster["d"]
    ids = prompt(8 * BLOCK + 50, seed=5000)
    turn_on_c(c, ids)
    before = push_stats(c.bootstrap_url)
    got = push_request(d, c, ids)
    ref = reference_completion(c.url, ids, max_tokens=4)
    check = compare(got, ref, expected_cached_tokens=8 * BLOCK)
    assert check.ok, check.problems
    assert "push_blocks" in c.log_text()
    stats = push_stats(c.bootstrap_url)
    assert stats["ok"] > before["ok"] and stats["bytes"] > before["bytes"], stats
    assert wait_no_blocks_in_use(c.url, d.url) == (0.0, 0.0)


def test_whole_prompt_of_full_blocks(cluster):
    """Every block held: D recomputes only the last token."""
    c, d = cluster["c"], cluster["d"]
    ids = prompt(4 * BLOCK, seed=5001)
    turn_on_c(c, ids)
    got = push_request(d, c, ids)
    check = compare(
        got,
        reference_completion(c.url, ids, max_tokens=4),
        expected_cached_tokens=cached_tokens_of_whole_prompt(4 * BLOCK),
    )
    assert check.ok, check.problems


def test_prefix_c_does_not_hold_matches_nothing(cluster):
    c, d = cluster["c"], cluster["d"]
    ids = prompt(3 * BLOCK + 5, seed=5002)  # never sent to C
    got = push_request(d, c, ids)
    check_local(got, ids, c)


def test_other_cache_salt_matches_nothing(cluster):
    c, d = cluster["c"], cluster["d"]
    ids = prompt(3 * BLOCK + 5, seed=5003)
    turn_on_c(c, ids, salt="tenant-a")
    got = push_request(d, c, ids, salt="tenant-b")
    check_local(got, ids, c)
    got = push_request(d, c, ids, salt="tenant-a")  # the right tenant gets the push
    check = compare(
        got,
        reference_completion(c.url, ids, max_tokens=4),
        expected_cached_tokens=3 * BLOCK,
    )
    assert check.ok, check.problems


def test_failed_push_falls_back_to_local_prefill(cluster):
    c, d = cluster["c"], cluster["d"]
    ids = prompt(faulty_prompt_len(c), seed=5004)
    turn_on_c(c, ids)
    got = push_request(d, c, ids)  # matched 5 blocks, then C's write fails
    check_local(got, ids, c)
    assert "FAULT INJECTION (MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN" in c.log_text()
    assert "prefilling the other" in d.log_text()
    assert wait_no_blocks_in_use(c.url, d.url) == (0.0, 0.0)


def test_unreachable_source_falls_back_to_local_prefill(cluster):
    c, d = cluster["c"], cluster["d"]
    ids = prompt(2 * BLOCK + 7, seed=5005)
    t0 = time.monotonic()
    got = push_request(d, c, ids, source=UNREACHABLE)
    check_local(got, ids, c)
    assert time.monotonic() - t0 < 60


def test_source_outside_the_allowlist_is_never_asked(cluster):
    """D takes prefix pushes only from MOONCAKE_PUSH_SOURCES: any client can set
    push_from, and D would post its session, addresses and block ids there."""
    c, d = cluster["c"], cluster["d"]
    if "127.0.0.1" not in c.bootstrap_url:
        pytest.skip("needs a second name of the same server (on loopback: localhost)")
    ids = prompt(2 * BLOCK + 3, seed=5007)
    turn_on_c(c, ids)
    got = push_request(
        d, c, ids, source=c.bootstrap_url.replace("127.0.0.1", "localhost")
    )
    check_local(got, ids, c)  # same server, but not the allowlisted name: refused
    assert "is not in MOONCAKE_PUSH_SOURCES" in d.log_text()


def test_malformed_push_is_422_naming_the_field(cluster):
    c = cluster["c"]
    ids = prompt(2 * BLOCK, seed=5006)
    turn_on_c(
        c, ids
    )  # C has stepped: /match_blocks answers (503 before the first step)
    match = match_blocks(c.bootstrap_url, ids)
    before = push_stats(c.bootstrap_url)
    body = {
        "token_ids": ids,
        "block_size": BLOCK,
        "dst_session": "127.0.0.1:1",
        "dst_kv_base_addrs": [4096],
        "dst_block_ids": [0, 1],
        "deadline_unix_ms": int(time.time() * 1000) + 60_000,
        "dst_num_blocks": 100,
        "fingerprint": match["fingerprint"],
        "source_id": match["source_id"],
    }
    for raw, field in (
        (json.dumps(body).encode(), "dst_kv_base_addrs"),
        (b"not json", "body"),
    ):
        # signed as D signs (off loopback the POST routes take a signature, not the token)
        r = post_bootstrap(c.bootstrap_url, "/push_blocks", raw)
        assert r.status_code == 422 and r.json()["detail"]["field"] == field, r.text
    after = push_stats(c.bootstrap_url)
    assert after == before  # rejected before any match or write


def test_a_source_reports_its_load_in_its_match_answers(cluster):
    """C's /match_blocks answers carry its load, which D's push gate weighs
    (push/decode_cost.py): its push slots, the pushes it serves, and the prompt
    tokens its scheduler admitted and has not computed. Two prompts of 2,500
    tokens, more than one step's budget (2,048 on the CPU backend), leave a
    backlog after the first step; once C is idle it says 0."""
    c = cluster["c"]
    probe = prompt(2 * BLOCK, seed=5011)
    turn_on_c(c, probe)
    idle = match_blocks(c.bootstrap_url, probe)
    slots = int(c.spec.env["MOONCAKE_PUSH_MAX_CONCURRENT"])
    assert (idle["push_slots"], idle["pushes_in_flight"]) == (slots, 0)
    assert idle["prefill_backlog_tokens"] == 0
    seen = []
    with cf.ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(
                complete,
                c.url,
                prompt(2500, seed=5012 + i),
                max_tokens=1,
                logprobs=None,
                timeout=300,
            )
            for i in range(2)
        ]
        while not all(f.done() for f in futs):
            seen.append(match_blocks(c.bootstrap_url, probe)["prefill_backlog_tokens"])
            time.sleep(0.02)
        for f in futs:
            f.result()
    assert 0 < max(seen) < 2 * 2500, seen
    assert match_blocks(c.bootstrap_url, probe)["prefill_backlog_tokens"] == 0


def reset_prefix_cache(inst, deadline_s: float = 60.0) -> None:
    """POST /reset_prefix_cache until vLLM resets (it refuses while a request still
    holds blocks; C's last request may be finishing)."""
    end = time.monotonic() + deadline_s
    while True:
        r = httpx.post(inst.url + "/reset_prefix_cache", timeout=30)
        if r.status_code == 200:
            return
        assert time.monotonic() < end, f"{r.status_code} {r.text[:300]}"
        time.sleep(0.5)


def test_a_reset_of_an_idle_source_is_matched_by_nothing_at_once(cluster):
    """After its prefix cache is reset (as after a weight update), an idle source
    takes no step: its block-hash mirror must forget at once, not with the next
    step, or D is pushed KV the source itself no longer serves from."""
    c, d = cluster["c"], cluster["d"]
    ids = prompt(4 * BLOCK + 3, seed=5008)
    turn_on_c(c, ids)
    reset_prefix_cache(c)
    assert match_blocks(c.bootstrap_url, ids)["matched_blocks"] == 0
    check_local(push_request(d, c, ids), ids, c)
    turn_on_c(c, ids)  # the mirror follows the cache again after the reset


def test_a_fork_burst_receives_the_shared_context_once(cluster):
    """Four requests forked from one context reach D at once. One push writes the
    context's blocks; the other requests wait for it and take them from D's
    prefix cache (before, each request's push wrote them again). Every answer
    matches a local run."""
    c, d = cluster["c"], cluster["d"]
    context = prompt(8 * BLOCK, seed=5100)
    turn_on_c(c, context)
    forks = [context + prompt(40, seed=5101 + i) for i in range(4)]
    before = push_stats(c.bootstrap_url)
    with cf.ThreadPoolExecutor(len(forks)) as pool:
        got = list(pool.map(lambda ids: push_request(d, c, ids), forks))
    after = push_stats(c.bootstrap_url)
    pushes = after["pushes"] - before["pushes"]
    assert pushes == 1 and after["ok"] - before["ok"] == 1, (
        f"{pushes} pushes of the shared context for {len(forks)} forks on one "
        "instance: each should receive it once"
    )
    # the bytes C wrote, by destination: D's session, the context's KV once
    written = burst_accounting(
        {},
        {},
        before["bytes_by_destination"],
        after["bytes_by_destination"],
        holder="c",
        context_tokens=8 * BLOCK,
        kv_bytes_per_token=model_facts(Path(c.spec.model))["kv_bytes_per_token"],
    )
    assert list(written["bytes_ratio_by_destination"].values()) == [1.0], written
    for ids, out in zip(forks, got):
        assert out.cached_tokens >= 8 * BLOCK, (
            f"a fork computed its context: {out.cached_tokens} cached tokens"
        )
        check = compare(
            out,
            reference_completion(c.url, ids, max_tokens=4),
            expected_cached_tokens=None,
        )
        assert check.ok, check.problems
    assert wait_no_blocks_in_use(c.url, d.url) == (0.0, 0.0)
