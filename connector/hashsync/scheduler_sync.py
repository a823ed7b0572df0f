# SPDX-License-Identifier: Apache-2.0
"""Block-hash sync, scheduler process: BlockPool's cache/evict events -> per-step deltas.

BlockPool reports every block it caches or evicts to the recorder (patch:
block_pool.block_hash_observer); each step the drained delta, with the
scheduler's hash configuration (algorithm and NONE_HASH, which is random per
process unless PYTHONHASHSEED is set), rides in the connector metadata to the
worker (worker_sync.py).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    scheduler_hash_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashDelta,
    get_recorder,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


class SchedulerHashSync:
    """Scheduler side: turns BlockPool's cache/evict events into per-step deltas."""

    def __init__(self, hash_algo: str):
        from vllm.v1.core import block_pool

        self.hash_algo = hash_algo
        # Record from the start: the first step caches blocks in schedule(),
        # before build() runs for that step.
        recorder = get_recorder()
        recorder.enable()
        block_pool.block_hash_observer = recorder
        self._configured = False

    def build(self) -> HashDelta:
        recorder = get_recorder()
        if not self._configured:
            # NONE_HASH is drawn when the engine core starts, after the
            # connector is built: read it on the first step, not in __init__.
            recorder.set_hash_config(scheduler_hash_config(self.hash_algo))
            self._configured = True
            logger.info("Mooncake block-hash sync enabled (%s)", self.hash_algo)
        return recorder.drain()
