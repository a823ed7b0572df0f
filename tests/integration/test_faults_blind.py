"""The data network cut past the transport's no-progress watchdog during a layer-wise
write, as in test_faults_cut.py, on a prefill instance whose send-queue fence cannot
read the kernel (MOONCAKE_FAULT_FENCE_BLIND: as without sock_diag and /proc/net/tcp).

The fence must fail closed: P holds the failed write for the longest time its
queued bytes can still land (the kernel's default orphan retries: 205.4 s from the
failure) and counts it; the request still ends within its deadline, and the blocks
D reuses afterwards hold no byte of it. ``python -m microbench.faults --only
link_cut_fence_blind``.
"""

from __future__ import annotations

import pytest

from harness.model import TEST_SHAPE, ensure_model
from harness.pd_client import push_stats
from microbench.faults.bench import (
    BLIND_REQUEST_DEADLINE_S,
    FaultBench,
    assert_reused_blocks_intact,
    cluster_specs,
    run_fault,
)

pytestmark = [pytest.mark.integration, pytest.mark.hosts]


@pytest.fixture(scope="module")
def bench(pd_cluster):
    specs = cluster_specs(
        str(ensure_model(TEST_SHAPE)), kernel_defaults=True, fence_blind=True
    )
    bench = FaultBench(pd_cluster(specs=specs, hosts=True), BLIND_REQUEST_DEADLINE_S)
    yield bench
    bench.close()


def test_a_write_cut_past_the_watchdog_whose_fence_cannot_read_the_kernel_is_held(
    bench,
):
    out = run_fault(bench, "link_cut_fence_blind")
    assert out.requests == 1, out  # ended: an error, or recomputed on D
    assert_reused_blocks_intact(out)
    stats = push_stats(bench.p.bootstrap_url)
    assert stats["blind_holds"] >= 1 and stats["fenced_writes"] == 0, stats
    assert stats["fence_seconds"] >= 205, stats
