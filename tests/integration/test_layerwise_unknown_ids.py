"""A transfer id named on P's ZMQ socket before P schedules it cannot harm the
request P later runs under that id.

P's worker socket is upstream's unauthenticated ZMQ protocol: anyone who can
reach it may send a MooncakeXferMetadata naming any transfer id. One such
message names transfer X; P answers it with an error after
MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S. P then runs a real request with transfer
id X whose decode side never asks for it: P must stay up (an anonymous
transfer reported to vLLM's scheduler in finished_sending kills EngineCore),
the request must complete, and its blocks be freed once nobody asked again within
MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S of its end (the decode side that was
answered has given up; the full MOONCAKE_LAYERWISE_TIMEOUT_S would only hold
them longer); a normal P->D request is byte-exact afterwards.
"""

from __future__ import annotations

import time
import uuid

import httpx
import msgspec
import pytest
import zmq

from harness.correctness import compare, reference_completion
from harness.kv_usage import kv_usage, wait_no_blocks_in_use
from harness.pd_client import (
    RequestFailed,
    bootstrap_headers,
    complete,
    engine_id,
    layerwise_transfer,
    layerwise_transfers,
    model_name,
    pd_generate,
)
from harness.prompts import random_prompt as prompt
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
    pull_request_blocks,
)

pytestmark = pytest.mark.integration

UNKNOWN_TIMEOUT_S = 8
TRANSFER_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """Layer-wise from 256 tokens on (conftest.SHARED_CLUSTERS), with the unknown
    and transfer timeouts above."""
    cl = shared_cluster("layerwise")
    env = cl["prefill"].spec.env
    assert env["MOONCAKE_LAYERWISE_MIN_TOKENS"] == "256"
    assert env["MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S"] == str(UNKNOWN_TIMEOUT_S)
    assert env["MOONCAKE_LAYERWISE_TIMEOUT_S"] == str(TRANSFER_TIMEOUT_S)
    return cl


def assert_pd_byte_exact(p, d, ids: list[int]) -> None:
    """A P->D request for ``ids``: D's answer equals P's own, from P's KV."""
    pd = pd_generate(
        p.url, p.bootstrap_url, d.url, ids, max_tokens=3, logprobs=5, timeout=120
    )
    check = compare(
        pd.decode,
        reference_completion(p.url, ids, max_tokens=3),
        expected_cached_tokens=cached_tokens_of_whole_prompt(len(ids)),
    )
    assert check.ok, check.problems


def worker_addr(bootstrap_url: str) -> str:
    """P's worker ZMQ address, as D learns it (GET /query on P's bootstrap server)."""
    q = httpx.get(bootstrap_url + "/query", timeout=10).json()
    addr = next(iter(next(iter(q.values()))["worker_addr"].values()))
    return addr if isinstance(addr, str) else next(iter(addr.values()))


