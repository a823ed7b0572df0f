"""The transfer engine's own write bandwidth on this machine (no vLLM).

Two Mooncake TransferEngines in this process, the given protocol, one
batch_transfer_sync_write of ``total_bytes`` in ``entry_bytes`` entries (the
shape of a KV push: one entry per KV tensor and run of blocks). Used by
microbench/push as the "line rate" its target refers to.
"""

from __future__ import annotations

import time

import numpy as np


def engine_write_bandwidth(total_bytes: int, entry_bytes: int, protocol: str = "tcp",
                           reps: int = 3) -> dict:
    from mooncake.engine import TransferEngine

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.transport_env import (
        apply_transport_env_defaults,
    )

    apply_transport_env_defaults(protocol)
    engines = []
    for _ in range(2):
        e = TransferEngine()
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({protocol})")
        engines.append(e)
    src_e, dst_e = engines
    n = max(1, total_bytes // entry_bytes)
    src = np.full(n * entry_bytes, 3, dtype=np.uint8)
    dst = np.zeros(n * entry_bytes, dtype=np.uint8)
    if src_e.register_memory(src.ctypes.data, src.nbytes) or dst_e.register_memory(dst.ctypes.data, dst.nbytes):
        raise RuntimeError("Mooncake register_memory failed")
    peer = f"127.0.0.1:{dst_e.get_rpc_port()}"
    srcs = [src.ctypes.data + i * entry_bytes for i in range(n)]
    # every other destination entry, reversed: no accidental contiguity
    dsts = [dst.ctypes.data + i * entry_bytes for i in range(n)][::-1]
    secs = []
    for _ in range(reps):
        dst[:] = 0
        t0 = time.perf_counter()
        rc = src_e.batch_transfer_sync_write(peer, srcs, dsts, [entry_bytes] * n)
        secs.append(time.perf_counter() - t0)
        if rc != 0 or not (dst == 3).all():
            raise RuntimeError(f"bandwidth probe: write returned {rc} or landed wrong bytes")
    best = min(secs)
    return {"protocol": protocol, "bytes": n * entry_bytes, "entry_bytes": entry_bytes,
            "seconds": secs, "gb_per_s": n * entry_bytes / best / 1e9}
