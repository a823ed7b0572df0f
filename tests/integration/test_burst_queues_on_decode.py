"""D admits a bounded number of incoming transfers; a burst queues on D.

A burst of P/D requests reaches P and D at once. P computes the prompts one
after another; without a bound, D asks P for every transfer at once, and a pull
whose prompt is still queued on P past MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S is
refused: the request fails with nothing wrong. With MOONCAKE_DECODE_MAX_PULLS,
the pulls beyond the bound wait in D's queue, without blocks, and each asks P
about when P computes its prompt; one that waits MOONCAKE_DECODE_PULL_WAIT_S
is prefilled on D, and P is told to free its copy. Real instances, the real
Mooncake engine.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time

import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.metrics import samples, scrape
from harness.pd_client import (
    complete,
    layerwise_transfer,
    layerwise_transfers,
    pd_generate,
)
from harness.prompts import random_prompt as prompt
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

pytestmark = pytest.mark.integration

MAX_PULLS = 1  # D's bound
PULL_WAIT_S = 25  # D's longest wait for a slot
UNKNOWN_TIMEOUT_S = 4  # P's wait for a transfer it has not scheduled
TRANSFER_TIMEOUT_S = 40  # P's wait for a transfer's writes once D asked
HELD_PROMPT, HELD_S = 389, 30  # P holds this prompt's writer before its first write
PROMPT_TOKENS = 1000  # a burst's prompts: 4 chunks of 256 on P, layer-wise


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    """Layer-wise P -> D in chunks of 256 tokens; the timeouts above; D admits
    MAX_PULLS transfers at once; P holds the writer of a HELD_PROMPT-token prompt."""
    return pd_cluster(
        max_num_batched_tokens=256,
        env={
            "MOONCAKE_LAYERWISE": "1",
            "MOONCAKE_LAYERWISE_MIN_TOKENS": "256",
            "MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S": str(UNKNOWN_TIMEOUT_S),
            "MOONCAKE_LAYERWISE_TIMEOUT_S": str(TRANSFER_TIMEOUT_S),
        },
        instances={
            "prefill": {
                "env": {"MOONCAKE_FAULT_HOLD_WRITE": f"{HELD_PROMPT}:0:{HELD_S}"}
            },
            "decode": {
                "env": {
                    "MOONCAKE_DECODE_MAX_PULLS": str(MAX_PULLS),
                    "MOONCAKE_DECODE_PULL_WAIT_S": str(PULL_WAIT_S),
                }
            },
        },
    )


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The largest number of [start, end] intervals that overlap."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def pd(p, d, ids, **kw):
    return pd_generate(
        p.url, p.bootstrap_url, d.url, ids, max_tokens=3, logprobs=5, timeout=300, **kw
    )


def test_a_burst_longer_than_ps_wait_queues_on_d_and_every_request_ends_well(
    cluster,
):
    p, d = cluster["prefill"], cluster["decode"]
    # as many prompts as P computes in its unknown-transfer wait + 2 s, whatever
    # this machine's speed: without the bound, the last pulls wait on P longer
    # than that; with it, the last waits on D about that long (well below
    # PULL_WAIT_S)
    started = time.monotonic()
    complete(p.url, prompt(PROMPT_TOKENS, seed=4099), max_tokens=1, logprobs=None)
    prefill_s = time.monotonic() - started
    burst = 1 + min(15, math.ceil((UNKNOWN_TIMEOUT_S + 2) / prefill_s))
    prompts = [prompt(PROMPT_TOKENS, seed=4100 + i) for i in range(burst)]

    def one(ids):
        try:
            return pd(p, d, ids)
        except Exception as e:  # noqa: BLE001 - each request's end is checked below
            return e

    with cf.ThreadPoolExecutor(burst) as pool:
        results = list(pool.map(one, prompts))
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, (
        f"{len(failed)} of {burst} requests failed (P's prefill {prefill_s:.1f}s): "
        f"{failed[:2]}"
    )
    for ids, r in zip(prompts, results):
        check = compare(
            r.decode,
            reference_completion(p.url, ids, max_tokens=3),
            expected_cached_tokens=cached_tokens_of_whole_prompt(len(ids)),
        )
        assert check.ok, check.problems  # D's answer came from P's KV
    timelines = [r.decode.kv_transfer_params["mooncake_timeline"] for r in results]
    span = max(t["kv_arrived"] for t in timelines) - min(
        t["allocated"] for t in timelines
    )
    assert span > UNKNOWN_TIMEOUT_S, (
        f"the burst took {span:.1f}s on D, not more than P's {UNKNOWN_TIMEOUT_S}s "
        "wait: too short to show the queue"
    )
    in_flight = [(t["allocated"], t["kv_arrived"]) for t in timelines]
    assert most_at_once(in_flight) <= MAX_PULLS, timelines
    queued = [t for t in timelines if t["queued"] is not None]
    assert len(queued) >= burst - MAX_PULLS, timelines
    assert all(t["queued"] <= t["allocated"] for t in queued), queued
    assert wait_no_blocks_in_use(p.url, d.url, timeout=120) == (0.0, 0.0)


def waiting_on(url: str) -> float:
    """Requests waiting in an instance's scheduler queue."""
    return sum(samples(scrape(url), "vllm:num_requests_waiting"))


