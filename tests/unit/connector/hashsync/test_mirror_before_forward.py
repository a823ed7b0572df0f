"""The block-hash mirror forgets an evicted block before the forward pass that
overwrites it, in the order the installed vLLM release calls the connector.

The scheduler's step N evicts C's cached block B (prefix X) and gives it to
another request R; forward N writes R's KV into B. A push of X served while
forward N runs must not find B (or must see its generation changed), or C
writes R's bytes into D as X's KV and its proof of write passes too.

The step is driven by upstream's own ``KVConnectorModelRunnerMixin``
(``_get_kv_connector_output``, the context manager every model runner wraps
its forward in): vLLM 0.18.1 calls ``start_load_kv`` before the forward,
0.32.0 after it when the step has no synchronous KV loads. The connector is
this series' facade with its worker extension and the mirror's step; upstream's
worker calls that only read transfer state are stubbed (nothing to transfer).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import (
    BLEN,
    BS,
    C_BLOCKS,
    C_SESSION,
    C_SOURCE,
    D_SESSION,
    DST_BLOCKS,
    FP,
    HCFG,
    KV,
    NBLK,
    SLOTS,
    TOKENS,
    MemEngine,
    filled_mirror,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.connector import (
    ExtMooncakeConnector,
    ExtMooncakeConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    hash_prompt_blocks,
    to_pool_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashDelta,
    HashEventKind,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.metadata import (
    ExtMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_server import (
    PushServer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.worker_extension import (
    HashMirrorStep,
    WorkerExtension,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorMetadata,
)
from vllm.v1.worker import kv_connector_model_runner_mixin as mixin

R_BYTE = 0xEE  # request R's KV (no block of a filled KV holds this byte)


def c_connector(sync) -> ExtMooncakeConnector:
    """C's facade as vLLM builds it, reduced to what a step with nothing to
    transfer reaches: the worker extension runs the mirror's step."""
    ext = WorkerExtension.__new__(WorkerExtension)
    ext.features = [HashMirrorStep(sync, None)]
    worker = ExtMooncakeConnectorWorker.__new__(ExtMooncakeConnectorWorker)
    worker.ext = ext
    worker.is_kv_producer, worker.is_kv_consumer = True, False
    worker.shutdown = lambda: None  # no engine, threads or sockets to stop
    conn = ExtMooncakeConnector.__new__(ExtMooncakeConnector)
    conn._connector_metadata = None
    conn.connector_worker = worker
    conn.connector_scheduler = None
    # after the forward: nothing finished or failed, no stats (each release's name)
    conn.get_finished = lambda finished_req_ids: (None, None)
    conn.get_transfer_results = lambda finished_req_ids: SimpleNamespace(
        finished_sending=set(), finished_recving=set(), failed_recving=set()
    )
    conn.get_block_ids_with_load_errors = lambda: set()
    conn.get_kv_connector_stats = lambda: None
    conn.get_kv_connector_kv_cache_events = lambda: None
    conn.build_connector_worker_meta = lambda: None
    return conn


def step_metadata(delta: HashDelta) -> MooncakeConnectorMetadata:
    meta = MooncakeConnectorMetadata()
    meta.ext = ExtMetadata(hash_delta=delta)  # type: ignore[attr-defined]
    return meta


def push_request(d: KV) -> dict:
    return {
        "token_ids": TOKENS,
        "block_size": BS,
        "dst_session": D_SESSION,
        "dst_kv_base_addrs": d.bases,
        "dst_block_ids": DST_BLOCKS,
        "first_block": 0,
        "block_len": BLEN,
        "request_id": "push-of-X",
        "deadline_unix_ms": 2**50,
        "dst_num_blocks": NBLK,
        "source_id": C_SOURCE,
        "fingerprint": FP.model_dump(),
    }


@pytest.mark.parametrize("sync_kv_loads", [False, True])
def test_a_push_during_the_forward_never_sends_a_block_evicted_for_it(
    monkeypatch, sync_kv_loads
):
    sync = filled_mirror(BS, TOKENS, C_BLOCKS, HCFG)  # X's 3 blocks on C
    c = KV(fill=True)
    engine = MemEngine()
    d = KV(fill=False)
    engine.register(D_SESSION, d)
    server = PushServer(
        sync,
        engine,
        c.bases,
        BLEN,
        FP,
        C_SESSION,
        ExtConfig(bootstrap_host="127.0.0.1"),
        source_id=C_SOURCE,
    )
    # step N: the scheduler evicted X's last block and gave it to request R
    evicted = C_BLOCKS[-1]
    last = hash_prompt_blocks(TOKENS, BS, HCFG.hash_algo, HCFG.none_hash)[-1]
    delta = HashDelta(events=[(HashEventKind.REMOVED, to_pool_key(last), evicted)])
    conn = c_connector(sync)
    monkeypatch.setattr(mixin, "get_kv_transfer_group", lambda: conn)
    monkeypatch.setattr(mixin, "get_forward_context", lambda: None)
    scheduler_output = SimpleNamespace(
        kv_connector_metadata=step_metadata(delta),
        finished_req_ids=set(),
        has_sync_kv_loads=sync_kv_loads,
    )
    seen = {}
    with mixin.KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output):
        # forward N: R's KV goes into the evicted block while a push of X is served
        for slot in range(SLOTS):
            c.block(slot, evicted)[:] = R_BYTE
        seen["matched"], _, _ = sync.match(TOKENS)
        seen["push"] = server.push(push_request(d))
    assert evicted not in seen["matched"], (
        "during the forward that overwrites it, the mirror still holds the block the "
        "step evicted: a push of its old prefix reads another request's KV"
    )
    code, body = seen["push"]
    assert code == 200 and body["pushed_blocks"] == len(C_BLOCKS) - 1, body
    assert not any(
        (d.block(slot, b) == R_BYTE).all() for slot in range(SLOTS) for b in DST_BLOCKS
    ), "D received the evicting request's bytes as X's KV"
