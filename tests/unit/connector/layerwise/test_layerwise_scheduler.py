"""connector/layerwise/prefill_scheduler.py: what P's scheduler tells its worker each step
(and the layer-wise knobs of connector/common/config.py)."""

from types import SimpleNamespace as NS

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ConfigError,
    ExtConfig,
    parse_cpu_list,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_scheduler import (
    LayerwiseScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (
    ComputedStep,
    FinishedRequest,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.scheduler_extension import (
    SchedulerExtension,
)


def request(req_id, prompt_len, status=None):
    return NS(request_id=req_id, num_prompt_tokens=prompt_len, status=status)


def output(new=(), cached=(), resumed=(), num_scheduled=None):
    return NS(
        scheduled_new_reqs=[
            NS(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new
        ],
        scheduled_cached_reqs=NS(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[(b,) if b is not None else None for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=num_scheduled or {},
    )


def test_chunked_prefill_steps_carry_growing_block_lists():
    s = LayerwiseScheduler(min_tokens=100)
    s.track(request("r", 300), "x")  # tracked: the steps below are reported
    m1 = s.build(output(new=[("r", [1, 2], 0)], num_scheduled={"r": 128}))
    assert m1.steps == [ComputedStep("x", "r", (1, 2), 128, 300)]
    m2 = s.build(output(cached=[("r", [3], 128)], num_scheduled={"r": 172}))
    assert m2.steps == [ComputedStep("x", "r", (1, 2, 3), 300, 300)]
    # decoding on P afterwards: no more steps for the transfer
    m3 = s.build(output(cached=[("r", None, 300)], num_scheduled={"r": 1}))
    assert m3.steps == []


def output_with_preempted(preempted=(), **kw):
    out = output(**kw)
    out.preempted_req_ids = set(preempted)
    return out


def test_a_preempted_request_fails_its_transfer_and_is_not_pushed_any_more():
    """Preemption frees the request's blocks in the same schedule that may give
    them to another request: its transfer fails (D prefills locally) instead of
    writes reading blocks that are no longer the request's; the request is
    still reported when it finishes."""
    from vllm.v1.request import RequestStatus

    s = LayerwiseScheduler(min_tokens=0)
    s.track(request("r", 300), "x")
    s.track(request("o", 300), "y")
    s.build(
        output_with_preempted(
            new=[("r", [1, 2], 0), ("o", [3], 0)], num_scheduled={"r": 128, "o": 128}
        )
    )
    m = s.build(
        output_with_preempted(
            preempted=["r"], cached=[("o", [4], 128)], num_scheduled={"o": 172}
        )
    )
    assert m.preempted == ["x"] and bool(m)
    assert [st.transfer_id for st in m.steps] == ["y"]
    m = s.build(
        output_with_preempted(
            cached=[("r", [7, 8, 9], 0)], resumed=["r"], num_scheduled={"r": 300}
        )
    )
    assert m.steps == [] and m.preempted == []
    assert s.request_finished(
        request("r", 300, RequestStatus.FINISHED_LENGTH_CAPPED), [7, 8, 9], "x"
    )
    assert s.build(output_with_preempted()).finished == [
        FinishedRequest("x", "r", (7, 8, 9), 300, aborted=False)
    ]


def test_a_request_resumed_without_a_preemption_notice_fails_its_transfer():
    """reset_prefix_cache preempts running requests outside a step: the request
    only shows up resumed, with other blocks."""
    s = LayerwiseScheduler(min_tokens=0)
    s.track(request("r", 300), "x")
    s.build(output(new=[("r", [1, 2], 0)], num_scheduled={"r": 128}))
    m = s.build(
        output(cached=[("r", [7, 8, 9], 0)], resumed=["r"], num_scheduled={"r": 300})
    )
    assert m.preempted == ["x"] and m.steps == []


def test_short_prompts_take_the_posthoc_path():
    s = LayerwiseScheduler(min_tokens=256)
    s.track(request("r", 100), "x")  # not tracked per layer: no step is ever reported
    assert s.build(output(new=[("r", [1], 0)], num_scheduled={"r": 100})).steps == []


def test_finish_and_abort_are_reported_once():
    from vllm.v1.request import RequestStatus

    s = LayerwiseScheduler(min_tokens=0)
    s.track(request("a", 10), "xa")
    s.track(request("b", 10), "xb")
    # True: the scheduler keeps the blocks (delay free); no blocks: nothing to keep
    assert s.request_finished(
        request("a", 10, RequestStatus.FINISHED_LENGTH_CAPPED), [1], "xa"
    )
    assert s.request_finished(
        request("b", 10, RequestStatus.FINISHED_ABORTED), [2], "xb"
    )
    assert not s.request_finished(
        request("c", 10, RequestStatus.FINISHED_ABORTED), [], "xc"
    )
    m = s.build(output())
    assert m.finished == [
        FinishedRequest("xa", "a", (1,), 10, aborted=False),
        FinishedRequest("xb", "b", (2,), 10, aborted=True),
    ]
    assert m.aborted == ["xc"]
    assert not s.build(output())


def test_env_parsing():
    assert not ExtConfig.from_env({}).layerwise
    assert ExtConfig.from_env({"MOONCAKE_LAYERWISE": "1"}).layerwise
    with pytest.raises(ConfigError, match="MOONCAKE_LAYERWISE_MIN_TOKENS"):
        ExtConfig.from_env(
            {"MOONCAKE_LAYERWISE": "1", "MOONCAKE_LAYERWISE_MIN_TOKENS": "abc"}
        )
    assert parse_cpu_list("0,2-3") == {0, 2, 3}
    with pytest.raises(ConfigError):
        parse_cpu_list("3-1")


def request_with(req_id, prompt_len, **params):
    return NS(
        request_id=req_id,
        num_prompt_tokens=prompt_len,
        status=None,
        kv_transfer_params={"do_remote_decode": True, **params},
    )


def test_a_request_chooses_its_mode_over_the_threshold():
    s = LayerwiseScheduler(min_tokens=256)
    s.track(request_with("long-posthoc", 1000, mooncake_mode="posthoc"), "x1")
    s.track(request_with("short-layerwise", 100, mooncake_mode="layerwise"), "x2")
    s.track(request_with("long-default", 1000), "x3")
    m = s.build(
        output(
            new=[
                ("long-posthoc", [1], 0),
                ("short-layerwise", [2], 0),
                ("long-default", [3], 0),
            ],
            num_scheduled={
                "long-posthoc": 1000,
                "short-layerwise": 100,
                "long-default": 1000,
            },
        )
    )
    assert [st.p_req_id for st in m.steps] == ["short-layerwise", "long-default"]


@pytest.mark.parametrize(
    "bad", ["LAYERWISE", "", 1, None.__class__.__name__, ["layerwise"], "x" * 10_000]
)
def test_a_bad_mode_value_falls_back_to_the_default_with_one_warning(bad):
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise import (
        prefill_scheduler,
    )

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    prefill_scheduler.logger.addHandler(handler)
    s = LayerwiseScheduler(min_tokens=256)
    try:
        for i in range(3):
            s.track(request_with(f"r{i}", 1000, mooncake_mode=bad), f"x{i}")
    finally:
        prefill_scheduler.logger.removeHandler(handler)
    m = s.build(
        output(
            new=[(f"r{i}", [i], 0) for i in range(3)],
            num_scheduled={f"r{i}": 1000 for i in range(3)},
        )
    )
    assert len(m.steps) == 3  # the default for 1000 tokens: layer-wise
    warnings = [r for r in records if "mooncake_mode" in r.getMessage()]
    assert len(warnings) == 1
    assert all(len(r.getMessage()) < 400 for r in warnings)


def test_a_new_request_to_send_is_announced_to_the_worker_as_received():
    """P's scheduler received requests (on_new_request): the next step's metadata
    names the transfers of those P sends (do_remote_decode), and only those."""
    ext = SchedulerExtension.__new__(SchedulerExtension)
    ext.layerwise = LayerwiseScheduler(min_tokens=100)
    ext.backlog = None  # not a push source

    def new(req_id, **params):
        ext.on_new_request(NS(request_id=req_id, kv_transfer_params=params or None))

    new("a", do_remote_decode=True, transfer_id="xa")
    new("b", do_remote_prefill=True, transfer_id="xb")  # D's side of a pull
    new("c")  # no P/D
    new("d", do_remote_decode=True)  # no transfer id: upstream's path
    new("e", do_remote_decode=True, transfer_id=["not", "a", "string"])
    assert ext.layerwise.build(output()).received == ["xa"]
    assert ext.layerwise.build(output()).received == []  # told once
    ext.layerwise = None  # MOONCAKE_LAYERWISE unset: nothing to tell
    new("f", do_remote_decode=True, transfer_id="xf")