def test_a_pull_for_a_prompt_queued_behind_others_on_p_waits_for_its_prefill(
    cluster,
):
    """D has a free slot and asks P at once for a prompt that P's scheduler has
    queued behind other prompts, which keep P busy longer than P waits for a
    transfer it has never received (MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S). P
    knows the request is queued, so D's pull waits for its prefill: the request
    ends well, with P's KV."""
    p, d = cluster["prefill"], cluster["decode"]
    started = time.monotonic()
    complete(p.url, prompt(PROMPT_TOKENS, seed=4300), max_tokens=1, logprobs=None)
    prefill_s = time.monotonic() - started
    # queued ahead of it: more prompts than P computes in its wait + 2 s
    need = min(64, math.ceil((UNKNOWN_TIMEOUT_S + 2) / prefill_s))
    ahead = need + 4
    ids = prompt(PROMPT_TOKENS, seed=4301)
    transfer_id = f"xfer-queued-{time.time_ns()}"
    with cf.ThreadPoolExecutor(ahead) as pool:
        busy = [
            pool.submit(
                complete,
                p.url,
                prompt(PROMPT_TOKENS, seed=4310 + i),
                max_tokens=1,
                logprobs=None,
            )
            for i in range(ahead)
        ]
        deadline = time.monotonic() + 30
        while waiting_on(p.url) < need:
            assert time.monotonic() < deadline, "P never took the prompts ahead"
            time.sleep(0.05)
        r = pd(p, d, ids, transfer_id=transfer_id)
        for f in busy:
            f.result()
    check = compare(
        r.decode,
        reference_completion(p.url, ids, max_tokens=3),
        expected_cached_tokens=cached_tokens_of_whole_prompt(len(ids)),
    )
    assert check.ok, check.problems  # D's answer came from P's KV
    t = layerwise_transfer(p.bootstrap_url, transfer_id)
    asked = r.decode.kv_transfer_params["mooncake_timeline"]["allocated"]
    # D asked (its pull started) while the prompt was still queued on P, longer
    # before P began computing it than P waits for a transfer it never received
    assert t["prefill_end"] - prefill_s - asked > UNKNOWN_TIMEOUT_S, (t, asked)
    assert t["outcome"] == "completed", t
    assert wait_no_blocks_in_use(p.url, d.url, timeout=120) == (0.0, 0.0)


def test_a_request_that_waits_its_whole_bound_is_prefilled_on_d_and_p_frees_it(
    cluster,
):
    """D's one slot is taken by a transfer P holds for HELD_S; the next request
    waits PULL_WAIT_S, then D prefills it itself: the answer is right, it took no
    KV from P, and P ended its transfer when D said so, long before P's own
    timeout, without writing."""
    p, d = cluster["prefill"], cluster["decode"]
    held_id = f"xfer-held-{time.time_ns()}"
    later_id = f"xfer-later-{time.time_ns()}"
    held_ids, later_ids = prompt(HELD_PROMPT, seed=4200), prompt(400, seed=4201)
    with cf.ThreadPoolExecutor(2) as pool:
        held = pool.submit(pd, p, d, held_ids, transfer_id=held_id)
        # D received it with P, and its one slot is free: it asks P at once
        deadline = time.monotonic() + 30
        while not any(
            t["transfer_id"] == held_id
            for t in layerwise_transfers(p.bootstrap_url)["transfers"]
        ):
            assert time.monotonic() < deadline, "P never scheduled the held request"
            time.sleep(0.2)
        time.sleep(2)
        started = time.monotonic()
        later = pd(p, d, later_ids, transfer_id=later_id)
        waited = time.monotonic() - started
        held = held.result()
    assert PULL_WAIT_S - 1 < waited < HELD_S + 5, waited
    # prefilled on D: the same answer as P's own, no KV taken from P
    check = compare(
        later.decode,
        reference_completion(p.url, later_ids, max_tokens=3),
        expected_cached_tokens=None,
    )
    assert check.ok, check.problems
    assert not later.decode.cached_tokens, later.decode
    assert "mooncake_timeline" not in (later.decode.kv_transfer_params or {})
    # P ended its copy when D's block-less pull came, not at its own timeout
    t = layerwise_transfer(p.bootstrap_url, later_id)
    assert t["ended_at"] is not None and t["bytes_written"] == 0, t
    assert t["ended_at"] - t["prefill_end"] < TRANSFER_TIMEOUT_S - 3, t
    # the held transfer still ended well, from P's KV
    check = compare(
        held.decode,
        reference_completion(p.url, held_ids, max_tokens=3),
        expected_cached_tokens=cached_tokens_of_whole_prompt(HELD_PROMPT),
    )
    assert check.ok, check.problems
    assert wait_no_blocks_in_use(p.url, d.url, timeout=120) == (0.0, 0.0)
