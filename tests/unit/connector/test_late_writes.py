"""No byte after the end: deterministic late-write scenarios with a gated engine.

Layer-wise (P's LayerwiseSender): the writer is held inside one transfer's
write while another transfer ends by timeout or by abort. No write of the
ended transfer may run after its end was reported, and P may hand its blocks
back to the scheduler (finished_sending) only after its in-flight write
returned.

Prefix push (C's PushServer over real HTTP, D's PushReceiver): C's write is
held past D's deadline; D may end the push (and so let the request's blocks go
to another request) only once C can no longer write into them.

The same two scenarios run with two real instances in
tests/integration/test_no_late_bytes.py.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
import torch
from helpers import (
    C_SOURCE,
    filled_mirror,
    push_job,
    sender_idle,
    serve_push,
    wait_until,
)

from harness.launcher import free_port
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_sender import (
    LayerwiseSender,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_tracker import (
    Destination,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (
    ComputedStep,
    FinishedRequest,
    LayerwiseMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_server import (
    PushServer,
)

BS = 4
KV = torch.zeros(1)  # layer_saved only needs a tensor (CPU: no event)


class GatedEngine:
    """write_fn stub: records every write under a label (its session, or what
    ``label`` says); writes with a gated label block until the gate opens."""

    def __init__(self, label=None):
        self.label = label or (lambda session, dst: session)
        self.log: list[tuple[float, str, tuple[int, ...]]] = []
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def gate(self, session: str) -> threading.Event:
        self.gates[session] = threading.Event()
        self.entered[session] = threading.Event()
        return self.gates[session]

    def __call__(self, session, src, dst, lens, layout=None) -> int:
        label = self.label(session, dst)
        if label in self.gates:
            self.entered[label].set()
            assert self.gates[label].wait(10), "test gate never opened"
        with self.lock:
            self.log.append((time.monotonic(), label, tuple(dst)))
        return 0

    def writes_to(self, session: str) -> list[float]:
        with self.lock:
            return [t for t, s, _ in self.log if s == session]


def make_sender(engine, timeout_s=0.3):
    cfg = ExtConfig(
        layerwise=True, layerwise_timeout_s=timeout_s, engine_transfer_timeout_s=5
    )
    return LayerwiseSender(
        engine,
        {"l0": [0, 1]},
        [10_000, 20_000],
        64,
        BS,
        cfg,
        event_factory=lambda t: None,
    )


D_BASES = [1_000_000, 2_000_000]


def dest(session, first):
    return Destination(session, D_BASES, [first, first + 1])


def by_transfer(session, dst):
    """Label of a write into one decode instance: A's blocks are 100.., B's 200.."""
    block = (
        (dst[0] - D_BASES[0]) // 64
        if dst[0] < D_BASES[1]
        else (dst[0] - D_BASES[1]) // 64
    )
    return "A" if block < 150 else "B"


def step(tid, blocks=(1, 2), tokens=8):
    return ComputedStep(tid, "p" + tid, tuple(blocks), tokens, tokens)


def start_a_blocked_then_b_queued(sender, engine, loop):
    """A's write is inside the engine (gated); B's write to the same decode
    instance is queued behind it."""
    gate_a = engine.gate("A")
    fa = loop.submit(sender.push("A", dest("d:1", 100)))
    fb = loop.submit(sender.push("B", dest("d:1", 200)))
    # D's addresses arrive first and wait for P's scheduler to announce the transfers
    assert wait_until(lambda: {"A", "B"} <= set(sender.tracker._pending))
    sender.on_metadata(LayerwiseMetadata(steps=[step("A", (1, 2))]))
    sender.layer_saved("l0", KV)  # A's write: into the engine, held there
    assert engine.entered["A"].wait(5)
    sender.on_metadata(LayerwiseMetadata(steps=[step("B", (3, 4))]))
    sender.layer_saved(
        "l0", KV
    )  # the next step computes B: its write queues behind A's
    return gate_a, fa, fb


def test_layerwise_queued_write_of_timed_out_transfer_never_runs(loop):
    engine = GatedEngine(by_transfer)
    sender = make_sender(engine, timeout_s=0.3)
    gate_a, fa, fb = start_a_blocked_then_b_queued(sender, engine, loop)
    err_b = fb.result(5)  # B times out while its write waits behind A's
    ended_b = time.monotonic()
    assert err_b and "timed out" in err_b
    gate_a.set()
    fa.result(5)
    assert wait_until(lambda: sender_idle(sender))
    time.sleep(0.1)
    late = [t for t in engine.writes_to("B") if t >= ended_b]
    assert late == [], (
        f"{len(late)} writes of transfer B ran after its end was reported"
    )
    assert sender.snapshot()["totals"]["writes_dropped"] >= 1
    sender.shutdown()


def test_layerwise_queued_write_of_aborted_transfer_never_runs(loop):
    engine = GatedEngine(by_transfer)
    sender = make_sender(engine, timeout_s=30)
    gate_a, fa, fb = start_a_blocked_then_b_queued(sender, engine, loop)
    # P's request of B is aborted while B's write is queued
    sender.on_metadata(
        LayerwiseMetadata(finished=[FinishedRequest("B", "pB", (3, 4), 8, True)])
    )
    err_b = fb.result(5)
    ended_b = time.monotonic()
    assert err_b and "aborted" in err_b
    assert "pB" in sender.poll()  # nothing of B in flight: its blocks may go
    gate_a.set()
    assert fa.result(5) is None
    assert wait_until(lambda: sender_idle(sender))
    time.sleep(0.1)
    assert [t for t in engine.writes_to("B") if t >= ended_b] == []
    sender.shutdown()


def test_layerwise_a_dead_decode_peer_stalls_only_its_own_transfers(loop):
    """One writer per decode peer: while the write to peer A hangs (a dead D),
    a transfer to peer B completes."""
    engine = GatedEngine()
    sender = make_sender(engine, timeout_s=30)
    gate_a = engine.gate("dA:1")
    fa = loop.submit(sender.push("A", dest("dA:1", 100)))
    fb = loop.submit(sender.push("B", dest("dB:1", 200)))
    assert wait_until(lambda: {"A", "B"} <= set(sender.tracker._pending))
    sender.on_metadata(LayerwiseMetadata(steps=[step("A", (1, 2)), step("B", (3, 4))]))
    sender.layer_saved("l0", KV)
    assert engine.entered["dA:1"].wait(5)
    assert fb.result(5) is None, "the transfer to a live peer waited behind a dead one"
    assert not fa.done()
    gate_a.set()
    assert fa.result(5) is None
    sender.shutdown()


def test_layerwise_unknown_transfer_ids_are_capped(loop, monkeypatch):
    """Transfer ids P never scheduled (sent to its unauthenticated ZMQ socket) each
    hold a waiter; beyond a cap they are refused at once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise import (
        prefill_sender,
    )

    monkeypatch.setattr(prefill_sender, "MAX_UNKNOWN", 20)
    sender = make_sender(GatedEngine(), timeout_s=30)
    futs = [loop.submit(sender.push(f"x{i}", dest("d:1", 100))) for i in range(25)]
    refused = [f.result(5) for f in futs[20:]]
    assert all(r and "refusing more" in r for r in refused), refused
    assert len(sender.tracker._pending) == 20
    sender.shutdown()


