"""Faults on two hosts (network namespaces), with real instances and the real engine.

The CI subset of the fault matrix (microbench/faults): each capability across the
link, P's link down for less than the transfer timeout and past the engine's call
timeout (a cut past every timeout: test_faults_cut.py), transfers after idle gaps,
P killed mid-transfer and restarted, and 20 client disconnects mid layer-wise
transfer. After each: every request ended within its deadline, no wrong answer, no
KV block left allocated on a surviving instance, and a fresh P->D request served
(the restarted peer too, D never restarted). The full matrix:
``python -m microbench.faults``.
"""

from __future__ import annotations

import pytest

from harness.model import TEST_SHAPE, ensure_model
from microbench.faults.bench import FaultBench, Outcome, cluster_specs, run_fault

pytestmark = [pytest.mark.integration, pytest.mark.hosts]


@pytest.fixture(scope="module")
def bench(pd_cluster):
    """The bench's own cluster (P and D armed with its fault hooks), each on a host of
    its own; pd_cluster checks that the topology is gone afterwards."""
    bench = FaultBench(
        pd_cluster(specs=cluster_specs(str(ensure_model(TEST_SHAPE))), hosts=True)
    )
    yield bench
    bench.close()


def assert_held(outcome, *, errors_allowed: bool) -> None:
    assert outcome.holds, outcome
    assert outcome.lost == 0, outcome
    assert outcome.wrong == 0, outcome
    assert outcome.stranded_runs == 0, outcome
    assert len(outcome.recovery_s) == outcome.runs, outcome
    if not errors_allowed:
        assert outcome.ended_with_error == 0, outcome


def test_capabilities_across_hosts(bench):
    """Post-hoc pull, layer-wise push and prefix push, every byte over the veth link."""
    out = run_fault(bench, "no_fault")
    assert out.requests == 3 and out.ok == 3, out
    assert_held(out, errors_allowed=False)


def test_link_down_shorter_than_the_timeouts(bench):
    out = run_fault(bench, "link_down_short")
    assert out.ok == 1, out  # the writes resumed: the request succeeded, from right KV
    assert_held(out, errors_allowed=False)


def test_link_down_past_the_engines_call_timeout_is_not_an_end(bench):
    """Cut between MC_TRANSFER_TIMEOUT and the transport's no-progress watchdog: the
    window in which the engine's own call returns -1 while its bytes still land."""
    out = run_fault(bench, "link_down_engine_timeout")
    assert out.requests == 1 and out.ok == 1, out  # from P's KV, the transfer completed
    assert_held(out, errors_allowed=False)


def test_push_source_link_down_past_the_engines_call_timeout_is_not_an_end(bench):
    """The same window for C's /push_blocks write: C's write ends ok once the link
    is back; D, past the push's budget, answers from its own prefill meanwhile."""
    out = run_fault(bench, "push_link_down_engine_timeout")
    assert out.requests == 1 and out.ok == 1, out
    assert_held(out, errors_allowed=False)


def test_transfers_after_idle_gaps_end_within_their_deadline(bench):
    """Layer-wise transfers after 5 s and 30 s with no traffic on the engines' TCP
    connections (the full row adds 100 s): each ends within its deadline, from P's
    KV or with a clear error, never stuck."""
    out = Outcome("tcp_idle_gap")
    out.runs = 1
    bench.tcp_idle_gap(out, gaps=(5.0, 30.0))
    assert out.requests == 3, out
    assert_held(out, errors_allowed=True)


def test_prefill_killed_mid_transfer_then_restarted(bench):
    out = run_fault(bench, "kill_prefill")
    assert_held(out, errors_allowed=True)


def test_decode_request_aborted_mid_transfer_20_times(bench):
    out = run_fault(bench, "abort_decode_x20")
    assert out.requests == 20, out
    assert_held(out, errors_allowed=True)
