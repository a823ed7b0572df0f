"""Baseline P->D transfer between two real vLLM instances and the real Mooncake engine.

P (kv_producer) prefills, D (kv_consumer) pulls the KV over the transfer engine
(TCP on loopback) and decodes. A second decode instance has the fault injection
armed (one received block zeroed) so the correctness check is seen going red.
max_num_batched_tokens is below the longer prompt, forcing chunked prefill.
"""

from __future__ import annotations

import os
import random

import pytest

from harness.correctness import compare, reference_completion
from harness.launcher import Cluster, InstanceSpec, InstanceStartError
from harness.model import ModelShape, SPECIAL_TOKENS, ensure_model
from harness.pd_client import pd_generate

pytestmark = pytest.mark.integration

MAX_BATCHED = 256  # below the 600-token prompt: chunked prefill on P


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_model(ModelShape()))


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    common = dict(model=model_dir, kv_cache_gib=2, max_model_len=4096,
                  max_num_batched_tokens=MAX_BATCHED,
                  extra_args=["--enable-prompt-tokens-details"])
    specs = [
        InstanceSpec("prefill", role="kv_producer", cores="0", **common),
        InstanceSpec("decode", role="kv_consumer", cores="1", **common),
        InstanceSpec("decode_faulty", role="kv_consumer", cores="1",
                     env={"VMP_FAULT_ZERO_RECV_BLOCK": "0"}, **common),
    ]
    c = Cluster(specs, tmp_path_factory.mktemp("logs"))
    with c:
        yield c


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(len(SPECIAL_TOKENS), ModelShape().vocab_size - 1) for _ in range(n)]


@pytest.mark.parametrize("n", [300, 600], ids=["single-chunk", "chunked-prefill"])
def test_kv_lands_byte_exact(cluster, n):
    p, d = cluster["prefill"], cluster["decode"]
    ids = prompt(n, seed=n)
    r = pd_generate(p.url, p.bootstrap_url, d.url, ids, max_tokens=4, logprobs=5)
    ref = reference_completion(p.url, ids, max_tokens=4)
    # vLLM recomputes the last prompt token to get logits: all others come from P.
    check = compare(r.decode, ref, expected_cached_tokens=n - 1)
    assert check.ok, check.problems
    assert check.compared_tokens == 4


def test_check_goes_red_when_a_transferred_block_is_zeroed(cluster):
    p, d = cluster["prefill"], cluster["decode_faulty"]
    ids = prompt(600, seed=7)
    r = pd_generate(p.url, p.bootstrap_url, d.url, ids, max_tokens=4, logprobs=5)
    ref = reference_completion(p.url, ids, max_tokens=4)
    check = compare(r.decode, ref, expected_cached_tokens=599)
    assert not check.ok
    assert any("logprobs" in x or "top-k" in x or "tokens differ" in x for x in check.problems)
    # The transfer itself happened: the failure is the KV content, not a fallback.
    assert r.decode.cached_tokens == 599


def test_teardown_leaves_no_processes(cluster):
    pgids = [inst.proc.pid for inst in cluster.instances.values()]
    cluster.stop()
    for pgid in pgids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)


def test_start_failure_reports_log_tail(tmp_path):
    spec = InstanceSpec("broken", model=str(tmp_path / "no-such-model"), role=None)
    c = Cluster([spec], tmp_path, startup_timeout_s=120)
    with pytest.raises(InstanceStartError) as e:
        c.start()
    msg = str(e.value)
    assert "broken" in msg and "Last lines" in msg and "no-such-model" in msg
    pgid = c["broken"].log_path  # the process is gone after a failed start
    assert c["broken"].proc is None, pgid
