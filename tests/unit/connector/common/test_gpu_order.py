"""GPU ordering (connector/common/gpu_order.py users), with fake events.

On CUDA the forward pass only launches kernels. A layer-wise write must wait
on the event recorded after the layer it reads, also when the write is issued
later (D's addresses arrive after the layer ran, or the request finished); a
block may be matched for /push_blocks only once the event recorded after the
step that computed it has completed. The fake events record whether they were
waited on before the engine read the blocks.
"""

from __future__ import annotations

import threading
import time

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    hash_prompt_blocks,
    to_pool_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashDelta,
    HashEventKind,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.worker_sync import (
    WorkerHashSync,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_sender import (
    LayerwiseSender,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_tracker import (
    Destination,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (
    ComputedStep,
    LayerwiseMetadata,
)

BS = 4


class FakeEvent:
    def __init__(self, name):
        self.name = name
        self.done = False
        self.synchronized = threading.Event()

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized.set()
        self.done = True


class Recorder:
    """Event factory + engine stub: each write notes which events were synchronized."""

    def __init__(self):
        self.events: list[FakeEvent] = []
        self.writes: list[
            tuple[str, list[str]]
        ] = []  # (session, events synchronized before)
        self.done = threading.Event()

    def event(self, tensor):
        e = FakeEvent(f"e{len(self.events)}")
        self.events.append(e)
        return e

    def write(self, session, src, dst, lens):
        self.writes.append(
            (session, [e.name for e in self.events if e.synchronized.is_set()])
        )
        self.done.set()
        return 0


def sender_for(rec):
    cfg = ExtConfig(layerwise=True, layerwise_timeout_s=5)
    return LayerwiseSender(
        rec.write,
        {"l0": [0, 1], "l1": [2, 3]},
        [1, 2, 3, 4],
        64,
        BS,
        cfg,
        event_factory=rec.event,
    )


def dest():
    return Destination("d:1", [10, 20, 30, 40], [7, 8])


def step():
    return ComputedStep("t", "pt", (1, 2), 8, 8)


def test_layer_write_waits_on_its_layer_event():
    rec = Recorder()
    s = sender_for(rec)
    s.tracker.set_destination("t", dest())  # D asked first
    s.on_metadata(LayerwiseMetadata(steps=[step()]))
    s.layer_saved("l0", torch.zeros(1))
    assert rec.done.wait(5)
    session, synced = rec.writes[0]
    assert synced == ["e0"], f"the write of layer 0 read before its event: {synced}"
    s.shutdown()


def test_write_issued_when_destination_arrives_waits_on_the_layers_it_reads():
    """D's addresses arrive after both layers ran: the writes issued then (from
    set_destination / _attach_pending) must wait on both layers' events."""
    import asyncio

    rec = Recorder()
    s = sender_for(rec)
    s.on_metadata(LayerwiseMetadata(steps=[step()]))
    s.layer_saved("l0", torch.zeros(1))
    s.layer_saved("l1", torch.zeros(1))
    # both layers handed to the tracker before D asks (the issuer thread may not
    # have got to them yet; a layer it issues after D's addresses arrived waits on
    # its own event only, test_layer_write_waits_on_its_layer_event)
    s.issue_computed_layers()
    assert rec.writes == []  # nowhere to write yet
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    asyncio.run_coroutine_threadsafe(s.push("t", dest()), loop)
    assert rec.done.wait(5)
    time.sleep(0.1)
    for session, synced in rec.writes:
        assert set(synced) >= {"e0", "e1"}, (
            f"write read KV before its layer's event: {synced}"
        )
    loop.call_soon_threadsafe(loop.stop)
    s.shutdown()


def test_hash_table_publishes_a_step_only_after_its_event_completed():
    cfg = HashConfig("sha256", b"\x02" * 32)
    tokens = list(range(2 * BS))
    hashes = hash_prompt_blocks(tokens, BS, cfg.hash_algo, cfg.none_hash)
    sync = WorkerHashSync(BS)
    sync.on_metadata(
        HashDelta(
            events=[
                (HashEventKind.STORED, to_pool_key(h, 0), b)
                for h, b in zip(hashes, [4, 9])
            ],
            hash_config=cfg,
        )
    )
    event = FakeEvent("step")
    sync.after_step(event)  # forward launched, not done
    assert sync.match(tokens)[0] == [], "blocks published before their step completed"
    event.done = True
    assert sync.match(tokens)[0] == [4, 9]


def test_removal_before_publication_wins():
    cfg = HashConfig("sha256", b"\x02" * 32)
    tokens = list(range(BS))
    (h,) = hash_prompt_blocks(tokens, BS, cfg.hash_algo, cfg.none_hash)
    key = to_pool_key(h, 0)
    sync = WorkerHashSync(BS)
    sync.on_metadata(
        HashDelta(events=[(HashEventKind.STORED, key, 3)], hash_config=cfg)
    )
    event = FakeEvent("step")
    sync.after_step(event)
    sync.on_metadata(
        HashDelta(events=[(HashEventKind.REMOVED, key, 3)], hash_config=cfg)
    )
    event.done = True
    sync.after_step(None)
    assert sync.match(tokens)[0] == []
