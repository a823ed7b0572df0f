"""P's forward thread pays O(1) per layer for layer-wise push, whatever the batch:
it records the layer; the transfers' writes are built on the issuer thread."""

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

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (  # noqa: E501
    LayerwiseMetadata,
)

TRANSFERS = 32


def test_the_layer_hook_builds_no_transfer_writes_on_the_forward_thread(loop):
    engine = LayerwiseEngine()
    sender = make_layerwise_sender(engine)
    callers: list[int] = []
    real = sender.tracker.layer_computed

    def spy(slots):
        callers.append(threading.get_ident())
        return real(slots)

    sender.tracker.layer_computed = spy
    futs = [
        loop.submit(sender.push(f"t{i}", lw_dest(f"d{i}:1", first=100 + 2 * i)))
        for i in range(TRANSFERS)
    ]
    assert wait_until(lambda: sender.tracker.num_unannounced() == TRANSFERS)
    sender.on_metadata(
        LayerwiseMetadata(
            steps=[
                lw_step(f"t{i}", blocks=(2 * i + 1, 2 * i + 2))
                for i in range(TRANSFERS)
            ]
        )
    )
    sender.layer_saved("l0", LW_TENSOR)  # the forward thread: this test's
    assert [f.result(5) for f in futs] == [None] * TRANSFERS
    assert sum(engine.writes.values()) == TRANSFERS
    assert callers, "no layer was turned into writes"
    assert threading.get_ident() not in callers, (
        "the forward thread built the transfers' writes of a layer itself "
        f"({TRANSFERS} transfers in the step: its per-layer cost grows with them)"
    )
    sender.shutdown()


def test_the_next_step_issues_the_previous_steps_layers_first(loop):
    """With the issuer not running, the next step's on_metadata issues the
    previous step's layers against that step's state: nothing computed is lost."""
    engine = LayerwiseEngine()
    sender = make_layerwise_sender(engine)
    with sender._issue_ready:
        sender._stopping = True
        sender._issue_ready.notify()
    sender._issuer.join(5)
    assert not sender._issuer.is_alive()
    fut = loop.submit(sender.push("a", lw_dest("d:1")))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("a")]))
    sender.layer_saved("l0", LW_TENSOR)
    assert not fut.done() and engine.writes == {}
    sender.on_metadata(LayerwiseMetadata())  # the next step: nothing of "a" in it
    assert fut.result(5) is None
    assert engine.writes == {"d:1": 1}
    sender.shutdown()


def test_the_forward_threads_cpu_time_is_its_own():
    """forward_thread_cpu_s counts the thread that runs the steps, not the
    process: another thread burning CPU does not move it."""
    sender = make_layerwise_sender()
    assert sender.snapshot()["totals"]["forward_thread_cpu_s"] is None
    busy, release = threading.Event(), threading.Event()

    def forward():  # the forward thread: one step, busy for 0.2 s, then waits
        sender.on_metadata(LayerwiseMetadata())
        spin(0.2)
        busy.set()
        release.wait(10)

    th = threading.Thread(target=forward)
    th.start()
    assert busy.wait(10)
    first = sender.snapshot()["totals"]["forward_thread_cpu_s"]
    spin(0.3)  # this thread, not the forward one
    second = sender.snapshot()["totals"]["forward_thread_cpu_s"]
    release.set()
    th.join()
    assert first >= 0.2, first
    assert second - first < 0.05, (first, second)
    sender.shutdown()


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
