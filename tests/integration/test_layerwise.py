"""Layer-wise KV push (MOONCAKE_LAYERWISE=1) between two real vLLM instances.

Chunked prefill is forced (max_num_batched_tokens below the prompt), so the
push ships blocks chunk by chunk and layer by layer; the KV-sensitive
correctness check proves the bytes landed. An abort in the middle of a
transfer must leave no blocks allocated on either side, and both instances
must keep serving.
"""

from __future__ import annotations

import time

import httpx
import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.pd_client import (
    bootstrap_headers,
    complete,
    engine_id,
    layerwise_transfer,
    model_name,
    pd_generate,
)
from harness.prompts import random_prompt as prompt
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

pytestmark = pytest.mark.integration

MAX_BATCHED = 256
FAULTY_PROMPT_LEN = 777
UNKNOWN_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """Layer-wise in chunks of MAX_BATCHED tokens; only a prompt of exactly
    FAULTY_PROMPT_LEN tokens gets its writes failed (conftest.SHARED_CLUSTERS)."""
    cl = shared_cluster("layerwise")
    p = cl["prefill"]
    assert p.spec.max_num_batched_tokens == MAX_BATCHED
    assert p.spec.env["MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN"] == str(FAULTY_PROMPT_LEN)
    assert p.spec.env["MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S"] == str(UNKNOWN_TIMEOUT_S)
    return cl


@pytest.mark.parametrize(
    "n", [100, 700], ids=["below-threshold-posthoc", "layerwise-chunked"]
)
def test_layerwise_kv_lands_byte_exact(cluster, n):
    p, d = cluster["prefill"], cluster["decode"]
    ids = prompt(n, seed=1000 + n)
    r = pd_generate(
        p.url, p.bootstrap_url, d.url, ids, max_tokens=4, logprobs=5, timeout=300
    )
    ref = reference_completion(p.url, ids, max_tokens=4)
    check = compare(
        r.decode, ref, expected_cached_tokens=cached_tokens_of_whole_prompt(n)
    )
    assert check.ok, check.problems


def written_layer_by_layer(
    p, d, ids, tag: str, max_tokens: int, reference_url: str
) -> dict:
    """One layer-wise request, its answer checked against ``reference_url``'s from
    scratch: P's timeline of the transfer (its bootstrap server's rank), completed,
    its first write started before P's prefill ended."""
    transfer_id = f"xfer-{tag}-{time.time_ns()}"
    r = pd_generate(
        p.url,
        p.bootstrap_url,
        d.url,
        ids,
        max_tokens=max_tokens,
        logprobs=5,
        transfer_id=transfer_id,
        timeout=300,
    )
    check = compare(
        r.decode,
        reference_completion(reference_url, ids, max_tokens=max_tokens),
        expected_cached_tokens=cached_tokens_of_whole_prompt(len(ids)),
    )
    assert check.ok, check.problems
    t = layerwise_transfer(p.bootstrap_url, transfer_id)
    assert t["outcome"] == "completed", t
    assert t["prefill_end"] is not None and t["first_write_start"] is not None, t
    assert t["first_write_start"] < t["prefill_end"], (
        f"the first write started {t['first_write_start'] - t['prefill_end']:.3f}s after the prefill ended"
    )
    return t


def test_layerwise_writes_start_before_the_prefill_ends(cluster):
    """The point of layer-wise push: most of a long prompt's KV is written while P
    still computes. P's sender timeline (GET /layerwise/transfers) must show the
    first write starting, and most bytes written, before P's last layer of the
    prompt's last chunk was computed. A post-hoc transfer (all writes after the
    prefill) fails this."""
    p, d = cluster["prefill"], cluster["decode"]
    ids = prompt(1500, seed=1500)  # 6 chunks of 256 tokens on P
    t = written_layer_by_layer(p, d, ids, "overlap", max_tokens=2, reference_url=p.url)
    share = t["bytes_before_prefill_end"] / t["bytes_written"]
    assert share > 0.5, (
        f"only {share:.0%} of the KV was written before the prefill ended: {t}"
    )


