"""A request preempted on P: its layer-wise transfer fails, D is never told success.

Preemption frees the request's blocks in the same schedule that may hand them
to another request, whose KV the step's forward then computes into them. A
write of the preempted request still queued behind a lagging writer would read
that KV and D would be told the transfer succeeded. P's scheduler
(LayerwiseScheduler.build) passes the preemption to the worker in the step's
metadata, and the sender fails the transfer before the forward; its queued
writes are dropped.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace as NS

import torch
from helpers import sender_idle, wait_until

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_scheduler import (
    LayerwiseScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_sender import (
    LayerwiseSender,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_tracker import (
    Destination,
)

BS = 4
KV = torch.zeros(1)
D_BASES = [1_000_000, 2_000_000]
BLEN = 64


class Engine:
    """write_fn stub: logs (time, D block) of every write; the first write is held
    in the engine until the gate opens (the lagging writer)."""

    def __init__(self):
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.log: list[tuple[float, int]] = []
        self.lock = threading.Lock()

    def __call__(self, session, src, dst, lens, layout=None):
        if not self.entered.is_set():
            self.entered.set()
            assert self.gate.wait(10), "test gate never opened"
        with self.lock:
            self.log += [
                (time.monotonic(), (d - D_BASES[0]) // BLEN)
                for d in dst
                if d < D_BASES[1]
            ]
        return 0


def request(req_id, prompt_len, status=None):
    return NS(
        request_id=req_id,
        num_prompt_tokens=prompt_len,
        status=status,
        kv_transfer_params=None,
    )


def output(new=(), cached=(), resumed=(), preempted=(), num_scheduled=None):
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
        preempted_req_ids=set(preempted),
    )


def test_preemption_after_the_last_chunk_with_a_lagging_writer_fails_the_transfer(loop):
    from vllm.v1.request import RequestStatus

    engine = Engine()
    cfg = ExtConfig(layerwise=True, layerwise_timeout_s=30, engine_transfer_timeout_s=5)
    sender = LayerwiseSender(
        engine,
        {"l0": [0, 1]},
        [10_000, 20_000],
        BLEN,
        BS,
        cfg,
        event_factory=lambda t: None,
    )
    sched = LayerwiseScheduler(min_tokens=0)
    sched.track(request("ra", 8), "A")
    sched.track(request("rb", 8), "B")
    # D asked for both; A's blocks on D are 100.., B's 200..
    fa = loop.submit(sender.push("A", Destination("d:1", D_BASES, [100, 101])))
    fb = loop.submit(sender.push("B", Destination("d:1", D_BASES, [200, 201])))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 2)
    # step 1: A's whole prompt (its last chunk); its write is held in the engine
    sender.on_metadata(
        sched.build(output(new=[("ra", [1, 2], 0)], num_scheduled={"ra": 8}))
    )
    sender.layer_saved("l0", KV)
    assert engine.entered.wait(5)
    # step 2: B's whole prompt; its write queues behind A's (the writer lags)
    sender.on_metadata(
        sched.build(output(new=[("rb", [3, 4], 0)], num_scheduled={"rb": 8}))
    )
    sender.layer_saved("l0", KV)
    # step 3: P preempts B (its blocks 3, 4 go to another request in this step)
    preempted_at = time.monotonic()
    sender.on_metadata(sched.build(output(preempted=["rb"])))
    engine.gate.set()
    assert fa.result(5) is None
    err = fb.result(5)
    assert err is not None, (
        "D was told B succeeded: its KV was read from blocks P preempted"
    )
    assert "preempted" in err
    assert not [b for t, b in engine.log if b >= 200 and t >= preempted_at], (
        "a write of B ran after its request was preempted"
    )
    # B resumes with other blocks and finishes: P frees them under B's request id
    m = sched.build(
        output(cached=[("rb", [7, 8], 0)], resumed=["rb"], num_scheduled={"rb": 8})
    )
    assert m.steps == []
    sender.on_metadata(m)
    sched.request_finished(
        request("ra", 8, RequestStatus.FINISHED_LENGTH_CAPPED), [1, 2], "A"
    )
    sched.request_finished(
        request("rb", 8, RequestStatus.FINISHED_LENGTH_CAPPED), [7, 8], "B"
    )
    sender.on_metadata(sched.build(output()))
    assert wait_until(lambda: sender_idle(sender))
    assert sender.poll() == {"ra", "rb"}
    sender.shutdown()
