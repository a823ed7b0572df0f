# SPDX-License-Identifier: Apache-2.0
"""D's scheduler side of prefix push migration (C's POST /push_blocks, server.py).

A request whose ``kv_transfer_params`` hold ``{"push_from": "<C's bootstrap
URL>"}`` (and no ``do_remote_prefill``) asks C, in a background thread, how
many leading full blocks of its prompt C's prefix cache holds
(``/match_blocks``); until the answer is in, ``get_num_new_matched_tokens``
returns ``None`` (vLLM keeps the request waiting and asks again next step).
The held blocks beyond D's own prefix hit are counted as external tokens and
loaded asynchronously: D's worker posts ``/push_blocks`` with the blocks
vLLM allocated (receiver.py) and reports, through the worker metadata,
how many landed. If fewer landed than promised (C evicted them, the write
failed, C is unreachable, a timeout), the request's computed tokens are cut
back to what landed *before* vLLM caches the blocks, so the rest is prefilled
locally whatever ``kv_load_failure_policy`` says: never lost, never stuck.
A failed or slow ``/match_blocks`` means no push at all.

A request that finishes while its push is in flight keeps its blocks until
the worker reports the push ended, which it does only once C can no longer
write into them (receiver.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from vllm.logger import init_logger

from ..auth import client_headers
from ..config import ConfigError, ExtConfig, normalize_source
from .protocol import KVFingerprint, MatchBlocksRequest, MatchBlocksResponse, PushJob, PushOutcome

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = init_logger(__name__)

PARAM_PUSH_FROM = "push_from"


def push_source(request: "Request") -> str | None:
    params = request.kv_transfer_params or {}
    src = params.get(PARAM_PUSH_FROM)
    if not src or params.get("do_remote_prefill"):
        return None
    return str(src)[:512].rstrip("/")


def lora_name(request: "Request") -> str | None:
    lora = getattr(request, "lora_request", None)
    return lora.lora_name if lora is not None else None


@dataclass
class _Inflight:
    request: "Request"
    source: str
    first_block: int
    n_blocks: int
    asked: float  # first get_num_new_matched_tokens
    matched: float  # /match_blocks answered
    allocated: float = field(default_factory=time.monotonic)


class PushScheduler:
    def __init__(self, block_size: int, config: ExtConfig, fingerprint: KVFingerprint):
        self.block_size = block_size
        self.config = config
        self.fingerprint = fingerprint  # this instance's (scheduler-side fields)
        self.match_timeout_s = config.push_match_timeout_s
        self._pool: ThreadPoolExecutor | None = None
        # one client for all queries: keep-alive, and httpx builds an SSL
        # context per client (tens of ms)
        self._http: httpx.Client | None = None
        self._matches: dict[str, Future] = {}  # req id -> matched blocks (or raises)
        self._times: dict[str, tuple[float, float]] = {}  # req id -> (asked, matched)
        self._planned: dict[str, tuple[str, int, int]] = {}  # req id -> (source, first, n)
        self._inflight: dict[str, _Inflight] = {}
        # pushes that ended: vLLM asks again when a request is back to 0 computed
        # tokens (nothing landed); it must then prefill locally, not push again
        self._ended: set[str] = set()
        self._jobs: list[PushJob] = []
        self.stats = {"requests": 0, "pushed_blocks": 0, "fallback_blocks": 0, "match_failed": 0,
                      "refused_sources": 0}

    def handles(self, request: "Request") -> bool:
        return push_source(request) is not None

    # ---- get_num_new_matched_tokens ----------------------------------------------
    def _query(self, source: str, request: "Request") -> int:
        if self._http is None:
            self._http = httpx.Client(timeout=self.match_timeout_s)
        body = MatchBlocksRequest(token_ids=list(request.prompt_token_ids or []),
                                  cache_salt=request.cache_salt, lora_name=lora_name(request))
        r = self._http.post(f"{source}/match_blocks", content=body.model_dump_json(),
                            headers=client_headers(self.config), timeout=self.match_timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"{source}/match_blocks answered {r.status_code}: {r.text[:300]}")
        resp = MatchBlocksResponse.model_validate_json(r.content[:1 << 20])
        diff = self.fingerprint.differences(resp.fingerprint, "this instance", source)
        if diff:
            raise RuntimeError("its KV cache is incompatible with this instance's: "
                               + "; ".join(diff))
        return resp.matched_blocks

    def _allowed(self, rid: str, source: str) -> bool:
        try:
            ok = normalize_source(source) in self.config.push_sources
        except ConfigError:
            ok = False
        if not ok:
            self.stats["refused_sources"] += 1
            logger.warning("Prefix push for %s: push_from %r is not in MOONCAKE_PUSH_SOURCES "
                           "(%s); prefilling locally", rid, source,
                           ", ".join(self.config.push_sources) or "empty: no push source allowed")
        return ok

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        rid, source = request.request_id, push_source(request)
        assert source is not None
        if rid in self._inflight or rid in self._ended:
            return 0, False
        fut = self._matches.get(rid)
        if fut is None and not self._allowed(rid, source):
            self._ended.add(rid)
            return 0, False
        if fut is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="mooncake-push-match")
            self._matches[rid] = self._pool.submit(self._query, source, request)
            self._times[rid] = (time.monotonic(), 0.0)
            return None, False  # asked again next step
        if not fut.done():
            if time.monotonic() - self._times[rid][0] < self.match_timeout_s:
                return None, False
            # a total deadline (httpx's timeouts are per read): stop waiting
            fut.cancel()
            logger.warning("Prefix push for %s: %s/match_blocks did not answer within %.1f s; "
                           "prefilling locally", rid, source, self.match_timeout_s)
            self.stats["match_failed"] += 1
            matched = 0
        else:
            matched = self._match_result(fut, rid, source)
        full_blocks = len(request.prompt_token_ids or []) // self.block_size
        matched = max(0, min(matched, full_blocks))  # never more than the prompt holds
        asked = self._times.get(rid, (time.monotonic(), 0.0))[0]
        self._times[rid] = (asked, time.monotonic())
        first = num_computed_tokens // self.block_size
        n = matched - first
        if n <= 0:
            self._planned.pop(rid, None)
            self._times.pop(rid, None)
            return 0, False
        self._planned[rid] = (source, first, n)
        return n * self.block_size, True

    def _match_result(self, fut: Future, rid: str, source: str) -> int:
        try:
            return fut.result()
        except Exception as e:
            logger.warning("Prefix push for %s: no match from %s (%s); prefilling locally",
                           rid, source, e)
            self.stats["match_failed"] += 1
            return 0

    # ---- allocation -> job ---------------------------------------------------------
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        plan = self._planned.pop(rid, None)
        self._matches.pop(rid, None)
        if plan is None or num_external_tokens == 0:
            return
        source, first, n = plan
        assert num_external_tokens == n * self.block_size, (num_external_tokens, n)
        block_ids = blocks.get_block_ids()[0]
        dst = list(block_ids[first:first + n])
        assert len(dst) == n, f"{len(dst)} blocks allocated for {n} pushed blocks"
        asked, matched_at = self._times.pop(rid, (time.monotonic(), time.monotonic()))
        self._inflight[rid] = _Inflight(request, source, first, n, asked, matched_at)
        self._jobs.append(PushJob(rid, source, tuple(request.prompt_token_ids or ()),
                                  request.cache_salt, lora_name(request), first, tuple(dst)))
        self.stats["requests"] += 1

    def take_jobs(self) -> list[PushJob]:
        jobs, self._jobs = self._jobs, []
        return jobs

    # ---- worker outcome --------------------------------------------------------------
    def on_worker_meta(self, meta: Any) -> None:
        """Before vLLM handles finished_recving: cut back what did not land."""
        if not isinstance(meta, PushOutcome):
            return
        for rid, landed in meta.landed.items():
            inf = self._inflight.pop(rid, None)
            if inf is None:
                continue
            self._ended.add(rid)
            landed = max(0, min(landed, inf.n_blocks))
            self.stats["pushed_blocks"] += landed
            now = time.monotonic()
            logger.info("Prefix push for %s from %s: %d/%d blocks; match %.0f ms, scheduled "
                        "after %.0f ms, push %.0f ms", rid, inf.source, landed, inf.n_blocks,
                        1e3 * (inf.matched - inf.asked), 1e3 * (inf.allocated - inf.matched),
                        1e3 * (now - inf.allocated))
            if landed < inf.n_blocks:
                missing = inf.n_blocks - landed
                self.stats["fallback_blocks"] += missing
                req = inf.request
                req.num_computed_tokens = (inf.first_block + landed) * self.block_size
                req.num_external_computed_tokens = landed * self.block_size
                logger.warning("Prefix push for %s from %s: %d of %d blocks landed; "
                               "prefilling the other %d tokens locally", rid, inf.source,
                               landed, inf.n_blocks, missing * self.block_size)

    # ---- end of request ----------------------------------------------------------------
    def request_finished(self, request: "Request") -> bool:
        """True (delay freeing the blocks) while C may still write into them."""
        rid = request.request_id
        self._planned.pop(rid, None)
        self._times.pop(rid, None)
        self._ended.discard(rid)
        fut = self._matches.pop(rid, None)
        if fut is not None:
            fut.cancel()
        return rid in self._inflight
