# SPDX-License-Identifier: Apache-2.0
"""C side of prefix push: ``POST /match_blocks`` and ``POST /push_blocks``.

Runs in the worker process that owns the KV caches (the bootstrap server's
thread), next to the block-hash mirror (hashsync/); the scheduler and the
model are not involved. A push: validate (nothing is written on a 4xx), hash
the prompt as the scheduler does, match the longest cached prefix and
snapshot its blocks' generations, refuse to start once the request's
deadline (D's wall clock) or its budget (from when this server received it,
on this instance's monotonic clock) has passed, write blocks
``first_block ..`` into D's blocks with one ``batch_transfer_sync_write``
(on a thread at nice 19: the call busy-polls, see writer.py), then check
that none of the read blocks was evicted or reused meanwhile (else the push
is reported ``failed``: D must not use those bytes). The answer is sent only after the engine call
returned: once D has it, no byte of this push can still arrive.

Verified on the CPU backend over TCP only. With CUDA the KV lives in device
memory registered with the engine and the write is the same call; a block
is matchable only after the event recorded after the step that computed it
has completed (hashsync/table.py), so the engine never reads KV still being
computed. Tensor parallelism: one worker answers, so only TP=1 is supported.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm.logger import init_logger

from ...hashsync.sync import WorkerHashSync
from ..auth import EndpointGuard
from ..block_runs import block_entries
from ..config import ExtConfig, FaultConfig
from ..fault_injection import write_fault
from ..kv_reader import ReadFn
from .protocol import (
    KVFingerprint,
    MatchBlocksResponse,
    PushBlocksResponse,
    PushRequestError,
    parse_match_request,
    parse_push_request,
    validate,
)
from .writer import LowPriorityWriter, WriteFn

logger = init_logger(__name__)

DESTINATIONS_KEPT = 1024


class PushServer:
    """Serves pushes of this instance's cached prefixes (one per source worker).

    What may be written: only into a destination whose KV cache matches this
    one (fingerprint: model, dtype, block size, bytes per block, KV tensors,
    TP=1 on both sides), never into this instance's own session, only block
    ids below the destination's block count and addresses inside its KV
    tensors. A destination session's layout (block count, base addresses) is
    recorded on its first push; a later push naming the same session with
    another layout is refused (409)."""

    def __init__(self, sync: WorkerHashSync, write_fn: WriteFn, base_addrs: Sequence[int],
                 block_len: int, fingerprint: KVFingerprint, local_session: str,
                 config: ExtConfig = ExtConfig(),
                 wall_clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
                 reader: ReadFn | None = None, clock: Callable[[], float] = time.monotonic):
        self.sync = sync
        self.reader = reader  # proof of write: source bytes at D's probes
        # the engine's sync write busy-polls on its caller: at nice 19 (writer.py)
        self._writer = LowPriorityWriter(write_fn)
        self.base_addrs = list(base_addrs)
        self.block_len = block_len
        self.fingerprint = fingerprint
        self.local_session = local_session
        self.config = config
        self.faults: FaultConfig = config.faults
        self.guard = EndpointGuard(config)
        self._now_ms = wall_clock_ms
        self.clock = clock  # monotonic: a push's budget runs from its receipt
        # what D's hold needs (protocol.MatchBlocksResponse): the engine reads
        # MC_TRANSFER_TIMEOUT as whole seconds
        self.engine_timeout_s = math.ceil(config.engine_transfer_timeout_s)
        self._slots = threading.BoundedSemaphore(config.push_max_concurrent)
        self._lock = threading.Lock()
        self._destinations: collections.OrderedDict[str, tuple[int, tuple[int, ...]]] = \
            collections.OrderedDict()
        self.stats = {"pushes": 0, "ok": 0, "failed": 0, "no_match": 0, "past_deadline": 0,
                      "refused": 0, "busy": 0, "bytes": 0, "entries": 0, "write_seconds": 0.0}

    def try_begin(self) -> bool:
        """Take one of the concurrent-push slots (False: all busy, answer 429)."""
        if self._slots.acquire(blocking=False):
            return True
        self.stats["busy"] += 1
        return False

    def end(self) -> None:
        self._slots.release()

    def _check_destination(self, session: str, num_blocks: int, base_addrs: list[int]) -> None:
        if session == self.local_session:
            raise PushRequestError("dst_session", "names this instance's own transfer engine: "
                                   "a push never writes into its source", 409)
        layout = (num_blocks, tuple(base_addrs))
        with self._lock:
            known = self._destinations.get(session)
            if known is not None and known != layout:
                raise PushRequestError(
                    "dst_session", f"{session} was registered with {known[0]} blocks at other "
                    "base addresses; a destination's layout cannot change (restart it under "
                    "a new session)", 409)
            self._destinations[session] = layout
            self._destinations.move_to_end(session)
            while len(self._destinations) > DESTINATIONS_KEPT:
                self._destinations.popitem(last=False)

    def match(self, payload: Any) -> tuple[int, dict[str, Any]]:
        """Serve one /match_blocks body; returns (HTTP status, JSON body)."""
        try:
            req = parse_match_request(payload)
        except PushRequestError as e:
            return e.status, {"detail": e.detail()}
        if not req.token_ids:
            return 422, {"detail": {"field": "token_ids", "message": "must not be empty"}}
        if any(t < 0 for t in req.token_ids):
            return 422, {"detail": {"field": "token_ids",
                                    "message": "token ids must be non-negative"}}
        if len(req.token_ids) > self.config.push_max_tokens:
            return 413, {"detail": {"field": "token_ids", "message": (
                f"{len(req.token_ids)} tokens, more than {self.config.push_max_tokens}")}}
        try:
            block_ids, _, total = self.sync.match(req.token_ids, req.cache_salt, req.lora_name)
        except RuntimeError as e:  # no step has run yet: no hash configuration
            return 503, {"detail": {"field": "", "message": str(e)}}
        bs = self.sync.block_size
        return 200, MatchBlocksResponse(matched_blocks=len(block_ids),
                                        matched_tokens=len(block_ids) * bs,
                                        total_full_blocks=total,
                                        fingerprint=self.fingerprint,
                                        engine_timeout_s=self.engine_timeout_s,
                                        now_unix_ms=self._now_ms()).model_dump()

    def push(self, payload: Any, received: float | None = None) -> tuple[int, dict[str, Any]]:
        """Serve one /push_blocks body received at ``received`` (this server's
        clock; None: now); returns (HTTP status, JSON body)."""
        if received is None:
            received = self.clock()
        try:
            req = parse_push_request(payload)
            validate(req, block_size=self.sync.block_size, num_kv_tensors=len(self.base_addrs),
                     block_len=self.block_len, fingerprint=self.fingerprint,
                     max_tokens=self.config.push_max_tokens)
            self._check_destination(req.dst_session, req.dst_num_blocks, req.dst_kv_base_addrs)
        except PushRequestError as e:
            if e.status == 409:
                self.stats["refused"] += 1
                logger.warning("push_blocks %s refused: %s", payload_request_id(payload), e)
            return e.status, {"detail": e.detail()}
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
        late_ms = self._now_ms() - req.deadline_unix_ms
        what = "deadline"
        if req.budget_ms is not None:
            # whichever ends first: a clock behind D's cannot extend the window
            over_ms = int((self.clock() - received) * 1000) - req.budget_ms
            if over_ms > late_ms:
                late_ms, what = over_ms, f"budget of {req.budget_ms} ms"
        if late_ms > 0:
            # D may already have given these blocks to another request.
            resp.status = "failed"
            resp.message = (f"the push's {what} passed {late_ms} ms before the write could "
                            "start; nothing written")
            self.stats["failed"] += 1
            self.stats["past_deadline"] += 1
            logger.warning("push_blocks %s: %s", req.request_id, resp.message)
            return 200, resp.model_dump()
        t0 = time.perf_counter()
        err = write_fault(self.faults, len(req.token_ids)) if self.faults.armed else None
        try:
            if err is None:
                rc = self._writer(req.dst_session, src, dst, lens)
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
        if self.reader is not None:
            resp.probe_values = [self.reader(slot, src_blocks[i], off).hex() if i < n else None
                                 for i, slot, off in req.probes]
        if n < len(req.dst_block_ids):
            resp.message = f"{n} of {len(req.dst_block_ids)} requested blocks held"
        self.stats["ok"] += 1
        self.stats["bytes"] += resp.bytes
        self.stats["entries"] += len(lens)
        self.stats["write_seconds"] += resp.seconds
        logger.info("push_blocks %s: %d blocks (%.1f MiB, %d entries) to %s in %.3f s "
                    "(%.2f GB/s)", req.request_id, n, resp.bytes / 2**20, len(lens),
                    req.dst_session, resp.seconds, resp.bytes / max(resp.seconds, 1e-9) / 1e9)
        return 200, resp.model_dump()


def payload_request_id(payload: Any) -> str:
    return "(request)" if not isinstance(payload, dict) else str(payload.get("request_id"))[:64]


async def read_capped(request: Any, limit: int) -> bytes | None:
    """The request body, or None once it exceeds ``limit`` bytes (nothing more is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def register_routes(app: Any, get_server: Callable[[], PushServer | None]) -> None:
    """Add POST /match_blocks and POST /push_blocks to a FastAPI app.
    get_server() returns None while the worker is not ready (503). (Request is
    imported at module level: FastAPI resolves annotations by name.)"""

    def route(method: Callable[[PushServer, bytes, float], tuple[int, dict[str, Any]]], *,
              limited: bool):
        async def handler(request: Request) -> JSONResponse:
            server = get_server()
            if server is None:
                return JSONResponse({"detail": "KV caches not registered yet; retry"}, 503)
            received = server.clock()  # a push's budget runs from here
            if (denied := server.guard.check(request.headers.get("authorization"))) is not None:
                return JSONResponse({"detail": denied[1]}, denied[0])
            body = await read_capped(request, server.config.push_max_body_bytes)
            if body is None:
                return JSONResponse({"detail": {"field": "body", "message": (
                    f"larger than {server.config.push_max_body_bytes} bytes")}}, 413)
            if limited and not server.try_begin():
                return JSONResponse({"detail": (
                    f"{server.config.push_max_concurrent} pushes in progress; retry later")}, 429)
            try:
                # hashing and the write block (the engine releases the GIL): off the event loop
                code, out = await asyncio.to_thread(method, server, body, received)
            finally:
                if limited:
                    server.end()
            return JSONResponse(out, status_code=code)

        return handler

    app.post("/match_blocks")(route(lambda s, body, _: s.match(body), limited=False))
    app.post("/push_blocks")(route(lambda s, body, received: s.push(body, received),
                                   limited=True))
