# SPDX-License-Identifier: Apache-2.0
"""D's scheduler side of prefix push: ask a source, count held blocks as external.

A request naming ``push_from`` in its ``kv_transfer_params`` (a source's
bootstrap URL, or "auto": the allowed source whose feed holds the longest run,
decode_index.py; with MOONCAKE_PUSH_AUTO=1 any request), outside upstream's P/D
path, asks the source's ``/match_blocks`` in the background (``None`` until it
answers). The held blocks beyond D's own hit load asynchronously
(decode_receiver.py); if fewer land than promised, the computed tokens are cut
back before vLLM caches the blocks, so the rest is prefilled locally: never lost,
never stuck. A failed or slow match, a clock skew beyond
MOONCAKE_PUSH_CLOCK_SKEW_S, an incompatible, refused or failing source, or a
prompt whose KV depends on more than its tokens means local prefill. Blocks C
may write into stay held (with the request, or pinned once a push past its
budget released it) until the worker reports the push ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from ..common.auth import request_headers
from ..common.config import ExtConfig
from ..common.counters import Counters
from ..common.fingerprint import WarnLimiter
from ..common.peer_client import SourceLanes, source_origin
from ..common.write_bounds import ENGINE_RECONNECT_MAX_S, LINUX_ORPHAN_RETRIES
from .decode_coalesce import PrefixClaims
from .decode_cost import (
    FAILURES_TO_DEMOTE,
    IDLE,
    PROBE_AFTER_S,
    Decision,
    PrefillTimer,
    PushCostModel,
    SourceLoad,
)
from .decode_index import FeedFollower, HeldPrefix, HolderIndex
from .protocol import (
    KVFingerprint,
    MatchBlocksRequest,
    MatchBlocksResponse,
    PushJob,
    PushOutcome,
    rank_urls,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = init_logger(__name__)

PARAM_PUSH_FROM = "push_from"
AUTO = "auto"  # push_from: D picks the source (decode_index.py)
MATCH_THREADS_PER_SOURCE = 4
# a source's reported load (MatchBlocksResponse) is trusted within these bounds
MAX_REPORTED_SLOTS = 4096
MAX_REPORTED_BACKLOG = 1 << 40  # tokens
LOAD_FRESH_S = 2.0  # a source's last reported backlog counts this long after it
# In a step, D waits for sources' /match_blocks answers at most this long, and at
# most this share of its last step (a GPU's step of 30 ms: 7.5 ms)
MATCH_INLINE_MAX_S = 0.05
MATCH_INLINE_STEP_SHARE = 0.25
# A local prefill behind a push in flight waits for its landing at most this long,
# and at most the local prefill the push saves (PushScheduler.held_back)
LANDING_HOLD_MAX_S = 2.0


class ClockSkewError(RuntimeError):
    """The source's clock is too far from this instance's for a bounded hold."""


class IncompatibleSourceError(RuntimeError):
    """The source's KV cache differs from this instance's (its fingerprint)."""


class SourceRefusedError(RuntimeError):
    """The source refused the match or was busy (an answer other than 200), or
    this instance refuses the source (its engine timeout or orphan retries)."""


def unpushable(request: Request) -> str | None:
    """What makes a request's KV depend on more than its token ids, which are all a
    source matches by (its hashes carry no image, audio or embeddings, and a LoRA
    adapter only by name): such a request is prefilled locally (None: none)."""
    if getattr(request, "mm_features", None):
        kinds = sorted(
            {str(getattr(f, "modality", "multimodal")) for f in request.mm_features}
        )
        return f"{'/'.join(kinds)} input"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    return None


@dataclass(frozen=True)
class _Match:
    blocks: int  # leading full blocks of the prompt the source holds
    engine_timeout_s: int  # the source's
    source_id: str  # the source's name, sent back in the push request
    tcp_orphan_retries: int | None = None  # the source's kernel's (None: ours)
    round_trip_s: float = 0.0  # the /match_blocks call, as D timed it
    engine_no_progress_s: int | None = None  # the source's transport's (None: ours)
    engine_reconnect_s: int | None = None  # the source's transport's (None: ours)
    load: SourceLoad = IDLE  # as the source reported it, bounded (reported_load)
    # TP > 1: where each of D's ranks asks (protocol.rank_urls)
    rank_urls: tuple[str, ...] = ()


def reported_load(resp: MatchBlocksResponse) -> SourceLoad:
    """A source's load from its /match_blocks answer, each number bounded (a peer
    is not trusted: a value out of range counts as not said)."""
    slots = resp.push_slots
    if slots is not None and not 0 < slots <= MAX_REPORTED_SLOTS:
        slots = None
    most = slots or MAX_REPORTED_SLOTS  # a source counts those within its limit
    in_flight = resp.pushes_in_flight
    backlog = resp.prefill_backlog_tokens
    return SourceLoad(
        pushes_in_flight=in_flight if in_flight and 0 < in_flight <= most else 0,
        push_slots=slots,
        backlog_tokens=backlog
        if backlog and 0 < backlog <= MAX_REPORTED_BACKLOG
        else 0,
    )


def push_source(request: Request) -> str | None:
    params = request.kv_transfer_params or {}
    src = params.get(PARAM_PUSH_FROM)
    if not src or params.get("do_remote_prefill"):
        return None
    return str(src)[:512].rstrip("/")


def is_waiting_for_remote_kvs(request: Request) -> bool:
    """The request waits in WAITING_FOR_REMOTE_KVS (its push not yet ended)."""
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def lora_name(request: Request) -> str | None:
    lora = getattr(request, "lora_request", None)
    return lora.lora_name if lora is not None else None


@dataclass
class _Inflight:
    request: Request
    source: str
    first_block: int
    n_blocks: int
    asked: float  # first get_num_new_matched_tokens
    matched: float  # /match_blocks answered, as the scheduler saw it
    allocated: float = field(default_factory=time.monotonic)
    finished: bool = False  # request_finished while the push was in flight
    auto: bool = False  # the source was picked from the index
    budget_s: float = 0.0  # the push's timeout (PushJob.timeout_s)
    late: bool = False  # not ended within twice its budget: counted as failed
    # the blocks the source writes into (vLLM's KVCacheBlock objects)
    blocks: list[Any] = field(default_factory=list)
    # past its budget the request took other blocks; these stay pinned (one
    # reference of this scheduler's) until the push ended
    released: bool = False
    load: SourceLoad = IDLE  # its source's when it was granted (decode_cost.py)
    answer_s: float = 0.0  # the /match_blocks call's own time (_Match.round_trip_s)
    hold_s: float = 0.0  # local prefills behind it wait this long at most (held_back)


class PushScheduler:
    def __init__(
        self,
        block_size: int,
        config: ExtConfig,
        fingerprint: KVFingerprint,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        workers: int = 1,
        pipeline_parallel: int = 1,
    ):
        self.block_size = block_size
        # D's workers (vLLM's world size): each ends its own rank's push
        self.workers = workers
        # a push moves every layer into one stage's workers: none with stages
        self.pipeline_parallel = pipeline_parallel
        # req id -> (workers whose end came in, fewest blocks landed, refused by any)
        self._partial: dict[str, tuple[int, int, bool]] = {}
        self.config = config
        self.fingerprint = fingerprint  # this instance's (scheduler-side fields)
        self.match_timeout_s = config.push_match_timeout_s
        self._wall_clock = wall_clock
        self._clock = clock  # monotonic: pushes' allocation, end and lateness
        # per source: its threads and connections; every call bounded in time and bytes
        self._lanes = SourceLanes("mooncake-push-match", MATCH_THREADS_PER_SOURCE)
        self._matches: dict[str, Future] = {}  # req id -> _Match (or raises)
        # this step's inline wait for matches left (s), and when the step began
        self._inline_left = 0.0
        self._step_at: float | None = None
        self._times: dict[str, tuple[float, float]] = {}  # req id -> (asked, matched)
        # req id -> (source, first, n, the source's match answer)
        self._planned: dict[str, tuple[str, int, int, _Match]] = {}
        self._inflight: dict[str, _Inflight] = {}
        # pushes that ended: vLLM asks again when a request is back to 0 computed
        # tokens (nothing landed); it must then prefill locally, not push again.
        # Emptied by request_finished, or, for a request that finished before
        # its push ended, at the next step (nothing asks about it any more).
        self._ended: set[str] = set()
        self._ended_finished: list[str] = []
        self._jobs: list[PushJob] = []
        self._auto: dict[str, HeldPrefix] = {}  # req id -> the source picked for it
        # source key -> its last reported load and when (allowed sources only)
        self._loads: dict[str, tuple[SourceLoad, float]] = {}
        self.index: HolderIndex | None = None
        self._follower: FeedFollower | None = None
        self.stats = Counters(
            requests=0,
            pushed_blocks=0,
            fallback_blocks=0,
            match_failed=0,
            slow_matches=0,  # given up after the local prefill's time (match_wait_s)
            refused_sources=0,
            refused_clock_skew=0,
            auto_asked=0,
            auto_no_holder=0,
            auto_picked=0,
            auto_missed=0,
            failed_pushes=0,
            late_pushes=0,
            released_pushes=0,  # past their budget: prefilled in other blocks
            coalesced=0,  # requests that waited for another's push of their prefix
            source_full=0,  # not asked to push: every slot of the source taken
            held_for_landing=0,  # local prefills that waited for a push ahead of them
        )

        # every request this instance considered for a push, once, by what became
        # of it (decode_cost.Decision); the worker serves them on /metrics
        self.decisions = Counters(**{d.value: 0 for d in Decision})
        self._decided: set[str] = set()  # req ids counted (a preempted one asks again)
        self._granted: set[str] = set()  # req ids judged worth a push (judged once)
        self._decisions_sent: dict[str, int] | None = None
        # the scheduler's KV cache manager (bind_kv_cache_manager): without it a
        # request waits for its push's end, however long, and keeps its blocks
        self._kv_cache_manager: Any = None
        # released requests whose push ended this step: not in vLLM's
        # finished_recving (the request is no longer waiting for it)
        self._ended_released: set[str] = set()
        # pushes past their budget whose request could not be released yet (too
        # few free blocks for its prompt): tried again with each output
        self._due: set[str] = set()
        # which request fetches which prompt block; who waits for another's
        # push, since when (decode_coalesce.py)
        self.claims = PrefixClaims(block_size)
        self._coalescing: dict[str, float] = {}
        # req id -> since when its local prefill waits for pushes ahead (held_back)
        self._held: dict[str, float] = {}
        self.cost = PushCostModel(
            config.push_min_tokens, clock, always=config.push_policy == "always"
        )
        # local prefills are timed only where a push could replace one
        self.prefill_timer = PrefillTimer(self.cost) if config.push_sources else None
        # this instance's requests whose prompt is not computed, but the one named
        # (scheduler_extension.PrefillBacklog.queued; None: not counted)
        self.own_queue: Callable[[str], int] | None = None
        self._warnings = WarnLimiter(logger)
        if config.push_auto:
            if config.push_sources:
                self._holder_index()
            else:
                logger.warning(
                    "MOONCAKE_PUSH_AUTO=1 but MOONCAKE_PUSH_SOURCES is empty: no source "
                    "to push from; every request is prefilled locally"
                )

    def _holder_index(self) -> HolderIndex | None:
        """The index of the allowed sources' feeds, started on first use."""
        if self.index is None and self.config.push_sources:
            self.index = HolderIndex(
                self.config.push_sources,
                self.block_size,
                self.config.push_index_max_blocks,
            )
            self._follower = FeedFollower(self.index, self.config)
            logger.info(
                'Prefix push: following the feeds of %s for push_from "auto"',
                ", ".join(self.config.push_sources),
            )
        return self.index

    def source_of(self, request: Request) -> str | None:
        """The source a request names, AUTO, or None (no push)."""
        src = push_source(request)
        if src is None and self.config.push_auto:
            params = request.kv_transfer_params or {}
            if not params.get("do_remote_prefill"):
                return AUTO
        return src

    def _pick(self, request: Request, num_computed_tokens: int) -> HeldPrefix | None:
        """The allowed source whose feed holds the longest run of the prompt's leading
        blocks beyond this instance's own hit (None: none)."""
        self.stats.add(auto_asked=1)
        index = self._holder_index()
        if index is None:
            self._warnings.warn(
                "auto:no-sources",
                "Prefix push for %s (and every request asking for it): push_from "
                '"auto" but MOONCAKE_PUSH_SOURCES is empty; prefilling locally',
                request.request_id,
            )
            held = None
        else:
            held = index.best(
                request.prompt_token_ids or [],
                request.cache_salt,
                lora_name(request),
                num_computed_tokens // self.block_size,
            )
        self.stats.add(**{"auto_picked" if held is not None else "auto_no_holder": 1})
        return held

    def handles(self, request: Request) -> bool:
        """A request naming a push source, unless it is on upstream's P/D path
        (owning it would skip upstream's bookkeeping of that transfer)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("do_remote_decode") or params.get("do_remote_prefill"):
            return False
        if self.source_of(request) is None:
            return False
        if self.pipeline_parallel > 1:
            self._warnings.warn(
                "pipeline",
                "Prefix push for %s (and every request asking for it): this instance "
                "runs %d pipeline stages, which prefix push does not serve; prefilling "
                "locally",
                request.request_id,
                self.pipeline_parallel,
            )
            return False
        return True

    def shutdown(self) -> None:
        """Cancel queued queries, abort running ones, close the connections."""
        self._lanes.shutdown()
        if self._follower is not None:
            self._follower.shutdown()

    # ---- get_num_new_matched_tokens ----------------------------------------------
    def _query(self, source: str, request: Request, deadline: float) -> _Match:
        body = MatchBlocksRequest(
            token_ids=list(request.prompt_token_ids or []),
            cache_salt=request.cache_salt,
            lora_name=lora_name(request),
        )
        sent, started = self._wall_clock(), time.monotonic()
        content = body.model_dump_json().encode()
        r = self._lanes.post(
            source,
            "/match_blocks",
            content,
            request_headers(self.config, "POST", "/match_blocks", content),
            deadline,
        )
        received, round_trip = self._wall_clock(), time.monotonic() - started
        if r.status == 503:  # not ready (its TP ranks, its first step): each request
            # meets it alike, so one warning per interval
            raise IncompatibleSourceError(f"it is not ready: {r.text()[:300]}")
        if r.status != 200:
            raise SourceRefusedError(
                f"{source}/match_blocks answered {r.status}: {r.text()}"
            )
        resp = MatchBlocksResponse.model_validate_json(r.body)
        diff = self.fingerprint.differences(resp.fingerprint, "this instance", source)
        if diff:
            raise IncompatibleSourceError(
                "its KV cache is incompatible with this instance's: " + "; ".join(diff)
            )
        # C read its clock between D's send and receive: the skew is C's clock minus
        # the midpoint, give or take half the round trip
        skew = resp.now_unix_ms / 1000 - (sent + received) / 2
        uncertainty = max(0.0, received - sent) / 2
        allowance = self.config.push_clock_skew_s
        if abs(skew) + uncertainty > allowance:
            raise ClockSkewError(
                f"its clock is {abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} this "
                f"instance's (measured give or take {uncertainty:.3f} s), more than "
                f"MOONCAKE_PUSH_CLOCK_SKEW_S={allowance:g} allows: this instance could not "
                "bound how long the source may write into its blocks. Synchronize the "
                "clocks (NTP), or raise MOONCAKE_PUSH_CLOCK_SKEW_S on this instance (it "
                "lengthens how long a push's blocks are held when the source does not "
                "answer)"
            )
        try:  # equal fingerprints: C's TP size is this instance's
            ranks = rank_urls(source, resp.rank_ports, self.fingerprint.tp_size)
        except ValueError as e:
            raise IncompatibleSourceError(
                f"{e}: its TP ranks cannot be asked"
            ) from None
        accepted = self.config.push_source_timeout_max_s
        if not 0 < resp.engine_timeout_s <= accepted:
            raise SourceRefusedError(
                f"it reports an engine timeout (its MC_TRANSFER_TIMEOUT) of "
                f"{resp.engine_timeout_s} s; this instance accepts 1 .. {accepted} s "
                "(MOONCAKE_PUSH_SOURCE_TIMEOUT_MAX_S): a push from it could hold this "
                "instance's blocks for longer. Lower the source's MC_TRANSFER_TIMEOUT "
                "or raise MOONCAKE_PUSH_SOURCE_TIMEOUT_MAX_S here"
            )
        retries = resp.tcp_orphan_retries
        most = max(LINUX_ORPHAN_RETRIES, self.config.tcp_orphan_retries)
        if retries is not None and not 0 < retries <= most:
            raise SourceRefusedError(
                f"it reports net.ipv4.tcp_orphan_retries={retries} (as its kernel applies "
                f"it); this instance accepts 1 .. {most} (the kernel's default, or its "
                "own if larger): a write of it cut off mid-way could land in this "
                "instance's blocks for longer than it would hold them. Lower the "
                "source's setting or raise this instance's"
            )
        stall = resp.engine_no_progress_s
        stall_most = max(accepted, self.config.engine_no_progress_s)
        if stall is not None and not 0 < stall <= stall_most:
            raise SourceRefusedError(
                f"it reports a transport no-progress watchdog (its "
                f"MC_TCP_PROGRESS_TIMEOUT_SEC / MC_TCP_STATUS_TIMEOUT_SEC) of {stall} s; "
                f"this instance accepts 1 .. {stall_most} s "
                "(MOONCAKE_PUSH_SOURCE_TIMEOUT_MAX_S, or its own if larger): a write of "
                "it that stalls could land in this instance's blocks for longer than it "
                "would hold them. Lower the source's setting or raise "
                "MOONCAKE_PUSH_SOURCE_TIMEOUT_MAX_S here"
            )
        reconnect = resp.engine_reconnect_s
        reconnect_most = max(ENGINE_RECONNECT_MAX_S, self.config.engine_reconnect_s)
        if reconnect is not None and not 0 < reconnect <= reconnect_most:
            raise SourceRefusedError(
                f"it reports a transport reconnect of {reconnect} s (its "
                "MC_TCP_LANES_PER_PEER connections, each up to its kernel's "
                "net.ipv4.tcp_syn_retries span); this instance accepts 1 .. "
                f"{reconnect_most} s (the engine's default lanes with the kernel's "
                "default, or its own if larger): a write of it could land in this "
                "instance's blocks for longer than it would hold them. Lower the "
                "source's MC_TCP_LANES_PER_PEER or tcp_syn_retries"
            )
        return _Match(
            resp.matched_blocks,
            resp.engine_timeout_s,
            resp.source_id,
            retries,
            round_trip,
            stall,
            reconnect,
            reported_load(resp),
            ranks,
        )

    def _allowed(self, rid: str, source: str) -> bool:
        """Only an allowed source gets a lane (threads, connections): their number
        is bounded by the allowlist."""
        try:  # an origin and nothing else: D builds every URL from it (common/peer_client.py)
            origin, why = source_origin(source), "is not in"
        except ValueError as e:
            origin, why = None, f"is not a bare scheme://host:port ({e}), so not in"
        ok = origin is not None and origin in self.config.push_sources
        if not ok:
            self.stats.add(refused_sources=1)
            # any client names push_from: at most one warning per source per interval
            self._warnings.warn(
                f"refused:{origin or str(source)[:100]}",
                "Prefix push for %s (and later "
                "requests from this source for a while): push_from %r %s "
                "MOONCAKE_PUSH_SOURCES (%s); prefilling locally",
                rid,
                str(source)[:100],
                why,
                ", ".join(self.config.push_sources) or "empty: no push source allowed",
            )
        return ok

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid, source = request.request_id, self.source_of(request)
        assert source is not None
        if rid in self._inflight or rid in self._ended:
            return 0, False
        fut = self._matches.get(rid)
        if fut is None and (why := unpushable(request)) is not None:
            self._warnings.warn(
                f"unpushable:{why}",
                "Prefix push for %s (and any other request with %s): "
                "prefilling locally; a source matches a prompt by its token ids alone, "
                "which do not describe this request's KV",
                rid,
                why,
            )
            self._ended.add(rid)
            self._decide(rid, Decision.REFUSED)
            return 0, False
        if source == AUTO:
            held = self._auto.get(rid) or self._pick(request, num_computed_tokens)
            if held is None:
                self._ended.add(rid)
                self._decide(rid, Decision.NO_HOLDER)
                return 0, False
            self._auto[rid] = held
            source = held.origin
            first = num_computed_tokens // self.block_size
            if fut is None and not self.pays(
                rid, source, held.blocks - first, first * self.block_size
            ):
                self._ended.add(rid)  # judged before asking the source anything
                return 0, False
        if fut is None and not self._allowed(rid, source):
            self._ended.add(rid)
            self._decide(rid, Decision.REFUSED)
            return 0, False
        if (
            fut is None
            and rid not in self._granted  # auto: judged above
            and self.cost.failing(SourceLanes.key(source))
        ):
            # NOTE: a named source too: its match would be a round trip for nothing
            logger.debug(
                "Prefix push for %s from %s: the source is failing (its last pushes "
                "landed nothing); prefilling locally",
                rid,
                source,
            )
            self._ended.add(rid)
            self._decide(rid, Decision.NOT_WORTH_IT)
            return 0, False
        if fut is None and self._waits_for_another(
            request, source, num_computed_tokens
        ):
            return None, False
        if fut is None:
            asked = time.monotonic()
            try:
                self._matches[rid] = self._lanes.submit(
                    source, self._query, source, request, asked + self.match_timeout_s
                )
                # its next block is fetched by it: others wanting it wait
                self.claims.claim(
                    request,
                    lora_name(request),
                    SourceLanes.key(source),
                    num_computed_tokens // self.block_size,
                    1,
                )
            except RuntimeError as e:  # shut down
                logger.warning("Prefix push for %s: %s; prefilling locally", rid, e)
                self._ended.add(rid)
                self._decide(rid, Decision.FELL_BACK)
                return 0, False
            self._times[rid] = (asked, 0.0)
            fut = self._matches[rid]
            if not self._answered_inline(fut):
                return None, False  # asked again next step
        full_blocks = len(request.prompt_token_ids or []) // self.block_size
        match: _Match | None = None
        if not fut.done():
            waited = time.monotonic() - self._times[rid][0]
            held = self._auto.get(rid)
            blocks = held.blocks if held is not None else full_blocks
            first = num_computed_tokens // self.block_size
            patience = self.cost.match_wait_s(
                (blocks - first) * self.block_size,
                self.match_timeout_s,
                self._queued(rid),
                first * self.block_size,
            )
            if waited < patience:
                return None, False
            # the query's own deadline ends it (common/peer_client.py); stop waiting for it now
            fut.cancel()
            if patience < self.match_timeout_s:
                # a busy source answers late (its one core computing): by now the
                # local prefill would have ended, so waiting on cannot pay; the
                # wait counts as its round trip, so the next requests are judged
                # with it before they ask. No answer is no miss of its feed, so
                # the request's push ends here: asked again, it prefills
                self.cost.observe_round_trip(SourceLanes.key(source), waited)
                self.stats.add(slow_matches=1)
                self._decide(rid, Decision.SLOW_MATCH)
                logger.debug(
                    "Prefix push for %s: %s/match_blocks not answered after %.0f ms, "
                    "the local prefill's time; prefilling locally",
                    rid,
                    source,
                    1e3 * waited,
                )
                self._ended.add(rid)
                self._matches.pop(rid, None)
                self._times.pop(rid, None)
                self.claims.drop(rid)
                return 0, False
            logger.warning(
                "Prefix push for %s: %s/match_blocks did not answer within %.1f s; "
                "prefilling locally",
                rid,
                source,
                self.match_timeout_s,
            )
            self.stats.add(match_failed=1)
            self._decide(rid, Decision.FELL_BACK)
        else:
            match = self._match_result(fut, rid, source)
            if match is not None:
                self.cost.observe_round_trip(
                    SourceLanes.key(source), match.round_trip_s
                )
                self._loads[SourceLanes.key(source)] = (match.load, self._clock())
        held = self._auto.get(rid)
        if held is not None and (match is None or match.blocks < held.blocks):
            # judged once: vLLM may ask again (a preempted request)
            self._auto[rid] = HeldPrefix(held.origin, match.blocks if match else 0)
            self._missed(
                held.origin,
                f"its feed advertised {held.blocks} blocks of a prompt, /match_blocks "
                f"{'failed' if match is None else f'found {match.blocks}'}",
            )
        # never more than the prompt holds
        matched = max(0, min(match.blocks, full_blocks)) if match is not None else 0
        asked = self._times.get(rid, (time.monotonic(), 0.0))[0]
        self._times[rid] = (asked, time.monotonic())
        first = num_computed_tokens // self.block_size
        n = matched - first
        if n <= 0 or not self.pays(rid, source, n, first * self.block_size):
            self._decide(rid, Decision.NO_HOLDER)  # unless counted already
            self._planned.pop(rid, None)
            self._times.pop(rid, None)
            return 0, False
        assert match is not None
        if rid not in self._planned:  # vLLM asks again while no blocks are free
            self.claims.claim(
                request, lora_name(request), SourceLanes.key(source), first, n
            )
        self._planned[rid] = (source, first, n, match)
        return n * self.block_size, True

    # ---- coalescing ------------------------------------------------------------------
    def _fetching(self, rid: str) -> bool:
        """Whether ``rid`` still matches, or pushes within its budget (claims stand)."""
        fut = self._matches.get(rid)
        inf = self._inflight.get(rid)
        return (
            (fut is not None and not fut.done())
            or rid in self._planned
            or (
                inf is not None
                and not inf.released
                and self._clock() - inf.allocated < inf.budget_s
            )
        )

    def _waits_for_another(
        self, request: Request, source: str, num_computed_tokens: int
    ) -> bool:
        """Whether another request fetches this one's first block beyond D's hit
        from ``source``: it waits, at most the push plus the match timeout."""
        rid = request.request_id
        first = num_computed_tokens // self.block_size
        holder = self.claims.holder(
            request, lora_name(request), SourceLanes.key(source), first
        )
        if holder is not None and holder != rid and not self._fetching(holder):
            self.claims.drop(holder)
            holder = None
        if holder is None or holder == rid:
            self._coalescing.pop(rid, None)
            return False
        now = self._clock()
        since = self._coalescing.get(rid)
        if since is None:
            self._coalescing[rid] = since = now
            self.stats.add(coalesced=1)
            self._decide(rid, Decision.COALESCED)
            logger.debug("Prefix push for %s: waits for %s's push", rid, holder)
        return now - since < self.config.push_timeout_s + self.match_timeout_s

    def _match_result(self, fut: Future, rid: str, source: str) -> _Match | None:
        try:
            return fut.result()
        except ClockSkewError as e:
            logger.warning(
                "Prefix push for %s from %s refused: %s; prefilling locally",
                rid,
                source,
                e,
            )
            self.stats.add(refused_clock_skew=1)
            self._decide(rid, Decision.REFUSED)
        except IncompatibleSourceError as e:
            # every request from this source meets it: one warning per interval
            self._warnings.warn(
                f"incompatible:{source}:{e}",
                "Prefix push for %s (and later "
                "requests while this lasts) refused: %s %s; prefilling locally",
                rid,
                source,
                e,
            )
            self.stats.add(match_failed=1)
            self._decide(rid, Decision.REFUSED)
        except Exception as e:  # SourceRefusedError: refused; anything else: failed
            refused = isinstance(e, SourceRefusedError)
            logger.warning(
                "Prefix push for %s: %s %s (%s); prefilling locally",
                rid,
                source,
                "refused" if refused else "gave no match",
                e,
            )
            self.stats.add(match_failed=1)
            self._decide(rid, Decision.REFUSED if refused else Decision.FELL_BACK)
        return None

    def _decide(self, rid: str, decision: Decision) -> None:
        """Count what became of a request's push, once per request."""
        if rid not in self._decided:
            self._decided.add(rid)
            self.decisions.add(**{decision.value: 1})

    def decisions_changed(self) -> dict[str, int] | None:
        """The decision counters, when they changed since the last call (the
        worker's /metrics serves the last ones it got)."""
        if self.decisions == self._decisions_sent:
            return None
        self._decisions_sent = dict(self.decisions)
        return self._decisions_sent

    def load_of(self, key: str) -> SourceLoad:
        """A source's load as D knows it: its reported figures while fresh, and at
        least D's own pushes from it that still hold a slot there."""
        reported, at = self._loads.get(key, (IDLE, 0.0))
        mine = sum(
            1
            for inf in self._inflight.values()
            if not inf.late and not inf.released and SourceLanes.key(inf.source) == key
        )
        fresh = self._clock() - at < LOAD_FRESH_S
        return SourceLoad(
            pushes_in_flight=max(mine, reported.pushes_in_flight if fresh else 0),
            push_slots=reported.push_slots,
            backlog_tokens=reported.backlog_tokens if fresh else 0,
        )

    def _queued(self, rid: str) -> int:
        """D's requests a local prefill of ``rid`` would delay."""
        return self.own_queue(rid) if self.own_queue is not None else 0

    def pays(self, rid: str, source: str, blocks: int, start: int = 0) -> bool:
        """Whether pushing ``blocks`` from ``source`` after the ``start`` tokens D
        holds is expected to beat prefilling them here (counts the reason when
        not). A request is judged once; after that only the minimum and the
        source's reported load apply."""
        judge, key = rid not in self._granted, SourceLanes.key(source)
        load = self.load_of(key)
        queued = self._queued(rid)
        est = self.cost.decide(key, blocks, self.block_size, judge, load, queued, start)
        if est.decision is None:
            self._granted.add(rid)
            return True
        self._decide(rid, est.decision)
        if est.decision is Decision.REFUSED:
            self.stats.add(source_full=1)
            logger.debug(
                "Prefix push for %s from %s: the source serves %d pushes, its limit "
                "(%s); prefilling locally",
                rid,
                source,
                load.pushes_in_flight,
                load.push_slots,
            )
        elif est.decision is Decision.NOT_WORTH_IT and self.cost.failing(key):
            logger.debug(
                "Prefix push for %s from %s: the source is failing (its last pushes "
                "landed nothing); prefilling locally",
                rid,
                source,
            )
        elif est.decision is Decision.NOT_WORTH_IT:
            logger.debug(
                "Prefix push for %s from %s: %d blocks would take %.1f ms (%d pushes "
                "in flight, %d prompt tokens queued there), their local prefill "
                "%.1f ms (for %d requests queued here); prefilling locally",
                rid,
                source,
                blocks,
                1e3 * (est.transfer_s or 0.0),
                load.pushes_in_flight,
                load.backlog_tokens,
                1e3 * (est.prefill_s or 0.0),
                queued,
            )
        return False

    def _learns_from(self, key: str) -> bool:
        """Whether this source's failures count (a fault-injected one's do not)."""
        kept = self.config.faults.keep_asking_source
        return kept is None or key != SourceLanes.key(kept)

    def _failed(self, source: str, why: str) -> None:
        """A push from ``source`` landed nothing, or is late: one more failure."""
        key = SourceLanes.key(source)
        if not self._learns_from(key):
            return
        if self.cost.failed(key) == FAILURES_TO_DEMOTE:
            logger.warning(
                "Prefix push: %s is not pushed from for %.0f s: its last %d pushes "
                "landed nothing (last: %s); its requests are prefilled locally, then "
                "one push probes it again. Check the source's log and the data "
                "network between it and this instance",
                key,
                PROBE_AFTER_S,
                FAILURES_TO_DEMOTE,
                why,
            )

    def _mark_late(self, now: float) -> None:
        """Count a push not ended within twice its budget as failed now: its
        request and blocks wait for its end, the next requests need not."""
        for rid, inf in self._inflight.items():
            if inf.late or now - inf.allocated < 2 * inf.budget_s:
                continue
            inf.late = True
            self.stats.add(late_pushes=1)
            logger.warning(
                "Prefix push for %s from %s: not ended %.1f s after its blocks were "
                "allocated (its budget: %.1f s); counted as a failure of the source. "
                "Its blocks stay held until the source answers or the push's hold "
                "has passed, then the request is prefilled locally",
                rid,
                inf.source,
                now - inf.allocated,
                inf.budget_s,
            )
            self._failed(inf.source, f"{rid} late")

    def _missed(self, origin: str, why: str) -> None:
        self.stats.add(auto_missed=1)
        if self.index is not None:
            self.index.missed(origin, why)

    # ---- allocation -> job ---------------------------------------------------------
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        plan = self._planned.pop(rid, None)
        self._matches.pop(rid, None)
        self._granted.discard(rid)
        if plan is None or num_external_tokens == 0:
            return
        source, first, n, match = plan
        assert num_external_tokens == n * self.block_size, (num_external_tokens, n)
        block_ids = blocks.get_block_ids()[0]
        dst = list(block_ids[first : first + n])
        assert len(dst) == n, f"{len(dst)} blocks allocated for {n} pushed blocks"
        pushed_into = list(blocks.blocks[0][first : first + n])
        asked, matched_at = self._times.pop(rid, (time.monotonic(), time.monotonic()))
        load = self.load_of(SourceLanes.key(source))
        budget = self.cost.budget_s(
            SourceLanes.key(source), n, self.config.push_timeout_s, load
        )
        self._inflight[rid] = _Inflight(
            request,
            source,
            first,
            n,
            asked,
            matched_at,
            self._clock(),
            auto=self._auto.pop(rid, None) is not None,
            budget_s=budget,
            blocks=pushed_into,
            load=load,
            answer_s=match.round_trip_s,
            hold_s=self._landing_hold_s(first, n, budget),
        )
        self._jobs.append(
            PushJob(
                rid,
                source,
                tuple(request.prompt_token_ids or ()),
                request.cache_salt,
                lora_name(request),
                first,
                tuple(dst),
                source_engine_timeout_s=match.engine_timeout_s,
                source_id=match.source_id,
                source_tcp_orphan_retries=match.tcp_orphan_retries,
                source_engine_no_progress_s=match.engine_no_progress_s,
                source_engine_reconnect_s=match.engine_reconnect_s,
                timeout_s=budget,
                rank_urls=match.rank_urls,
            )
        )
        self.stats.add(requests=1)

    def _landing_hold_s(self, first: int, blocks: int, budget_s: float) -> float:
        """How long local prefills behind a push of ``blocks`` from block ``first``
        wait for it: at most the local prefill it saves (unmeasured:
        LANDING_HOLD_MAX_S)."""
        saves = self.cost.span_s(first * self.block_size, blocks * self.block_size)
        return min(budget_s, LANDING_HOLD_MAX_S, saves or LANDING_HOLD_MAX_S)

    def matched_or_held(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """get_num_new_matched_tokens, but a local prefill held back (held_back)
        is ``None`` (asked again next step, where only the hold is looked at)."""
        if request.request_id not in self._held:
            matched = self.get_num_new_matched_tokens(request, num_computed_tokens)
            if matched != (0, False):
                return matched
        return (None, False) if self.held_back(request) else (0, False)

    def held_back(self, request: Request) -> bool:
        """Whether ``request``, about to start a local prefill, waits (vLLM asks
        again next step) for a push allocated before it was first held to land.
        A push's request waits for its blocks outside vLLM's queue; a prefill
        started behind it takes the step's token budget ahead of it once it
        landed, until that prefill ends (on a loaded CPU host: seconds behind a
        push of tens of milliseconds). Bounded: by each push's hold_s."""
        rid = request.request_id
        if rid in self._inflight:
            return False
        now = self._clock()
        newly_held = rid not in self._held
        since = self._held.setdefault(rid, now)
        ahead = any(
            inf.allocated <= since
            and now - inf.allocated < inf.hold_s
            and not (inf.released or inf.late or inf.finished)
            for inf in self._inflight.values()
        )
        if not ahead:
            self._held.pop(rid, None)
        elif newly_held:
            self.stats.add(held_for_landing=1)
        return ahead

    def _answered_inline(self, fut: Future) -> bool:
        """Whether a match just asked for is answered within this step's inline
        wait (what it waits is spent)."""
        # NOTE: without it the request is looked at again only when a step's token
        # budget reaches it: behind prefills vLLM started meanwhile (measured on a
        # loaded one-core D: answers within 37 ms, seen after up to 13 s)
        if self._inline_left <= 0:
            return False
        started = time.monotonic()
        wait([fut], timeout=self._inline_left)
        self._inline_left -= time.monotonic() - started
        return fut.done()

    def take_jobs(self) -> list[PushJob]:
        """Once a step: the jobs for the worker."""
        now = self._clock()
        last_step_s = 0.0 if self._step_at is None else now - self._step_at
        self._step_at = now
        self._inline_left = min(
            MATCH_INLINE_MAX_S, MATCH_INLINE_STEP_SHARE * last_step_s
        )
        self._mark_late(now)
        for rid in self.claims.claimants():
            if not self._fetching(rid):
                self.claims.drop(rid)
        self._ended.difference_update(self._ended_finished)

        self._ended_finished = []
        jobs, self._jobs = self._jobs, []
        return jobs

    # ---- past its budget: other blocks ---------------------------------------------
    def bind_kv_cache_manager(self, manager: Any) -> None:
        """The scheduler's KV cache manager (0.18.1: through the scheduler patch)."""
        self._kv_cache_manager = manager

    def _release(self, rid: str) -> bool:
        """Past its budget with no answer: the request gives its blocks back and is
        prefilled in others; the blocks the source may write into stay pinned
        until the push ended. False when it cannot: it waits for the push's end."""
        inf = self._inflight.get(rid)
        manager = self._kv_cache_manager
        if (
            inf is None
            or inf.released
            or inf.finished
            or manager is None
            or not inf.blocks
            or not is_waiting_for_remote_kvs(inf.request)
        ):
            self._due.discard(rid)
            return False
        need = -(-len(inf.request.prompt_token_ids or ()) // self.block_size)
        if manager.block_pool.get_num_free_blocks() < need:
            # NOTE: released, it would wait for blocks at the head of vLLM's
            # queue and hold back every request behind it: it waits for a later
            # output, or for the push's end, in the blocks it has
            self._due.add(rid)
            return False
        self._due.discard(rid)
        # NOTE: one more reference each, so freeing the request leaves them
        # allocated: no other request is given a block the source may write into
        for block in inf.blocks:
            block.ref_cnt += 1
        manager.free(inf.request)
        inf.request.num_computed_tokens = 0
        inf.request.num_external_computed_tokens = 0
        inf.released = True
        self.claims.drop(rid)  # its blocks will not be cached: others go their way
        self.stats.add(released_pushes=1)
        self.stats.add(fallback_blocks=inf.n_blocks)
        self._decide(rid, Decision.FELL_BACK)
        logger.warning(
            "Prefix push for %s from %s: no answer %.1f s after its blocks were "
            "allocated (its budget: %.1f s); prefilling it locally in other blocks. "
            "The %d blocks the source may still write into stay out of use until "
            "it answers or the push's hold has passed",
            rid,
            inf.source,
            self._clock() - inf.allocated,
            inf.budget_s,
            inf.n_blocks,
        )
        return True

    def _unpin(self, inf: _Inflight) -> None:
        """A released push ended: its pinned blocks go back to the pool."""
        manager = self._kv_cache_manager
        assert manager is not None, "a push was released without a manager"
        manager.block_pool.free_blocks(inf.blocks)
        inf.blocks = []

    def on_connector_output(self, output: Any) -> None:
        """Before vLLM handles finished_recving: cut back what did not land,
        release pushes past their budget, and hide a released push's end."""
        meta = output.kv_connector_worker_meta
        self.on_worker_meta(meta)
        due = meta.due if isinstance(meta, PushOutcome) else frozenset()
        released = {rid for rid in sorted(self._due | due) if self._release(rid)}
        ended, self._ended_released = self._ended_released, set()
        if released or ended:
            finished = (set(output.finished_recving or ()) - ended) | released
            output.finished_recving = finished or None

    # ---- worker outcome --------------------------------------------------------------
    def on_worker_meta(self, meta: Any) -> None:
        """Before vLLM handles finished_recving: cut back what did not land."""
        if not isinstance(meta, PushOutcome):
            return
        for rid, landed in meta.landed.items():
            if rid not in self._inflight:
                continue
            seen, fewest, refused = self._partial.pop(rid, (0, landed, False))
            seen += meta.workers_of(rid)
            fewest, refused = min(fewest, landed), refused or rid in meta.refused
            if seen < self.workers:
                # NOTE: another worker's write into these blocks may still land:
                # the push ends when every worker's has
                self._partial[rid] = (seen, fewest, refused)
                continue
            landed, inf = fewest, self._inflight.pop(rid)
            self._ended.add(rid)
            self.claims.drop(rid)
            if inf.finished:
                self._ended_finished.append(rid)
            if inf.released:
                self._unpin(inf)
                if not inf.finished:
                    # NOTE: the request runs or waits in other blocks: vLLM must
                    # not be told (a finished one is, to let it go)
                    self._ended_released.add(rid)
            landed = max(0, min(landed, inf.n_blocks))
            self.stats.add(pushed_blocks=landed)
            now = self._clock()
            # what D expected (before this push is measured), for the log
            key = SourceLanes.key(inf.source)
            expected = self.cost.write_s(key, inf.n_blocks, inf.load)
            local = self.cost.span_s(
                inf.first_block * self.block_size, inf.n_blocks * self.block_size
            )
            held = now - inf.allocated
            if landed == inf.n_blocks:
                self._decide(rid, Decision.PUSHED)
                self.cost.observe_push(key, landed, held, inf.load)
                if self.prefill_timer is not None and not (
                    inf.released or inf.finished
                ):
                    self.prefill_timer.landed(inf.request)
            else:
                self._decide(rid, Decision.REFUSED if refused else Decision.FELL_BACK)
                if self._learns_from(key):
                    self.cost.observe_shortfall(
                        key, inf.n_blocks, landed, held, self.block_size, inf.load
                    )
                # NOTE: a refusal (busy, say) is answered at once and holds nothing:
                # its cost is measured, but it does not make the source failing
                if landed == 0 and not refused:
                    self.stats.add(failed_pushes=1)
                    if not inf.late:  # a late one was counted when it became late
                        self._failed(inf.source, f"{rid}: nothing landed")
            if inf.finished:
                self._decided.discard(rid)
            logger.info(
                # NOTE: the match as seen against the source's answer: the rest is
                # D's own steps (a request waiting for its match is polled only
                # when a step's token budget reaches it)
                "Prefix push for %s from %s: %d/%d blocks; match %.0f ms (the "
                "source's answer %.0f ms), scheduled after %.0f ms, push %.0f ms "
                "(expected %s, their local prefill %s)",
                rid,
                inf.source,
                landed,
                inf.n_blocks,
                1e3 * (inf.matched - inf.asked),
                1e3 * inf.answer_s,
                1e3 * (inf.allocated - inf.matched),
                1e3 * (now - inf.allocated),
                "unmeasured" if expected is None else f"{1e3 * expected:.0f} ms",
                "unmeasured" if local is None else f"{1e3 * local:.0f} ms",
            )
            if inf.auto and self.index is not None:
                if landed < inf.n_blocks:
                    self._missed(
                        inf.source, f"{landed} of {inf.n_blocks} pushed blocks landed"
                    )
                else:
                    self.index.confirmed(inf.source)
            if landed < inf.n_blocks and not inf.released:
                missing = inf.n_blocks - landed
                self.stats.add(fallback_blocks=missing)
                req = inf.request
                req.num_computed_tokens = (inf.first_block + landed) * self.block_size
                req.num_external_computed_tokens = landed * self.block_size
                logger.warning(
                    "Prefix push for %s from %s: %d of %d blocks landed; "
                    "prefilling the other %d tokens locally",
                    rid,
                    inf.source,
                    landed,
                    inf.n_blocks,
                    missing * self.block_size,
                )

    # ---- end of request ----------------------------------------------------------------
    def request_finished(self, request: Request) -> bool:
        """True (delay freeing the blocks) while C may still write into them."""
        rid = request.request_id
        self._planned.pop(rid, None)
        self._times.pop(rid, None)
        self._auto.pop(rid, None)
        self._ended.discard(rid)
        self._decided.discard(rid)
        self._granted.discard(rid)
        self._coalescing.pop(rid, None)
        self._held.pop(rid, None)
        self._due.discard(rid)
        self.claims.drop(rid)
        fut = self._matches.pop(rid, None)
        if fut is not None:
            fut.cancel()
        inf = self._inflight.get(rid)
        if inf is None:
            return False
        if inf.released:
            # NOTE: vLLM keeps the finished request, its blocks and so its
            # stepping until the push ended and the pinned blocks went back (its
            # end is then passed on in finished_recving). Its own blocks are not
            # freed here: vLLM 0.32.0 frees a finished request's blocks only once
            # the step that last wrote them completed.
            inf.finished = True
            return True

        queued = [j for j in self._jobs if j.req_id == rid]
        if (
            queued
        ):  # its job never reached the worker: C was not asked, nothing can land
            self._jobs = [j for j in self._jobs if j.req_id != rid]
            del self._inflight[rid]
            return False
        inf.finished = True  # nothing is kept of it once its outcome came in
        return True