def test_d_reports_its_side_of_the_transfer_on_p_clock(cluster):
    """D's response carries its pull's timeline (kv_transfer_params
    "mooncake_timeline", D's scheduler): allocated, KV arrived (the request became
    runnable), scheduled, finished. On one host it is on P's clock
    (CLOCK_MONOTONIC): D learns the end only after P answered it, and P answers
    only after its last write; mb7's engine-clock tail is built on this order."""
    p, d = cluster["prefill"], cluster["decode"]
    ids = prompt(700, seed=700)
    transfer_id = f"xfer-timeline-{time.time_ns()}"
    r = pd_generate(
        p.url,
        p.bootstrap_url,
        d.url,
        ids,
        max_tokens=1,
        logprobs=None,
        transfer_id=transfer_id,
        timeout=300,
    )
    tl = (r.decode.kv_transfer_params or {}).get("mooncake_timeline")
    assert tl, f"D's response has no mooncake_timeline: {r.decode.kv_transfer_params}"
    assert tl["allocated"] <= tl["kv_arrived"] <= tl["scheduled"] <= tl["finished"], tl
    t = layerwise_transfer(p.bootstrap_url, transfer_id)
    assert t["outcome"] == "completed", t
    assert (
        t["prefill_end"] <= t["last_write_end"] <= t["ended_at"] <= tl["kv_arrived"]
    ), (
        t,
        tl,
    )
    # P answered D within the request's life on D
    assert tl["allocated"] <= t["ended_at"], (t, tl)


def test_concurrent_layerwise_transfers(cluster):
    import concurrent.futures as cf

    p, d = cluster["prefill"], cluster["decode"]
    prompts = [prompt(500 + 37 * i, seed=2000 + i) for i in range(3)]
    with cf.ThreadPoolExecutor(3) as pool:
        results = list(
            pool.map(
                lambda ids: pd_generate(
                    p.url,
                    p.bootstrap_url,
                    d.url,
                    ids,
                    max_tokens=3,
                    logprobs=5,
                    timeout=300,
                ),
                prompts,
            )
        )
    for ids, r in zip(prompts, results):
        ref = reference_completion(p.url, ids, max_tokens=3)
        check = compare(
            r.decode,
            ref,
            expected_cached_tokens=cached_tokens_of_whole_prompt(len(ids)),
        )
        assert check.ok, check.problems


def test_abort_mid_transfer_frees_blocks_on_both_sides(cluster):
    p, d = cluster["prefill"], cluster["decode"]
    # The clients give up a third of the way into P's prefill of such a prompt (8
    # chunks of 256 tokens), while P computes and writes it layer by layer: the
    # prefill's time measured here first, a machine's speed is not a constant.
    started = time.monotonic()
    complete(p.url, prompt(2048, seed=2999), max_tokens=1, logprobs=None, timeout=300)
    patience = max(0.3, (time.monotonic() - started) / 3)
    ids = prompt(2048, seed=3000)
    transfer_id = f"xfer-abort-{time.time_ns()}"
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0.0}
    p_body = {
        **body,
        "model": model_name(p.url),
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id},
    }
    d_body = {
        **body,
        "model": model_name(d.url),
        "max_tokens": 4,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": p.bootstrap_url,
            "remote_engine_id": engine_id(p.bootstrap_url),
        },
    }
    import concurrent.futures as cf

    def post_and_drop(url, b):
        try:
            r = httpx.post(url + "/v1/completions", json=b, timeout=patience)
        except httpx.TimeoutException:
            return "dropped"
        return "finished" if r.is_success else "error"

    with cf.ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(post_and_drop, [p.url, d.url], [p_body, d_body]))
    # D's client gives up as P's does, unless P's abort reaches D first: then D
    # ends the request itself, with an error (its pull failed); never an answer
    assert outcomes[0] == "dropped" and outcomes[1] in ("dropped", "error"), (
        outcomes,
        f"patience {patience:.2f} s",
    )
    usage = wait_no_blocks_in_use(p.url, d.url, timeout=120)
    assert usage == (0.0, 0.0), (
        f"KV blocks still allocated after abort (P, D usage): {usage}"
    )
    # both keep serving, correctly
    ids = prompt(400, seed=3001)
    r = pd_generate(
        p.url, p.bootstrap_url, d.url, ids, max_tokens=3, logprobs=5, timeout=300
    )
    ref = reference_completion(p.url, ids, max_tokens=3)
    check = compare(
        r.decode, ref, expected_cached_tokens=cached_tokens_of_whole_prompt(400)
    )
    assert check.ok, check.problems


def test_failed_write_fails_one_request_and_both_keep_serving(cluster):
    """The transfer engine failing a layer-wise write (injected on P) ends the
    decode request with an error, never a hang; no blocks stay allocated; the
    API servers survive (upstream's stats logger used to die on such a request,
    patch 0010) and the next transfer is byte-exact."""
    failed_write_ends_the_request(cluster["prefill"], cluster["decode"], seed=4000)


