"""D's admission of incoming transfers: a bounded number at once, the rest wait
in order, each at most its bound, then D prefills it itself."""

from types import SimpleNamespace

import pytest
from helpers import Clock

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ConfigError,
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.connector import (
    ExtMooncakeConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.decode_admission import (
    PullAdmission,
    Verdict,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.decode_timeline import (
    DecodePullTimeline,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.scheduler_extension import (
    SchedulerExtension,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorScheduler,
)


def test_pulls_beyond_the_bound_wait_and_take_free_slots():
    a = PullAdmission(max_pulls=2, wait_s=60, clock=Clock())
    assert a.ask("r1") is Verdict.ADMIT
    a.started("r1")
    assert a.ask("r2") is Verdict.ADMIT
    a.started("r2")
    assert a.ask("r3") is Verdict.WAIT and a.ask("r3") is Verdict.WAIT
    assert a.queued_since("r3") == 1000.0  # its first wait, not its latest
    assert a.ask("r1") is Verdict.ADMIT  # asked again: it holds its slot already
    a.ended(["r1"])  # its KV arrived (or its pull failed)
    assert a.ask("r3") is Verdict.ADMIT
    a.started("r3")
    assert a.queued_since("r3") is None
    assert a.ask("r4") is Verdict.WAIT  # r2 and r3 hold both slots
    a.forget("r2")  # finished another way (aborted while its KV came)
    assert a.ask("r4") is Verdict.ADMIT


def test_a_request_that_waited_its_whole_bound_is_prefilled_locally():
    c = Clock()
    a = PullAdmission(max_pulls=1, wait_s=30, clock=c)
    a.started("r1")
    assert a.ask("r2") is Verdict.WAIT
    assert a.queued_since("r2") == 1000.0
    c.now = 1029.9
    assert a.ask("r2") is Verdict.WAIT
    c.now = 1030.0
    assert a.ask("r2") is Verdict.PREFILL_LOCALLY
    assert a.queued_since("r2") is None
    # asked again (its local blocks could not be allocated yet): still local, no
    # second wait
    c.now = 1031.0
    assert a.ask("r2") is Verdict.PREFILL_LOCALLY
    a.forget("r2")
    assert a.ask("r2") is Verdict.WAIT  # a new request under that id waits anew


def test_a_request_that_finishes_while_waiting_leaves_the_queue():
    a = PullAdmission(max_pulls=1, wait_s=30, clock=Clock())
    a.started("r1")
    assert a.ask("r2") is Verdict.WAIT
    a.forget("r2")
    assert a.queued_since("r2") is None
    assert a.ask("r3") is Verdict.WAIT  # r1 still holds the slot


def test_no_bound_admits_every_pull():
    a = PullAdmission(max_pulls=0, wait_s=30, clock=Clock())
    for i in range(100):
        assert a.ask(f"r{i}") is Verdict.ADMIT
        a.started(f"r{i}")
    assert all(a.queued_since(f"r{i}") is None for i in range(100))


def test_the_wait_is_kept_below_ps_hold_for_the_pull():
    cfg = ExtConfig.from_env({})
    assert (cfg.decode_max_pulls, cfg.decode_pull_wait_s) == (8, 120.0)
    short = ExtConfig.from_env({"MOONCAKE_LAYERWISE_TIMEOUT_S": "20"})
    assert short.decode_pull_wait_s == 15.0
    with pytest.raises(ConfigError, match="MOONCAKE_DECODE_PULL_WAIT_S=20"):
        ExtConfig.from_env(
            {
                "MOONCAKE_LAYERWISE_TIMEOUT_S": "20",
                "MOONCAKE_DECODE_PULL_WAIT_S": "20",
            }
        )
    with pytest.raises(ConfigError, match="MOONCAKE_DECODE_MAX_PULLS"):
        ExtConfig.from_env({"MOONCAKE_DECODE_MAX_PULLS": "-1"})


# ---- through the scheduler connector ---------------------------------------------
def _decode_scheduler(admission: PullAdmission) -> ExtMooncakeConnectorScheduler:
    ext = SchedulerExtension.__new__(SchedulerExtension)
    ext.push = SimpleNamespace(handles=lambda r: False, prefill_timer=None)
    ext.pull_timeline = DecodePullTimeline(clock=admission._clock)
    ext.admission = admission
    ext.backlog = None  # not a push source
    s = ExtMooncakeConnectorScheduler.__new__(ExtMooncakeConnectorScheduler)
    s.ext = ext
    s.is_kv_producer, s.is_kv_consumer = False, True
    return s


def _pull(rid: str):
    params = {
        "do_remote_prefill": True,
        "transfer_id": f"t-{rid}",
        "remote_engine_id": "p",
        "remote_bootstrap_addr": "http://p:8998",
    }
    return SimpleNamespace(request_id=rid, kv_transfer_params=params)


@pytest.fixture
def upstream_matches(monkeypatch):
    """Upstream's answer for a pull of 512 prompt tokens (its own code reads the
    prompt and the role; what it answers is what is bounded here)."""
    monkeypatch.setattr(
        MooncakeConnectorScheduler,
        "get_num_new_matched_tokens",
        lambda self, request, n: (
            (512 - n, True)
            if request.kv_transfer_params.get("do_remote_prefill")
            else (0, False)
        ),
    )


def test_the_scheduler_holds_back_pulls_beyond_the_bound(upstream_matches):
    c = Clock()
    s = _decode_scheduler(PullAdmission(max_pulls=1, wait_s=30, clock=c))
    first, second, third = _pull("r1"), _pull("r2"), _pull("r3")
    assert s.get_num_new_matched_tokens(first, 0) == (512, True)
    s.ext.seen_alloc(first, 512)  # allocated: its pull goes to P
    # the next ones stay in D's waiting queue without blocks (vLLM skips them)
    assert s.get_num_new_matched_tokens(second, 0) == (None, False)
    c.now += 5
    assert s.get_num_new_matched_tokens(third, 0) == (None, False)
    # a local request (no pull) is not held back
    assert s.get_num_new_matched_tokens(
        SimpleNamespace(request_id="local", kv_transfer_params={}), 0
    ) == (0, False)
    s.ext.push.on_connector_output = lambda output: None
    # the first pull's end reaches the scheduler: the next in order may start
    s.ext.on_connector_output(
        SimpleNamespace(finished_recving={"r1"}, kv_connector_worker_meta=None)
    )
    assert s.get_num_new_matched_tokens(second, 0) == (512, True)
    s.ext.seen_alloc(second, 512)
    timeline = s.ext.finished_params(second, None)["mooncake_timeline"]
    assert timeline["queued"] == 1000.0 and timeline["allocated"] == 1005.0
    # the third waited its whole bound: D prefills it (upstream then sends P the
    # block-less pull that frees P's copy)
    c.now += 30
    assert s.get_num_new_matched_tokens(third, 0) == (0, False)
