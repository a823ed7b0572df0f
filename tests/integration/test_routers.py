"""Layer-wise push behind the dispatchers deployments run (harness/routers.py).

The same layer-wise P and D (the shared "layerwise" cluster) behind:
- vLLM's own router (``vllm-router`` in PD mode, ``--kv-connector mooncake``),
  which sends D's request only after P has answered: the KV still comes over
  and the answers are right, but nothing can overlap the prefill. P counts
  every such transfer as "destination after prefill" (``/layerwise/transfers``
  and ``/metrics``) and warns, naming the cause;
- upstream's example Mooncake proxy, which sends both requests at once: most
  of the KV is written before P's prefill ends, and no transfer is counted.
"""

from __future__ import annotations

import httpx
import pytest

from harness.correctness import compare, reference_completion
from harness.metrics import counter, counter_when, samples
from harness.pd_client import (
    bootstrap_headers,
    complete,
    layerwise_transfers,
    model_name,
)
from harness.prompts import random_prompt as prompt
from harness.routers import upstream_proxy, vllm_router
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

pytestmark = pytest.mark.integration

MAX_BATCHED = 256
LATE_METRIC = "vllm_mooncake_ext_layerwise_destination_after_prefill_total"
# prompt tokens D's connector loaded (vLLM's own counter: a dispatcher may drop
# the answer's usage.prompt_tokens_details, as vllm-router 0.1.17 does)
D_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
# the share of a concurrent dispatcher's layer-wise bytes written before P's
# prefill ends: 2,048 tokens in 8 chunks leave at most the last chunk's
# (1/8 = 12.5%) to be written after it
MIN_SHARE_BEFORE_PREFILL_END = 0.8


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    cl = shared_cluster("layerwise")
    assert cl["prefill"].spec.max_num_batched_tokens == MAX_BATCHED
    return cl


def transfers(p) -> dict:
    return layerwise_transfers(p.bootstrap_url)


def late_metric(p) -> float:
    text = httpx.get(
        p.bootstrap_url + "/metrics", timeout=10, headers=bootstrap_headers()
    ).text
    (value,) = samples(text, LATE_METRIC)
    return value


def through(dispatcher, p, d, prompts: list[list[int]]) -> list[dict]:
    """Each prompt sent through ``dispatcher``, checked against a from-scratch
    reference and for D's connector loading the whole prompt's KV (it came from
    P); returns P's timelines of the transfers they made."""
    before = {t["transfer_id"] for t in transfers(p)["transfers"]}
    model = model_name(p.url)
    for ids in prompts:
        hits = counter(d.url, D_EXTERNAL_HITS)
        got = complete(dispatcher.url, ids, max_tokens=3, logprobs=5, model=model)
        ref = reference_completion(p.url, ids, max_tokens=3)
        check = compare(got, ref, expected_cached_tokens=None)
        assert check.ok, (check.problems, dispatcher.log_tail())
        # the whole prompt, or all of it but the token D computes itself (releases
        # count this differently from usage.prompt_tokens_details); vLLM updates
        # its counters just after it answers
        lo, hi = cached_tokens_of_whole_prompt(len(ids)), len(ids)
        loaded = (
            counter_when(d.url, D_EXTERNAL_HITS, lambda v, h=hits, lo=lo: v - h >= lo)
            - hits
        )
        assert lo <= loaded <= hi, (
            f"D's connector loaded {loaded:g} of the prompt's {len(ids)} tokens"
        )
    new = [t for t in transfers(p)["transfers"] if t["transfer_id"] not in before]
    assert len(new) == len(prompts), new
    assert all(t["outcome"] == "completed" and t["layerwise"] for t in new), new
    return new


def test_behind_vllm_router_every_transfer_is_counted_after_prefill(cluster, tmp_path):
    p, d = cluster["prefill"], cluster["decode"]
    counted, metric = (
        transfers(p)["totals"]["destination_after_prefill"],
        late_metric(p),
    )
    prompts = [prompt(1024, seed=3100 + i) for i in range(3)]
    with vllm_router(p, d, tmp_path) as router:
        new = through(router, p, d, prompts)
    for t in new:
        assert t["destination_after_prefill"], t
        assert t["destination_at"] >= t["prefill_end"], t
        assert t["bytes_before_prefill_end"] == 0, t
    assert transfers(p)["totals"]["destination_after_prefill"] == counted + 3
    assert late_metric(p) == metric + 3
    warned = [
        ln
        for ln in p.log_path.read_text(errors="replace").splitlines()
        if "the decode request arrived after prefill" in ln
    ]
    assert warned and "one after the other" in warned[0], warned


def test_behind_upstreams_proxy_most_bytes_are_written_before_prefill_ends(
    cluster, tmp_path
):
    p, d = cluster["prefill"], cluster["decode"]
    counted = transfers(p)["totals"]["destination_after_prefill"]
    with upstream_proxy(p, d, tmp_path) as proxy:
        (t,) = through(proxy, p, d, [prompt(2048, seed=3200)])
    assert not t["destination_after_prefill"], t
    share = t["bytes_before_prefill_end"] / t["bytes_written"]
    assert share >= MIN_SHARE_BEFORE_PREFILL_END, (
        f"{share:.0%} of the layer-wise bytes were written before P's prefill ended "
        f"behind a dispatcher that sends P and D at once: {t}"
    )
    assert transfers(p)["totals"]["destination_after_prefill"] == counted