@pytest.mark.parametrize("how", ["abort", "timeout"])
def test_layerwise_end_and_free_wait_for_the_in_flight_write(loop, how):
    engine = GatedEngine()
    sender = make_sender(engine, timeout_s=0.3 if how == "timeout" else 30)
    gate_b = engine.gate("dB:1")
    fb = loop.submit(sender.push("B", dest("dB:1", 200)))
    assert wait_until(lambda: "B" in sender.tracker._pending)
    sender.on_metadata(LayerwiseMetadata(steps=[step("B", (3, 4))]))
    sender.layer_saved("l0", KV)
    assert engine.entered["dB:1"].wait(5)  # B's write is in the engine
    if how == "abort":
        sender.on_metadata(
            LayerwiseMetadata(finished=[FinishedRequest("B", "pB", (3, 4), 8, True)])
        )
    else:
        sender.on_metadata(
            LayerwiseMetadata(finished=[FinishedRequest("B", "pB", (3, 4), 8, False)])
        )
        time.sleep(0.6)  # past B's timeout
    time.sleep(0.2)
    assert not fb.done(), "D was told B ended while B's write was still in flight"
    assert "pB" not in sender.poll(), "P freed B's blocks while B's write was in flight"
    released = time.monotonic()
    gate_b.set()
    err = fb.result(10)
    assert time.monotonic() >= released
    assert wait_until(lambda: "pB" in sender.poll() or sender.tracker.get("B") is None)
    if how == "abort":
        assert err and "aborted" in err
    sender.shutdown()


