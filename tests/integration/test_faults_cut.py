"""The data network cut past the transport's no-progress watchdog during a layer-wise
write, with real instances and the real engine, on hosts that keep the kernel's
default orphan retries: there a connection the transport dropped retransmits what it
had queued once the network is back, so bytes of a write the engine reported FAILED
can still land.

After the cut: the faulted request ended (an error, or D recomputed) within its
deadline; D, filled right after that end with requests that take every block it
can hand out, still answers each of them from its prefix cache exactly as a
from-scratch reference after the late-byte window (a late byte in any reused block
changes an answer); no KV block is left allocated; a fresh P->D request is served.
With the send-queue fence disabled, reused blocks were found changed
(docs/results/2026-11-27-faults-cut.md). The push row and 3 runs of each:
``python -m microbench.faults --only
link_cut_past_progress_deadline,push_link_cut_past_progress_deadline``.
"""

from __future__ import annotations

import pytest

from harness.model import TEST_SHAPE, ensure_model
from microbench.faults.bench import (
    CUT_REQUEST_DEADLINE_S,
    FaultBench,
    assert_reused_blocks_intact,
    cluster_specs,
    run_fault,
)

pytestmark = [pytest.mark.integration, pytest.mark.hosts]


@pytest.fixture(scope="module")
def bench(pd_cluster):
    specs = cluster_specs(str(ensure_model(TEST_SHAPE)), kernel_defaults=True)
    bench = FaultBench(pd_cluster(specs=specs, hosts=True), CUT_REQUEST_DEADLINE_S)
    yield bench
    bench.close()


def test_layerwise_write_cut_past_the_watchdog_lands_nothing_in_reused_blocks(bench):
    out = run_fault(bench, "link_cut_past_progress_deadline")
    assert out.requests == 1, out  # ended: an error, or recomputed on D
    assert_reused_blocks_intact(out)
