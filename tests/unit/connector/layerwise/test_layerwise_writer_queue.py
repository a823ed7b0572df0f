"""What P's layer-wise sender records for mb7: how long a transfer's writes waited
in their peer's writer FIFO (queued -> started), and the forward thread's own CPU
time in the per-layer hook."""

from __future__ import annotations

import time

from helpers import (
    LW_TENSOR,
    LayerwiseEngine,
    lw_dest,
    make_layerwise_sender,
    wait_until,
)
from test_layerwise_late_destination import prefill_done

HELD_S = 0.3


def test_a_write_queued_behind_a_held_one_records_its_wait(loop):
    engine = LayerwiseEngine()
    gate = engine.gate("d:1")
    sender = make_layerwise_sender(engine)
    fa = loop.submit(sender.push("a", lw_dest("d:1", first=100)))
    fb = loop.submit(sender.push("b", lw_dest("d:1", first=200)))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 2)
    prefill_done(sender, "a")
    assert engine.entered["d:1"].wait(5)  # a's write is in the engine, held
    prefill_done(sender, "b")  # b's write queues behind it (one FIFO per peer)
    time.sleep(HELD_S)
    gate.set()
    assert fa.result(5) is None and fb.result(5) is None
    by_id = {t["transfer_id"]: t for t in sender.snapshot()["transfers"]}
    assert by_id["b"]["queue_wait_max_s"] >= HELD_S, by_id["b"]
    assert by_id["a"]["queue_wait_max_s"] < HELD_S / 2, by_id["a"]
    sender.shutdown()


def test_the_layer_hook_counts_its_own_cpu_time_on_steps_with_work(loop):
    cpu = [0.0]

    def cpu_clock():
        cpu[0] += 0.001  # each read: 1 ms of this thread's CPU
        return cpu[0]

    sender = make_layerwise_sender()
    sender._cpu_clock = cpu_clock
    sender.layer_saved("l0", LW_TENSOR)  # no layer-wise work this step: not counted
    fa = loop.submit(sender.push("a", lw_dest("d:1", first=100)))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    prefill_done(sender, "a")  # one layer_saved on a step with work
    assert fa.result(5) is None
    totals = sender.snapshot()["totals"]
    assert totals["layer_hook_calls"] == 1
    assert abs(totals["layer_hook_cpu_s"] - 0.001) < 1e-9
    sender.shutdown()