def failed_write_ends_the_request(p, d, seed: int) -> None:
    """A prompt of FAULTY_PROMPT_LEN tokens, whose writes P fails, ends with an error
    in bounded time and strands nothing; the next transfer is byte-exact."""
    from harness.pd_client import RequestFailed

    ids = prompt(FAULTY_PROMPT_LEN, seed=seed)
    started = time.monotonic()
    with pytest.raises(RequestFailed):
        pd_generate(
            p.url, p.bootstrap_url, d.url, ids, max_tokens=3, logprobs=5, timeout=120
        )
    assert time.monotonic() - started < 120
    assert "FAULT INJECTION (MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN" in p.log_text()
    usage = wait_no_blocks_in_use(p.url, d.url)
    assert usage == (0.0, 0.0), (
        f"KV blocks still allocated after a failed write (P, D): {usage}"
    )
    assert "Counters can only be incremented" not in d.log_text()
    ids = prompt(600, seed=seed + 1)
    r = pd_generate(
        p.url, p.bootstrap_url, d.url, ids, max_tokens=3, logprobs=5, timeout=300
    )
    ref = reference_completion(d.url, ids, max_tokens=3)
    check = compare(
        r.decode, ref, expected_cached_tokens=cached_tokens_of_whole_prompt(600)
    )
    assert check.ok, check.problems


def fuzz_socket(ctx, addr, valid, rng) -> tuple[int, int]:
    """Send 1000 malformed messages and 200 requests for unknown transfers to P's
    worker socket; return (sent, answered) after waiting for every answer."""
    import msgspec
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    sent = 0
    for i in range(1000):
        kind = i % 4
        if kind == 0:
            msg = rng.randbytes(rng.randrange(0, 200))
        elif kind == 1:
            raw = msgspec.msgpack.encode(valid)
            msg = raw[: rng.randrange(len(raw))]
        elif kind == 2:
            m = dict(valid)
            m[rng.choice(list(m))] = rng.choice(
                [None, -1, "x", 2**64 - 1, -(2**63), [], {"a": 1}]
            )
            msg = msgspec.msgpack.encode(m)
        else:
            msg = msgspec.msgpack.encode([1, 2, 3]) if i % 8 == 3 else b"\xc1"
        sock.send(msg)
        sent += 1
    for i in range(200):  # well formed, transfers P never scheduled
        m = dict(valid, req_blocks={f"r{i}": [f"ghost-{i}", [1, 2]]})
        sock.send(msgspec.msgpack.encode(m))
        sent += 1
    # Every message is answered (an error, or the end of its transfer): none lost,
    # the requests for unknown transfers within the unknown timeout.
    answered = 0
    deadline = time.monotonic() + UNKNOWN_TIMEOUT_S + 90
    while answered < sent and time.monotonic() < deadline:
        if sock.poll(1000):
            sock.recv()
            answered += 1
    return sent, answered


def test_fuzzing_the_prefill_zmq_socket_leaves_p_serving_and_nothing_waiting(cluster):
    """P's worker socket (upstream's unauthenticated ZMQ protocol) gets 1000
    malformed messages and 200 well-formed requests for transfers P never
    scheduled. P answers or drops them, never dies; the requests for unknown
    transfers end after MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S instead of holding a
    waiter each for the whole transfer timeout; afterwards a P->D request is
    byte-exact."""
    import random

    import zmq

    p, d = cluster["prefill"], cluster["decode"]
    q = httpx.get(p.bootstrap_url + "/query", timeout=10).json()
    addr = next(iter(next(iter(q.values()))["worker_addr"].values()))
    addr = addr if isinstance(addr, str) else next(iter(addr.values()))
    rng = random.Random(11)
    valid = {
        "remote_hostname": "127.0.0.1",
        "remote_port": 1,
        "remote_tp_size": 1,
        "remote_tp_rank": 0,
        "req_blocks": {"r": ["t", [1, 2]]},
        "kv_caches_base_addr": [4096] * 4,
    }
    ctx = zmq.Context()
    try:
        sent, answered = fuzz_socket(ctx, addr, valid, rng)
    finally:
        ctx.destroy(linger=0)  # never leave a socket open: Context.__del__ would block
    assert answered == sent, f"{sent - answered} of {sent} messages never answered"
    assert httpx.get(p.url + "/health", timeout=10).status_code == 200
    stats = httpx.get(
        p.bootstrap_url + "/layerwise/transfers",
        timeout=10,
        headers=bootstrap_headers(),
    ).json()["totals"]
    assert stats["waiting_unknown"] == 0, f"unknown transfers still waiting: {stats}"
    ids = prompt(500, seed=5000)
    r = pd_generate(
        p.url, p.bootstrap_url, d.url, ids, max_tokens=3, logprobs=5, timeout=300
    )
    check = compare(
        r.decode,
        reference_completion(p.url, ids, max_tokens=3),
        expected_cached_tokens=cached_tokens_of_whole_prompt(500),
    )
    assert check.ok, check.problems
    print(f"zmq fuzz: {sent} messages, P alive, 0 unknown transfers left waiting")
