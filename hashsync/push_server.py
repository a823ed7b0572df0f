# SPDX-License-Identifier: Apache-2.0
"""C side of ``POST /push_blocks``: write this instance's cached prefix into D.

Runs in the worker process that owns the KV caches (the bootstrap server's
thread), next to the block-hash table; the scheduler and the model are not
involved. Steps: validate (nothing is written on a 4xx), hash the prompt as
the scheduler does, match the longest cached prefix and snapshot its blocks'
generations, write blocks ``first_block ..`` into D's blocks with one
``batch_transfer_sync_write``, then check that none of the read blocks was
evicted or reused meanwhile (else the push is reported ``failed``: D must not
use those bytes).

Verified on the CPU backend over TCP only; with CUDA the KV lives in device
memory registered with the engine and the write is the same call (a block
in the table was computed by a finished step, so no stream sync is needed).
Tensor parallelism: one worker answers, so only TP=1 is supported.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.block_runs import (
    block_entries,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.fault_injection import (
    write_fault,
)
from vllm.logger import init_logger

from .push_protocol import (
    PushBlocksResponse,
    PushRequestError,
    parse_push_request,
    validate,
)

logger = init_logger(__name__)

WriteFn = Callable[[str, list[int], list[int], list[int]], int]


class BlockPusher:
    def __init__(self, sync: Any, write_fn: WriteFn, base_addrs: Sequence[int], block_len: int):
        self.sync = sync  # WorkerHashSync
        self.write_fn = write_fn
        self.base_addrs = list(base_addrs)
        self.block_len = block_len
        self.stats = {"pushes": 0, "ok": 0, "failed": 0, "no_match": 0, "bytes": 0}

    def push(self, payload: Any) -> tuple[int, dict[str, Any]]:
        """Serve one request body; returns (HTTP status, JSON body)."""
        try:
            req = parse_push_request(payload)
            validate(req, block_size=self.sync.block_size, num_kv_tensors=len(self.base_addrs),
                     block_len=self.block_len)
        except PushRequestError as e:
            return 422, {"detail": e.detail()}
        try:
            c_blocks, gens, total = self.sync.match(req.token_ids, req.cache_salt, req.lora_name)
        except RuntimeError as e:  # no step has run yet: no hash configuration
            return 503, {"detail": {"field": "", "message": str(e)}}
        bs = self.sync.block_size
        lo, hi = req.first_block, req.first_block + len(req.dst_block_ids)
        src_blocks, src_gens = c_blocks[lo:hi], gens[lo:hi]
        n = len(src_blocks)
        resp = PushBlocksResponse(status="no_match", matched_blocks=len(c_blocks),
                                  matched_tokens=len(c_blocks) * bs, total_full_blocks=total)
        self.stats["pushes"] += 1
        if n == 0:
            resp.message = (f"this instance holds {len(c_blocks)} leading blocks of the prompt, "
                            f"none from block {lo}")
            self.stats["no_match"] += 1
            return 200, resp.model_dump()
        src, dst, lens = block_entries(self.base_addrs, req.dst_kv_base_addrs, self.block_len,
                                       src_blocks, req.dst_block_ids[:n])
        t0 = time.perf_counter()
        err = write_fault(len(req.token_ids))  # tests only: VMP_FAULT_FAIL_WRITE_PROMPT_LEN
        try:
            if err is None:
                rc = self.write_fn(req.dst_session, src, dst, lens)
                if rc != 0:
                    err = f"transfer engine returned {rc} writing to {req.dst_session}"
        except Exception as e:  # the engine raising must not take the server down
            err = f"transfer engine raised {e!r} writing to {req.dst_session}"
        resp.seconds = time.perf_counter() - t0
        if err is None and not self.sync.table.generations_unchanged(src_blocks, src_gens):
            err = "a source block was evicted or reused during the push; its bytes are not valid"
        if err is not None:
            resp.status, resp.message = "failed", err
            self.stats["failed"] += 1
            logger.warning("push_blocks %s: %s", req.request_id, err)
            return 200, resp.model_dump()
        resp.status, resp.pushed_blocks, resp.bytes = "ok", n, sum(lens)
        if n < len(req.dst_block_ids):
            resp.message = f"{n} of {len(req.dst_block_ids)} requested blocks held"
        self.stats["ok"] += 1
        self.stats["bytes"] += resp.bytes
        logger.info("push_blocks %s: %d blocks (%.1f MiB) to %s in %.3f s", req.request_id, n,
                    resp.bytes / 2**20, req.dst_session, resp.seconds)
        return 200, resp.model_dump()