def forge_pull(
    addr: str,
    transfer_id: str,
    timeout_s: float,
    limits: dict[str, float] | None = None,
):
    """Send D's pull request for ``transfer_id`` (encoded as D encodes it, with the
    decode side's ``limits``) and return P's answers until the last one."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.xfer import (
        ExtXferMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeXferResponse,
        MooncakeXferResponseStatus,
    )

    block_ids, per_region = pull_request_blocks([1, 2], 65536, 4)
    meta = ExtXferMetadata(
        remote_hostname="127.0.0.1",
        remote_port=1,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks={"forged-req": (transfer_id, block_ids)},
        kv_caches_base_addr=[4096] * 4,
        ext=limits,
        **per_region,
    )
    decoder = msgspec.msgpack.Decoder(MooncakeXferResponse)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        sock.send(msgspec.msgpack.Encoder().encode(meta))
        answers = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(500):
                answers.append(decoder.decode(sock.recv()))
                if answers[-1].status != MooncakeXferResponseStatus.CONTINUE:
                    return answers
        raise AssertionError(
            f"P did not answer the pull for {transfer_id} in {timeout_s}s"
        )
    finally:
        ctx.destroy(linger=0)  # never leave a socket open: Context.__del__ would block


@pytest.mark.parametrize("n", [100, 400], ids=["posthoc", "layerwise"])
def test_a_forged_pull_for_a_future_transfer_id_leaves_its_request_unharmed(cluster, n):
    p, d = cluster["prefill"], cluster["decode"]
    transfer_id = f"xfer-named-early-{n}-{uuid.uuid4().hex}"
    started = time.monotonic()
    answers = forge_pull(
        worker_addr(p.bootstrap_url), transfer_id, UNKNOWN_TIMEOUT_S + 30
    )
    assert answers[-1].err_reqs == ["forged-req"], answers
    assert "never scheduled" in (answers[-1].err_msg or ""), answers
    assert time.monotonic() - started < UNKNOWN_TIMEOUT_S + 15

    # P runs the real request named X; its decode side never asks for the KV.
    ids = prompt(n, seed=7000 + n)
    r = complete(
        p.url,
        ids,
        max_tokens=1,
        logprobs=None,
        model=model_name(p.url),
        kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id},
        timeout=120,
    )
    assert r.prompt_tokens == n
    request_done = time.monotonic()
    # X's blocks are freed (under its real request id) after the unknown
    # timeout, well before the transfer timeout
    usage = wait_no_blocks_in_use(p.url, d.url, timeout=TRANSFER_TIMEOUT_S + 60)
    freed_after = time.monotonic() - request_done
    assert usage == (0.0, 0.0), f"KV blocks still allocated (P, D usage): {usage}"
    assert freed_after < (UNKNOWN_TIMEOUT_S + TRANSFER_TIMEOUT_S) / 2 + 2, (
        f"blocks freed {freed_after:.1f} s after the request ended"
    )
    # P keeps serving: a normal P->D request right after, byte-exact.
    other = prompt(300, seed=7100 + n)
    assert_pd_byte_exact(p, d, other)
    assert httpx.get(p.url + "/health", timeout=10).status_code == 200
    usage = wait_no_blocks_in_use(p.url, d.url, timeout=60)
    assert usage == (0.0, 0.0), f"KV blocks still allocated (P, D usage): {usage}"
    assert httpx.get(p.url + "/health", timeout=10).status_code == 200
    t = layerwise_transfer(p.bootstrap_url, transfer_id)
    stats = layerwise_transfers(p.bootstrap_url)
    assert t["outcome"] and t["outcome"].startswith("expired"), t
    assert "never scheduled" in t["outcome"], t
    assert t["bytes_written"] == 0, t
    assert stats["totals"]["waiting_unknown"] == 0, stats["totals"]
    log = p.log_text()
    assert "EngineCore encountered a fatal error" not in log
    assert "AssertionError" not in log
    assert kv_usage(p.url) == 0.0


@pytest.mark.parametrize("give_up_s", [50.0, float("nan"), -1.0])
def test_a_decode_that_gives_up_before_the_prefill_may_answer_is_refused(
    cluster, give_up_s
):
    """P may answer a pull up to MOONCAKE_LAYERWISE_TIMEOUT_S + the bound on an
    in-flight write (20 + 65 s here) after it: a decode side that gives up (and
    frees the blocks) after 50 s, or says nonsense, is refused at once, naming
    the values; P keeps serving."""
    p = cluster["prefill"]
    started = time.monotonic()
    answers = forge_pull(
        worker_addr(p.bootstrap_url),
        f"xfer-limits-{uuid.uuid4().hex}",
        30,
        limits={"pull_give_up_s": give_up_s},
    )
    assert time.monotonic() - started < 10, "refused at once, not after a timeout"
    msg = answers[-1].err_msg or ""
    if give_up_s > 0:
        assert (
            "gives up after 50 s" in msg
            and f"MOONCAKE_LAYERWISE_TIMEOUT_S={TRANSFER_TIMEOUT_S}" in msg
        ), answers
    else:
        assert "invalid pull timeout" in msg, answers
    assert httpx.get(p.url + "/health", timeout=10).status_code == 200
    stats = httpx.get(
        p.bootstrap_url + "/layerwise/transfers",
        timeout=10,
        headers=bootstrap_headers(),
    ).json()
    assert stats["totals"]["waiting_unknown"] == 0, stats["totals"]


def test_a_decode_within_the_limits_is_served_and_real_decodes_send_their_limits(
    cluster,
):
    """The real D sends its limits (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 = 540 s)
    with every pull; P accepts them and the transfer is byte-exact."""
    p, d = cluster["prefill"], cluster["decode"]
    ids = prompt(400, seed=7300)
    assert_pd_byte_exact(p, d, ids)
    # P warns once per decode session whose requests carry no limits: only the
    # forged requests of this module (session 127.0.0.1:1) may have none
    log = p.log_text().splitlines()
    without = [line for line in log if "carries no pull timeout" in line]
    assert all("127.0.0.1:1 " in line for line in without), without


def test_two_prefill_requests_with_one_transfer_id_send_neither_and_free_both(cluster):
    """A client gives two requests on P the same transfer_id; then D asks for it.
    P cannot tell whose KV D wants, and writing both would hand D a mix: neither
    is sent, D's request ends with an error naming both (the pinned
    kv_load_failure_policy, fail), and every block on P and D is freed (before,
    the second request's blocks stayed allocated for good). P keeps serving."""
    p, d = cluster["prefill"], cluster["decode"]
    transfer_id = f"xfer-twice-{uuid.uuid4().hex}"
    params = {"do_remote_decode": True, "transfer_id": transfer_id}
    for seed in (7300, 7301):  # both end on P before D asks: both are live
        r = complete(
            p.url,
            prompt(400, seed=seed),
            max_tokens=1,
            logprobs=None,
            kv_transfer_params=params,
            timeout=120,
        )
        assert r.prompt_tokens == 400
    with pytest.raises(RequestFailed):
        complete(
            d.url,
            prompt(400, seed=7300),
            max_tokens=3,
            logprobs=None,
            kv_transfer_params={
                "do_remote_prefill": True,
                "remote_bootstrap_addr": p.bootstrap_url,
                "remote_engine_id": engine_id(p.bootstrap_url),
                "transfer_id": transfer_id,
            },
            timeout=120,
        )
    usage = wait_no_blocks_in_use(p.url, d.url, timeout=TRANSFER_TIMEOUT_S + 60)
    assert usage == (0.0, 0.0), f"KV blocks still allocated (P, D usage): {usage}"
    t = layerwise_transfer(p.bootstrap_url, transfer_id)
    assert "neither is sent" in (t["outcome"] or ""), t
    assert t["bytes_written"] == 0, t
    other = prompt(300, seed=7302)
    assert_pd_byte_exact(p, d, other)
