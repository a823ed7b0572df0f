# SPDX-License-Identifier: Apache-2.0
"""Block-hash sync wired into MooncakeConnector: scheduler side, worker side, HTTP routes.

Scheduler process (SchedulerHashSync): BlockPool reports every block it caches
or evicts to the recorder (patch: block_pool.block_hash_observer); each step
the drained delta, with the scheduler's hash configuration (algorithm and
NONE_HASH, which is random per process unless PYTHONHASHSEED is set), rides in
the connector metadata to the worker.

Worker process (WorkerHashSync): applies the delta before the forward pass
(new blocks become matchable only once the step that computes them has
completed: after an event recorded after its forward on CUDA, table.py) and
answers lookups: which of a prompt's full blocks this instance holds, hashed
exactly as its scheduler hashes them (same algorithm, NONE_HASH, cache_salt,
LoRA), so a block is never matched for a request with another cache_salt.

Route on the instance's Mooncake bootstrap server (register_routes):
  GET  /hashsync        table size, hash algorithm and a sample (debugging)
The lookups are served by prefix push (connector/push/server.py:
POST /match_blocks, POST /push_blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import HTTPException, Request  # module level: FastAPI resolves names

from vllm.logger import init_logger

from .hashing import hash_prompt_blocks, scheduler_hash_config
from .recorder import HashDelta, get_recorder
from .table import BlockHashTable

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


class WorkerHashSync:
    """Worker side: the instance's hash -> block table and lookups against it."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.table = BlockHashTable(defer_stores=True)
        self.stats_provider: Callable[[], dict[str, Any]] | None = None  # shown in /hashsync

    def on_metadata(self, delta: HashDelta | None) -> None:
        """Before the forward pass: apply the step's delta (stores stay pending)."""
        if delta is not None and (len(delta) or delta.hash_config is not None):
            self.table.apply(delta)

    def after_step(self, event: Any = None) -> None:
        """After the forward pass was launched: blocks stored this step hold their
        KV once ``event`` has completed (None: now, as on the CPU backend)."""
        self.table.seal_pending(event)
        self.table.commit_ready()

    def prompt_hashes(self, token_ids: list[int], cache_salt: str | None,
                      lora_name: str | None) -> list:
        cfg = self.table.hash_config
        if cfg is None:
            raise RuntimeError("block-hash sync has not received the scheduler's hash "
                               "configuration yet (no step has run); retry")
        return hash_prompt_blocks(token_ids, self.block_size, cfg.hash_algo, cfg.none_hash,
                                  cache_salt=cache_salt, lora_name=lora_name)

    def match(self, token_ids: list[int], cache_salt: str | None = None,
              lora_name: str | None = None) -> tuple[list[int], list[int], int]:
        """(matched block ids, their generations, number of full blocks of the prompt)."""
        hashes = self.prompt_hashes(token_ids, cache_salt, lora_name)
        self.table.commit_ready()  # steps completed since the last after_step
        block_ids, gens = self.table.match_and_snapshot(hashes)
        return block_ids, gens, len(hashes)

    def debug(self, sample: int = 8) -> dict[str, Any]:
        cfg = self.table.hash_config
        return {
            "size": self.table.size(),
            "pending": self.table.num_pending(),
            "hash_algo": cfg.hash_algo if cfg else None,
            "block_size": self.block_size,
            "sample": self.table.sample(sample),
            "push": self.stats_provider() if self.stats_provider else None,
        }


def register_routes(app: Any, get_sync: Callable[[], WorkerHashSync | None],
                    guard: Any = None) -> None:
    """Add GET /hashsync to a FastAPI app. get_sync() returns the WorkerHashSync,
    or None while the worker is not ready (503). guard: an object whose
    check(authorization header) returns None or (status, reason)."""
    async def hashsync_debug(request: Request) -> dict[str, Any]:
        # the guard runs before anything of the request is parsed
        if guard is not None and (denied := guard.check(request.headers.get("authorization"))):
            raise HTTPException(status_code=denied[0], detail=denied[1])
        raw = request.query_params.get("sample", "8")
        if not raw.isdigit() or len(raw) > 6:
            raise HTTPException(status_code=422, detail="sample: a whole number 0..256")
        sync = get_sync()
        if sync is None:
            raise HTTPException(status_code=503, detail="KV caches not registered yet; retry")
        return sync.debug(min(int(raw), 256))

    app.get("/hashsync")(hashsync_debug)
