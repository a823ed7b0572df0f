# SPDX-License-Identifier: Apache-2.0
"""Block-hash sync wired into MooncakeConnector: scheduler side, worker side, HTTP routes.

Scheduler process (SchedulerHashSync): BlockPool reports every block it caches
or evicts to the recorder (patch: block_pool.block_hash_observer); each step
the drained delta, with the scheduler's hash configuration (algorithm and
NONE_HASH, which is random per process unless PYTHONHASHSEED is set), rides in
the connector metadata to the worker.

Worker process (WorkerHashSync): applies the delta before the forward pass
(new blocks become matchable only after the step that computes them) and
answers lookups: which of a prompt's full blocks this instance holds, hashed
exactly as its scheduler hashes them (same algorithm, NONE_HASH, cache_salt,
LoRA), so a block is never matched for a request with another cache_salt.

Routes on the instance's Mooncake bootstrap server (register_routes):
  GET  /hashsync        table size, hash algorithm and a sample (debugging)
  POST /match_blocks    {"token_ids": [...], "cache_salt": null, "lora_name": null}
                        -> how many leading full blocks are held (no data moves)
  POST /push_blocks     write the held prefix into a peer's KV cache
                        (push_protocol.py, push_server.py)
"""

from __future__ import annotations

from typing import Any

import asyncio

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from vllm.logger import init_logger

from .hashing import hash_prompt_blocks, scheduler_hash_config
from .push_server import BlockPusher, WriteFn
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
        self.pusher: BlockPusher | None = None

    def enable_push(self, write_fn: WriteFn, base_addrs: list[int], block_len: int) -> None:
        """Serve POST /push_blocks with this worker's transfer engine and KV caches."""
        self.pusher = BlockPusher(self, write_fn, base_addrs, block_len)

    def on_metadata(self, delta: HashDelta | None) -> None:
        """Before the forward pass: apply the step's delta (stores stay pending)."""
        if delta is not None and (len(delta) or delta.hash_config is not None):
            self.table.apply(delta)

    def after_step(self) -> None:
        """After the forward pass: blocks stored this step now hold their KV."""
        self.table.commit_pending()

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
            "push": dict(self.pusher.stats) if self.pusher else None,
        }


class MatchRequest(BaseModel):
    """Body of POST /match_blocks (module level: FastAPI resolves it by name)."""

    model_config = ConfigDict(extra="forbid")
    token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None


def register_routes(app: Any, get_sync: Any) -> None:
    """Add the hashsync routes to a FastAPI app. get_sync() returns the
    WorkerHashSync, or None while the worker is not ready."""

    def ready() -> WorkerHashSync:
        sync = get_sync()
        if sync is None:
            raise HTTPException(status_code=503, detail="KV caches not registered yet; retry")
        return sync

    async def hashsync_debug(sample: int = 8) -> dict[str, Any]:
        return ready().debug(max(0, min(sample, 256)))

    async def match_blocks(req: MatchRequest) -> dict[str, Any]:
        sync = ready()
        if not req.token_ids:
            raise HTTPException(status_code=422, detail="token_ids: must not be empty")
        try:
            block_ids, _, total = sync.match(req.token_ids, req.cache_salt, req.lora_name)
        except RuntimeError as e:
            raise HTTPException(status_code=503, detail=str(e)) from e
        return {"matched_blocks": len(block_ids), "matched_tokens": len(block_ids) * sync.block_size,
                "total_full_blocks": total}

    async def push_blocks(request: Request) -> JSONResponse:
        sync = ready()
        if sync.pusher is None:
            raise HTTPException(status_code=501, detail="this instance does not serve pushes")
        try:
            payload = await request.json()
        except ValueError as e:
            return JSONResponse({"detail": {"field": "body", "message": f"not JSON: {e}"}}, 422)
        # the write blocks (GIL released by the engine): keep the event loop free
        code, body = await asyncio.to_thread(sync.pusher.push, payload)
        return JSONResponse(body, status_code=code)

    app.get("/hashsync")(hashsync_debug)
    app.post("/match_blocks")(match_blocks)
    app.post("/push_blocks")(push_blocks)
