"""connector/layerwise.py: what P's scheduler tells its worker each step."""

from types import SimpleNamespace as NS

import pytest

from connector.io_affinity import parse_cpu_list
from connector.layerwise import LayerwiseScheduler, layerwise_enabled, layerwise_min_tokens


def request(req_id, prompt_len, status=None):
    return NS(request_id=req_id, num_prompt_tokens=prompt_len, status=status)


def output(new=(), cached=(), resumed=(), num_scheduled=None):
    return NS(
        scheduled_new_reqs=[NS(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
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
    assert s.track(request("r", 300), "x")
    m1 = s.build(output(new=[("r", [1, 2], 0)], num_scheduled={"r": 128}))
    assert m1.steps == [("x", "r", [1, 2], 128, 300)]
    m2 = s.build(output(cached=[("r", [3], 128)], num_scheduled={"r": 172}))
    assert m2.steps == [("x", "r", [1, 2, 3], 300, 300)]
    # decoding on P afterwards: no more steps for the transfer
    m3 = s.build(output(cached=[("r", None, 300)], num_scheduled={"r": 1}))
    assert m3.steps == []


def test_preempted_request_resumes_with_new_blocks():
    s = LayerwiseScheduler(min_tokens=0)
    s.track(request("r", 300), "x")
    s.build(output(new=[("r", [1, 2], 0)], num_scheduled={"r": 128}))
    m = s.build(output(cached=[("r", [7, 8, 9], 0)], resumed=["r"], num_scheduled={"r": 300}))
    assert m.steps == [("x", "r", [7, 8, 9], 300, 300)]


def test_short_prompts_take_the_posthoc_path():
    s = LayerwiseScheduler(min_tokens=256)
    assert not s.track(request("r", 100), "x")
    assert s.build(output(new=[("r", [1], 0)], num_scheduled={"r": 100})).steps == []


def test_finish_and_abort_are_reported_once():
    from vllm.v1.request import RequestStatus

    s = LayerwiseScheduler(min_tokens=0)
    s.track(request("a", 10), "xa")
    s.track(request("b", 10), "xb")
    s.request_finished(request("a", 10, RequestStatus.FINISHED_LENGTH_CAPPED), [1], True, "xa")
    s.request_finished(request("b", 10, RequestStatus.FINISHED_ABORTED), [2], True, "xb")
    s.request_finished(request("c", 10, RequestStatus.FINISHED_ABORTED), [], False, "xc")
    m = s.build(output())
    assert m.finished == [("xa", "a", [1], 10, False), ("xb", "b", [2], 10, True)]
    assert m.aborted == ["xc"]
    assert not s.build(output())


def test_env_parsing(monkeypatch):
    monkeypatch.delenv("MOONCAKE_LAYERWISE", raising=False)
    assert not layerwise_enabled()
    monkeypatch.setenv("MOONCAKE_LAYERWISE", "1")
    assert layerwise_enabled()
    monkeypatch.setenv("MOONCAKE_LAYERWISE_MIN_TOKENS", "abc")
    with pytest.raises(ValueError, match="MOONCAKE_LAYERWISE_MIN_TOKENS"):
        layerwise_min_tokens()
    assert parse_cpu_list("0,2-3") == {0, 2, 3}
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")
