"""Upstream's post-hoc path frees P's blocks as soon as its write fails (patch 0013).

Upstream's MooncakeConnector answered D with the error of a failed post-hoc
write but kept the request in reqs_need_send: an idle P held its blocks until
VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480 s). Seen as 1.6% of P's KV blocks held
for minutes after a load generator's run, whose first requests had hit
Mooncake's 30 s transfer timeout. Here the write fails because D is killed
after it asked for the KV and before P finished the prefill. P runs
upstream's path (no MOONCAKE_LAYERWISE).
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from harness.kv_usage import kv_usage, wait_no_blocks_in_use
from harness.metrics import read_when, samples, scrape
from harness.pd_client import RequestFailed, complete, pd_generate
from harness.prompts import PromptSource

pytestmark = pytest.mark.integration

FREED_WITHIN_S = (
    60.0  # far below the 480 s abort timeout, above Mooncake's 30 s transfer timeout
)


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """Upstream's post-hoc path only (no MOONCAKE_LAYERWISE); D is killed by the
    test, so it runs last on the shared "push" cluster (C the prefill side)."""
    cl = shared_cluster("push")
    assert "MOONCAKE_LAYERWISE" not in cl["c"].spec.env
    return cl


def test_a_failed_posthoc_write_frees_the_prefill_blocks(cluster):
    p, d = cluster["c"], cluster["d"]
    prompts = PromptSource(seed=21)
    pd_generate(p.url, p.bootstrap_url, d.url, prompts(200), max_tokens=1)  # warm-up
    assert wait_no_blocks_in_use(p.url, timeout=30) == (0.0,)
    with cf.ThreadPoolExecutor(5) as pool:
        # P busy with other prompts first, so the P/D request's prefill waits behind
        # seconds of work on any machine; D asks for the KV at once, then dies
        # while P still computes (a fixed sleep let a fast P finish first)
        busy = [
            pool.submit(
                complete, p.url, prompts(3500), max_tokens=1, logprobs=None, timeout=300
            )
            for _ in range(4)
        ]
        fut = pool.submit(
            pd_generate,
            p.url,
            p.bootstrap_url,
            d.url,
            prompts(3000),
            max_tokens=1,
            timeout=120,
        )
        # D holds the request, waiting for its KV
        read_when(
            lambda: sum(samples(scrape(d.url), "vllm:num_requests_waiting")),
            lambda waiting: waiting >= 1,
            timeout=30,
        )
        assert not fut.done(), "P answered before D could be killed: no failed write"
        d.kill()
        with pytest.raises(RequestFailed):
            fut.result()
        for b in busy:
            b.result()
    # P itself still serves, and its blocks come back once the write failed
    deadline = time.monotonic() + FREED_WITHIN_S
    usage = wait_no_blocks_in_use(p.url, timeout=FREED_WITHIN_S)
    assert usage == (0.0,), (
        f"P still holds {100 * usage[0]:.1f}% of its KV blocks {FREED_WITHIN_S:.0f} s after "
        "its post-hoc write to a dead decode instance failed"
    )
    assert time.monotonic() <= deadline + 5
    complete(p.url, prompts(64), max_tokens=1, logprobs=None)
    assert kv_usage(p.url) == 0.0
