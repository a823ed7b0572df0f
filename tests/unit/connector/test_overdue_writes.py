"""A write that outlives the engine's bound (its peer is frozen or cut off) is
counted as overdue and leaves its slot to healthy peers, on C (push slots) and
on P (layer-wise writer threads, MAX_PEERS). Its write goes on: nothing of it is
freed, it only stops counting toward the cap. The total stays bounded."""

from __future__ import annotations

import threading

from helpers import wait_until

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_writers import (
    OVERDUE_FACTOR,
    WriterPool,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_server import (
    PushSlots,
)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# ---- C: push slots ---------------------------------------------------------------


def test_four_frozen_destinations_hold_the_slots_only_until_their_bound():
    clock = Clock()
    slots = PushSlots(4, overdue_after_s=65.0, clock=clock)
    frozen = [slots.begin() for _ in range(4)]
    assert None not in frozen
    assert slots.begin() is None, "a fifth push was served beside four in bound"
    clock.now += 65.5  # the four writes outlived their bound
    assert slots.overdue() == 4
    healthy = slots.begin()
    assert healthy is not None, "frozen destinations kept every push slot"
    slots.end(healthy)
    for token in frozen:
        slots.end(token)
    assert slots.overdue() == 0


def test_overdue_pushes_are_bounded_in_all():
    clock = Clock()
    slots = PushSlots(2, overdue_after_s=10.0, clock=clock)
    taken = 0
    for _ in range(100):
        if slots.begin() is not None:
            taken += 1
        clock.now += 11.0  # each one overdue before the next
    assert taken == PushSlots.OVERDUE_FACTOR * 2


# ---- P: layer-wise writer threads -------------------------------------------------


def test_frozen_decode_peers_leave_the_peer_cap_to_a_healthy_one():
    clock = Clock()
    gate = threading.Event()
    ran: list[str] = []

    def run(session, batch):
        ran.append(session)
        if session.startswith("frozen"):
            gate.wait(30)

    pool: WriterPool[int] = WriterPool(
        run, lambda: None, None, max_peers=3, overdue_after_s=65.0, clock=clock
    )
    try:
        for i in range(3):
            assert pool.submit(f"frozen{i}:1", i)
        assert wait_until(lambda: len(ran) == 3)
        assert not pool.submit("healthy:1", 9), "a fourth peer beside three in bound"
        clock.now += 66.0
        assert pool.num_overdue() == 3
        assert pool.submit("healthy:1", 9), "frozen peers kept every writer slot"
        assert wait_until(lambda: "healthy:1" in ran)
        # in all, at most OVERDUE_FACTOR x max_peers writers
        n = 0
        while pool.submit(f"frozen-more{n}:1", n) and n < 100:
            n += 1
            assert wait_until(lambda n=n: len(ran) >= 4 + n)
            clock.now += 66.0
        assert pool.num_writers() <= OVERDUE_FACTOR * 3
    finally:
        gate.set()
        pool.shutdown()
