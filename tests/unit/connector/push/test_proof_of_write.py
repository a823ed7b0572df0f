"""Proof of write (connector/common/kv_reader.py, push/receiver.py, push/server.py).

D believes a push source's "ok" only if its own blocks hold the source's
bytes at random probe positions where it had planted random canaries. A
source that answers "ok" with consistent numbers but does not write (or
writes elsewhere) gets 0 blocks counted: D prefills locally instead of
decoding from whatever its blocks held. Real HTTP, a memmove engine between
torch tensors standing in for the two KV caches.
"""

from __future__ import annotations

import ctypes
import time

import pytest
import torch
from helpers import C_SOURCE, filled_mirror, push_job, serve_push

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.kv_reader import (
    KVReader,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
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

BS, NBLK, BLEN, SLOTS = 4, 8, 64, 2
CFG = HashConfig("sha256", b"\x03" * 32)
TOKENS = list(range(700, 700 + 3 * BS))
C_BLOCKS = [5, 2, 6]
FP = KVFingerprint(
    model="m",
    dtype="float32",
    block_size=BS,
    tp_size=1,
    block_len=BLEN,
    num_kv_tensors=SLOTS,
)


def kv(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (NBLK * BLEN,), dtype=torch.uint8, generator=g)
        for _ in range(SLOTS)
    ]


class Engine:
    def __init__(self, writes=True):
        self.writes = writes
        self.calls = 0

    def __call__(self, session, src, dst, lens, layout=None):
        self.calls += 1
        if self.writes:
            for s, d, n in zip(src, dst, lens):
                ctypes.memmove(d, s, n)
        return 0  # "ok" either way


def serve_c(engine, c_kv):
    """C on HTTP, its hash mirror holding TOKENS' blocks, reading proofs from c_kv:
    (url, stop)."""
    sync = filled_mirror(BS, TOKENS, C_BLOCKS, CFG)
    reader = KVReader(c_kv, BLEN, NBLK)
    server = PushServer(
        sync,
        engine,
        [t.data_ptr() for t in c_kv],
        BLEN,
        FP,
        "c:1",
        ExtConfig(bootstrap_host="127.0.0.1"),
        reader=reader.read,
        source_id=C_SOURCE,
    )
    return serve_push(server)


def push_once(engine, proof=True):
    c_kv, d_kv = kv(1), kv(2)
    url, stop = serve_c(engine, c_kv)
    try:
        recv = PushReceiver(
            "d:1",
            [t.data_ptr() for t in d_kv],
            BLEN,
            BS,
            NBLK,
            FP,
            ExtConfig(push_timeout_s=5),
            kv=KVReader(d_kv, BLEN, NBLK) if proof else None,
        )
        dst = (3, 4, 7)
        recv.start([push_job("r", url, dst, tokens=TOKENS)])
        end = time.monotonic() + 10
        while not recv.merge_finished(None) and time.monotonic() < end:
            time.sleep(0.01)
        return recv.take_outcome().landed["r"], c_kv, d_kv, dst
    finally:
        stop()


def test_a_real_write_is_proven():
    landed, c_kv, d_kv, dst = push_once(Engine(writes=True))
    assert landed == 3
    for c, d in zip(c_kv, d_kv):
        for cb, db in zip(C_BLOCKS, dst):
            assert torch.equal(
                c[cb * BLEN : (cb + 1) * BLEN], d[db * BLEN : (db + 1) * BLEN]
            )


def test_ok_without_writing_is_not_believed():
    landed, _, _, _ = push_once(Engine(writes=False))
    assert landed == 0, "D counted blocks the source never wrote"


def test_without_the_proof_such_a_source_would_be_believed():
    """The same lying source against a receiver without proof of write (as before
    this check existed): its "ok" is taken at face value."""
    landed, _, _, _ = push_once(Engine(writes=False), proof=False)
    assert landed == 3


def test_kv_reader_reads_and_writes_block_bytes_and_refuses_outside():
    t = kv(3)
    r = KVReader(t, BLEN, NBLK)
    assert r.read(1, 5, 16) == bytes(t[1][5 * BLEN + 16 : 5 * BLEN + 24].tolist())
    r.write(0, 2, 8, b"\x01" * 8)
    assert bytes(t[0][2 * BLEN + 8 : 2 * BLEN + 16].tolist()) == b"\x01" * 8
    for bad in [(2, 0, 0), (0, NBLK, 0), (0, 0, BLEN - 4), (0, 0, -8)]:
        with pytest.raises(ValueError):
            r.read(*bad)