class SlowEngineConfig(ExtConfig):
    """Short bounds, so a test can outlast them: the old wait for an in-flight
    write (layerwise_quiesce_s) and the engine's bound on one write."""

    @property
    def layerwise_quiesce_s(self) -> float:
        return 0.2

    def engine_write_bound_s(self, nbytes: int) -> float:
        return 0.3


def test_layerwise_timed_out_transfer_is_answered_only_once_its_write_returned(loop):
    """The write of a timed-out transfer stays in the engine far past every
    bound: D is not answered (so it does not reuse the blocks the write lands
    in) until the write returned; meanwhile P logs the overdue write."""
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise import (
        prefill_sender,
    )

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    prefill_sender.logger.addHandler(handler)
    engine = GatedEngine()
    cfg = SlowEngineConfig(
        layerwise=True, layerwise_timeout_s=0.3, engine_transfer_timeout_s=5
    )
    sender = LayerwiseSender(
        engine,
        {"l0": [0, 1]},
        [10_000, 20_000],
        64,
        BS,
        cfg,
        event_factory=lambda t: None,
    )
    try:
        gate_b = engine.gate("dB:1")
        fb = loop.submit(sender.push("B", dest("dB:1", 200)))
        assert wait_until(lambda: "B" in sender.tracker._pending)
        sender.on_metadata(LayerwiseMetadata(steps=[step("B", (3, 4))]))
        sender.layer_saved("l0", KV)
        assert engine.entered["dB:1"].wait(5)
        time.sleep(
            2.0
        )  # timeout 0.3 s + old quiesce 0.2 s + engine bound 0.3 s, well past
        assert not fb.done(), (
            f"D was answered while B's write was in flight: {fb.result()!r}"
        )
        overdue = [r for r in records if "still in flight" in r.getMessage()]
        assert len(overdue) == 1, [r.getMessage() for r in records]
        released = time.monotonic()
        gate_b.set()
        err = fb.result(5)
        assert time.monotonic() >= released and err and "timed out" in err
    finally:
        prefill_sender.logger.removeHandler(handler)
        sender.shutdown()


# ---- prefix push over real HTTP ---------------------------------------------------

NBLK, BLEN, SLOTS = 8, 64, 2
CFG = HashConfig("sha256", b"\x01" * 32)
TOKENS = list(range(500, 500 + 3 * BS))  # 3 full blocks
C_BLOCKS = [5, 2, 6]
FP = KVFingerprint(
    model="Arch:0123456789abcdef",
    dtype="float32/auto",
    block_size=BS,
    tp_size=1,
    block_len=BLEN,
    num_kv_tensors=SLOTS,
)
# C's bootstrap server on loopback: its push endpoints are open without a token
C_CONFIG = ExtConfig(bootstrap_host="127.0.0.1")


def buffers(fill):
    return [np.full(NBLK * BLEN, fill, dtype=np.uint8) for _ in range(SLOTS)]


def addr(buf):
    return buf.ctypes.data


class MemEngine(GatedEngine):
    """Gated write_fn that really copies bytes (memmove between numpy buffers)."""

    def __call__(self, session, src, dst, lens, layout=None) -> int:
        rc = super().__call__(session, src, dst, lens)
        for s, d, n in zip(src, dst, lens):
            ctypes.memmove(d, s, n)
        return rc


@pytest.fixture
def gated_c():
    """C: a filled KV cache, its hash mirror holding TOKENS' blocks, /push_blocks on
    HTTP; its engine is a gated memmove."""
    c_kv = buffers(0xAA)
    sync = filled_mirror(BS, TOKENS, C_BLOCKS, CFG)
    engine = MemEngine()
    server = PushServer(
        sync,
        engine,
        [addr(b) for b in c_kv],
        BLEN,
        FP,
        "c:1",
        C_CONFIG,
        source_id=C_SOURCE,
    )
    url, stop = serve_push(server)
    yield url, engine, server, c_kv
    stop()


