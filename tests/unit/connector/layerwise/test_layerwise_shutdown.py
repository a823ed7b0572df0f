"""P's layer-wise sender writes nothing after its shutdown returned.

Shutdown waits (up to a deadline) for the write in the engine; the writes
still queued behind it never start, and their transfers end failed the normal
way (D is answered). Writes computed after shutdown are refused the same way.
"""

from __future__ import annotations

import threading
import time

from helpers import (
    LW_TENSOR,
    LayerwiseEngine,
    lw_dest,
    lw_step,
    make_layerwise_sender,
    wait_until,
)
from test_layerwise_late_destination import prefill_done

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_writers import (
    WriterPool,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (
    LayerwiseMetadata,
)


def queued_batches(sender, session: str) -> int:
    """Batches queued or running on ``session``'s writer."""
    with sender.writers._lock:
        w = sender.writers._writers.get(session)
        return 0 if w is None else w.pending


def test_a_batch_queued_when_the_sender_shuts_down_is_never_written_and_fails(loop):
    engine = LayerwiseEngine()
    gate = engine.gate("d:1")
    sender = make_layerwise_sender(engine)
    fa = loop.submit(sender.push("a", lw_dest("d:1", first=100)))
    fb = loop.submit(sender.push("b", lw_dest("d:1", first=200)))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 2)
    prefill_done(sender, "a")
    assert engine.entered["d:1"].wait(5)  # a's write is in the engine, held
    prefill_done(sender, "b")  # b's write queues behind it (one FIFO per peer)
    assert wait_until(lambda: queued_batches(sender, "d:1") == 2)
    stopper = threading.Thread(target=sender.shutdown)
    stopper.start()
    time.sleep(0.3)
    gate.set()  # a's write returns
    stopper.join(10)
    assert not stopper.is_alive()
    written_at_return = dict(engine.writes)
    assert fa.result(5) is None  # the write in progress ended normally
    err = fb.result(5)
    time.sleep(0.3)
    assert engine.writes == written_at_return == {"d:1": 1}, (
        f"written after shutdown returned: {written_at_return} -> {engine.writes}"
    )
    assert err is not None and "shutting down" in err, err
    assert sender.log.get("b").writes_dropped == 2  # one per KV tensor (slot)
    assert sender.log.get("b").outcome == err


def test_shutdown_waits_for_the_write_in_progress_before_it_returns(loop):
    engine = LayerwiseEngine()
    gate = engine.gate("d:1")
    sender = make_layerwise_sender(engine)
    fa = loop.submit(sender.push("a", lw_dest("d:1")))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    prefill_done(sender, "a")
    assert engine.entered["d:1"].wait(5)
    stopper = threading.Thread(target=sender.shutdown)
    stopper.start()
    time.sleep(0.3)
    assert stopper.is_alive(), "shutdown returned while a write was in the engine"
    gate.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert engine.writes == {"d:1": 1} and fa.result(5) is None


class HeldEvent:
    """A compute event (gpu_order.ComputeEvent) that completes when released."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def query(self) -> bool:
        return self.release.is_set()

    def synchronize(self) -> None:
        self.entered.set()
        assert self.release.wait(10), "test event never released"


def test_a_write_still_waiting_for_its_compute_at_shutdown_is_never_written(loop):
    """The writer took a's batch and waits for the layer's compute event (not
    in the engine yet) when shutdown begins: a is failed, never written."""
    engine = LayerwiseEngine()
    sender = make_layerwise_sender(engine)
    event = HeldEvent()
    sender._event_factory = lambda kv: event
    fut = loop.submit(sender.push("a", lw_dest("d:1")))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("a")]))
    sender.layer_saved("l0", LW_TENSOR)
    assert event.entered.wait(5)
    stopper = threading.Thread(target=sender.shutdown)
    stopper.start()
    time.sleep(0.3)
    event.release.set()
    stopper.join(10)
    assert not stopper.is_alive()
    err = fut.result(5)
    assert err is not None and "shutting down" in err, err
    time.sleep(0.2)
    assert engine.writes == {}


def test_a_write_computed_after_shutdown_is_refused_and_its_transfer_fails(loop):
    engine = LayerwiseEngine()
    sender = make_layerwise_sender(engine)
    fut = loop.submit(sender.push("c", lw_dest("d:1")))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    sender.shutdown()
    prefill_done(sender, "c")
    err = fut.result(5)
    assert err is not None and "shutting down" in err, err
    time.sleep(0.2)
    assert engine.writes == {}


def test_the_writer_pool_drops_queued_batches_and_waits_at_most_its_deadline():
    """The pool alone: a batch queued behind a running one is handed to drop,
    never run; shutdown waits up to its deadline for the running one and names
    its session if it still runs."""
    release = threading.Event()
    started = threading.Event()
    ran: list[int] = []
    dropped: list[tuple[str, int]] = []

    def run(session: str, batch: int) -> None:
        ran.append(batch)
        started.set()
        release.wait(10)

    pool: WriterPool[int] = WriterPool(
        run, lambda: None, None, drop=lambda s, b: dropped.append((s, b))
    )
    try:
        assert pool.submit("d:1", 1)
        assert started.wait(5)
        assert pool.submit("d:1", 2)
        t0 = time.monotonic()
        assert pool.shutdown(wait_s=0.3) == ["d:1"]  # batch 1 still runs
        assert 0.25 < time.monotonic() - t0 < 3
        assert dropped == [("d:1", 2)]
        assert not pool.submit("d:1", 3)
    finally:
        release.set()
    time.sleep(0.2)
    assert ran == [1]
