"""D's pull timeline: each event once, in order, bounded, handed back once."""

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise import (
    decode_timeline,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.decode_timeline import (
    DecodePullTimeline,
)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_pull_is_timed_from_allocation_to_finish():
    c = Clock()
    tl = DecodePullTimeline(clock=c)
    c.t = 1.0
    tl.allocated("r1")
    c.t = 2.0
    tl.step_scheduled({"other": 1})
    tl.kv_arrived(["r1", "unknown"])
    c.t = 2.5
    tl.kv_arrived(["r1"])  # reported twice: the first report counts
    tl.step_scheduled({"other": 1})  # a step without it
    c.t = 3.0
    tl.step_scheduled({"r1": 1, "other": 1})
    c.t = 3.5
    tl.step_scheduled({"r1": 1})  # later steps do not move it
    c.t = 4.0
    assert tl.finished("r1") == {
        "allocated": 1.0,
        "queued": None,
        "kv_arrived": 2.0,
        "scheduled": 3.0,
        "finished": 4.0,
    }
    assert tl.finished("r1") is None and len(tl) == 0
    assert tl.finished("never-timed") is None


def test_a_request_scheduled_before_its_kv_arrived_is_not_marked_scheduled():
    c = Clock()
    tl = DecodePullTimeline(clock=c)
    tl.allocated("r1")
    c.t = 1.0
    tl.step_scheduled({"r1": 1})  # e.g. not a pull step: nothing arrived yet
    c.t = 2.0
    out = tl.finished("r1")  # aborted while waiting
    assert out["kv_arrived"] is None and out["scheduled"] is None
    assert out["finished"] == 2.0


def test_tracking_is_bounded(monkeypatch):
    monkeypatch.setattr(decode_timeline, "MAX_TRACKED", 3)
    tl = DecodePullTimeline()
    for i in range(5):
        tl.allocated(f"r{i}")
    assert len(tl) == 3 and tl.finished("r4") is None