def test_push_blocks_stay_with_the_request_until_c_can_no_longer_write(gated_c):
    url, engine, server, _ = gated_c
    d_kv = buffers(0)
    cfg = ExtConfig(
        push_timeout_s=0.5, engine_transfer_timeout_s=2.0, push_clock_skew_s=0.2
    )
    recv = PushReceiver("d:1", [addr(b) for b in d_kv], BLEN, BS, NBLK, FP, cfg)
    gate = engine.gate("d:1")
    dst_blocks = (3, 4, 7)
    recv.start([push_job("r1", url, dst_blocks, tokens=TOKENS)])
    assert engine.entered["d:1"].wait(5)  # C started writing before the deadline
    time.sleep(1.0)  # past D's deadline (0.5 s); C still writing
    assert recv.merge_finished(None) is None, (
        "D ended the push (freeing its blocks) while C was still writing into them"
    )
    # The write lands, then C answers; only then does the push end.
    gate.set()
    assert wait_until(lambda: bool(recv.merge_finished(None)), 5)
    # The request's blocks now go to another request, which writes its own KV:
    for b in d_kv:
        for blk in dst_blocks:
            b[blk * BLEN : (blk + 1) * BLEN] = 0x55
    time.sleep(0.5)
    for b in d_kv:
        for blk in dst_blocks:
            assert (b[blk * BLEN : (blk + 1) * BLEN] == 0x55).all(), (
                "a late byte of the push landed"
            )
    assert recv.take_outcome().landed == {"r1": 3}


def test_push_not_started_past_its_deadline_writes_nothing(gated_c):
    url, engine, server, _ = gated_c
    d_kv = buffers(0)
    cfg = ExtConfig(
        push_timeout_s=0.5, engine_transfer_timeout_s=2.0, push_clock_skew_s=0.2
    )
    # D's wall clock runs 10 s behind: the deadline it sends is already past for C
    recv = PushReceiver(
        "d:1",
        [addr(b) for b in d_kv],
        BLEN,
        BS,
        NBLK,
        FP,
        cfg,
        wall_clock=lambda: time.time() - 10,
    )
    recv.start([push_job("r2", url, (3, 4, 7), tokens=TOKENS)])
    assert wait_until(lambda: bool(recv.merge_finished(None)), 5)
    assert recv.take_outcome().landed == {"r2": 0}
    assert engine.writes_to("d:1") == []
    assert server.stats["past_deadline"] == 1
    assert all((b == 0).all() for b in d_kv)


def test_push_with_no_answer_ends_only_after_the_hold(gated_c):
    """C unreachable after the request was sent (here: nothing listens): D ends
    the push only once its hold (budget + C's bound on the write + skew) has passed."""
    cfg = ExtConfig(
        push_timeout_s=0.3, engine_transfer_timeout_s=0.4, push_clock_skew_s=0.1
    )
    now = [100.0]
    recv = PushReceiver("d:1", [1, 2], BLEN, BS, NBLK, FP, cfg, clock=lambda: now[0])
    job = push_job("r3", f"http://127.0.0.1:{free_port()}", (3, 4, 7), tokens=TOKENS)
    recv.start([job])
    time.sleep(0.5)  # the POST failed at once (connection refused)
    now[0] += recv.hold_s(job) - 0.01
    assert recv.merge_finished(None) is None
    now[0] += 0.02
    assert recv.merge_finished(None) == {"r3"}
    assert recv.take_outcome().landed == {"r3": 0}


def test_layerwise_request_for_a_transfer_never_scheduled_ends_after_the_unknown_timeout(
    loop,
):
    """A destination for a transfer id P never schedules (stale, or forged on P's
    ZMQ socket) is answered with an error after MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S,
    not after the whole transfer timeout; a transfer P does schedule in time
    goes on normally."""
    cfg = ExtConfig(
        layerwise=True,
        layerwise_timeout_s=30,
        layerwise_unknown_timeout_s=0.3,
        engine_transfer_timeout_s=5,
    )
    engine = GatedEngine()
    sender = LayerwiseSender(
        engine,
        {"l0": [0, 1]},
        [10_000, 20_000],
        64,
        BS,
        cfg,
        event_factory=lambda t: None,
    )
    t0 = time.monotonic()
    ghost = loop.submit(sender.push("ghost", dest("d:1", 100)))
    real = loop.submit(sender.push("R", dest("d:1", 200)))
    assert wait_until(lambda: {"ghost", "R"} <= set(sender.tracker._pending))
    sender.on_metadata(LayerwiseMetadata(steps=[step("R", (3, 4))]))  # P schedules R
    err = ghost.result(5)
    assert err and "never scheduled" in err and time.monotonic() - t0 < 3
    assert "ghost" not in sender.tracker._pending
    time.sleep(0.5)
    assert not real.done()  # R waits for its KV, not for the unknown timeout
    sender.layer_saved("l0", KV)
    assert real.result(5) is None
    sender.shutdown()
