# SPDX-License-Identifier: Apache-2.0
"""D's worker side of prefix push migration: post ``/push_blocks`` to C.

For each :class:`PushJob` in the step's metadata a thread asks C's bootstrap
server to write the prompt's held blocks into the blocks D allocated, naming
D's transfer-engine session and KV base addresses. Every job ends exactly
once, in ``finished_recving`` (so vLLM leaves WAITING_FOR_REMOTE_KVS or frees
an aborted request's blocks), with the number of leading blocks that landed
in the worker metadata (push_scheduler.py cuts back the rest). Errors,
non-200 answers and timeouts (``MOONCAKE_PUSH_TIMEOUT_S``, default 60) land 0
blocks. A timed-out push may still be written by C later: its blocks are then
recomputed locally by this request and the late bytes are identical KV for
the same tokens, but C does not stop the write (documented limitation).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push_scheduler import (
    ENV_PUSH_TIMEOUT,
    PushJob,
    PushOutcome,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


class PushReceiver:
    def __init__(self, session: str, base_addrs: list[int], block_len: int, block_size: int,
                 timeout_s: float | None = None):
        self.session = session
        self.base_addrs = list(base_addrs)
        self.block_len = block_len
        self.block_size = block_size
        self.timeout_s = float(timeout_s if timeout_s is not None
                               else os.environ.get(ENV_PUSH_TIMEOUT, "60"))
        self._pool: ThreadPoolExecutor | None = None
        self._http = httpx.Client(timeout=self.timeout_s)  # keep-alive, one SSL context
        self._lock = threading.Lock()
        self._done: dict[str, int] = {}  # ended, not yet reported
        self._outcome: dict[str, int] = {}  # reported in finished_recving, not yet in meta

    def start(self, jobs: list[PushJob]) -> None:
        if not jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix="mooncake-push-recv")
        for job in jobs:
            self._pool.submit(self._run, job)

    def _run(self, job: PushJob) -> None:
        landed = 0
        try:
            r = self._http.post(f"{job.source}/push_blocks", json={
                "token_ids": job.token_ids, "cache_salt": job.cache_salt,
                "lora_name": job.lora_name, "block_size": self.block_size,
                "dst_session": self.session, "dst_kv_base_addrs": self.base_addrs,
                "dst_block_ids": job.dst_block_ids, "first_block": job.first_block,
                "block_len": self.block_len, "request_id": job.req_id})
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") \
                else {"message": r.text[:300]}
            if r.status_code == 200 and body.get("status") == "ok":
                landed = int(body.get("pushed_blocks", 0))
                logger.debug("push for %s: %d blocks in %.3f s", job.req_id, landed,
                             body.get("seconds", 0.0))
            else:
                logger.warning("push for %s from %s: HTTP %d %s", job.req_id, job.source,
                               r.status_code, body)
        except Exception as e:  # unreachable, timeout, bad answer: local prefill
            logger.warning("push for %s from %s failed: %r", job.req_id, job.source, e)
        with self._lock:
            self._done[job.req_id] = landed

    def merge_finished(self, finished_recving: set[str] | None) -> set[str] | None:
        """Add the pushes that ended since the last step to vLLM's finished_recving."""
        with self._lock:
            if not self._done:
                return finished_recving
            done, self._done = self._done, {}
        self._outcome.update(done)
        return (finished_recving or set()) | set(done)

    def take_outcome(self) -> PushOutcome | None:
        if not self._outcome:
            return None
        out, self._outcome = PushOutcome(self._outcome), {}
        return out
