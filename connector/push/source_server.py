# SPDX-License-Identifier: Apache-2.0
"""C side of prefix push: ``POST /match_blocks``, ``/push_blocks`` and ``/push_proof``.

Runs in the worker process that owns the KV caches (the bootstrap server's
thread), next to the block-hash mirror (hashsync/). A push is validated (nothing
is written on a 4xx; one naming another ``source_id`` gets 421), not started once
its deadline or budget has passed, written with one terminal engine write, and
reported ``failed`` if a source block was evicted or reused meanwhile. The answer
is sent only after the engine call returned: once D has it, no byte of the push
can still arrive. An "ok" push can be proven once (``/push_proof``) until its
hold has passed; nothing outside the pushed source blocks is ever read.
With TP > 1 each rank serves its own shard (source_ranks.py). Verified on the CPU
backend over TCP, at TP 1 and 2.
"""

from __future__ import annotations

import array
import collections
import itertools
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm.logger import init_logger

from ..common.block_runs import block_entries
from ..common.config import ExtConfig, FaultConfig
from ..common.counters import Counters
from ..common.engine_write import write_refusal, write_stats
from ..common.fault_injection import write_fault
from ..common.kv_reader import ReadFn
from ..hashsync.worker_sync import WorkerHashSync
from .protocol import (
    KVFingerprint,
    MatchBlocksResponse,
    PushBlocksResponse,
    PushProofResponse,
    PushRequestError,
    parse_match_request,
    parse_proof_request,
    parse_push_request,
    validate,
    validate_probes,
)
from .source_destinations import Destinations, OwnEngine, literal, reaches_this_host
from .source_ranks import RankPorts
from .source_writer import LowPriorityWriter, WriteFn

logger = init_logger(__name__)

PROOFS_KEPT = 1024  # pushes remembered for /push_proof ...
PROOF_BLOCKS_KEPT = 1 << 18  # ... and their source blocks in all (16 bytes each)
PROOF_MAX_BODY_BYTES = 4096  # a /push_proof body: an id and at most MAX_PROBES probes


class _Pushed:
    """What C remembers of an "ok" push until it is proven or expires."""

    __slots__ = ("blocks", "gens", "expires")

    def __init__(self, blocks: Sequence[int], gens: Sequence[int], expires: float):
        self.blocks = array.array("q", blocks)
        self.gens = array.array("q", gens)
        self.expires = expires  # this server's monotonic clock


NO_PREFIX_CACHING = (
    "this instance serves no prefix pushes: prefix caching is off on it, so it holds no "
    "prefix to match or push; retrying will not help (start it with --enable-prefix-caching "
    "to serve /match_blocks and /push_blocks)"
)


class PushSlots:
    """C's concurrent pushes: at most ``limit`` within ``overdue_after_s`` of their
    start. One past it (a frozen or cut-off destination) leaves its slot to
    others while its write goes on; at most OVERDUE_FACTOR x ``limit`` in all."""

    OVERDUE_FACTOR = 4

    def __init__(
        self,
        limit: int,
        overdue_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limit = limit
        self.overdue_after_s = overdue_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}  # token -> its start (clock)
        self._next = itertools.count(1)

    def _num_overdue(self, now: float) -> int:
        return sum(1 for t in self._started.values() if now - t > self.overdue_after_s)

    def begin(self) -> int | None:
        with self._lock:
            now = self._clock()
            working = len(self._started) - self._num_overdue(now)
            if (
                working >= self.limit
                or len(self._started) >= self.OVERDUE_FACTOR * self.limit
            ):
                return None
            token = next(self._next)
            self._started[token] = now
            return token

    def end(self, token: int) -> None:
        with self._lock:
            self._started.pop(token, None)

    def overdue(self) -> int:
        with self._lock:
            return self._num_overdue(self._clock())

    def working(self) -> int:
        """Pushes in progress within their bound (each holds a slot)."""
        with self._lock:
            return len(self._started) - self._num_overdue(self._clock())


class BytesByDestination:
    """Bytes written to each destination session (GET /push/stats), for at most
    ``kept`` destinations (the least recently written forgotten first)."""

    def __init__(self, kept: int = 64):
        self.kept = kept
        self._bytes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, session: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[session] = self._bytes.pop(session, 0) + nbytes
            while len(self._bytes) > self.kept:
                self._bytes.popitem(last=False)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)


def log_id(value: Any) -> str:
    """A requester's id as this instance logs it: printable ASCII, at most 64 characters
    (control and non-ASCII characters escaped)."""
    text = value if isinstance(value, str) else repr(value)
    return ascii(text[:64])[1:-1][:64]


class PushServer:
    """Serves pushes of this instance's cached prefixes (one per source worker: its
    rank's shard). Writes only into a destination whose KV cache matches this one
    (TP size included), never into this instance's own session, only inside the
    destination's declared block count and KV tensors (source_destinations.py)."""

    def __init__(
        self,
        sync: WorkerHashSync,
        write_fn: WriteFn,
        base_addrs: Sequence[int],
        block_len: int,
        fingerprint: KVFingerprint,
        local_session: str,
        config: ExtConfig | None = None,
        wall_clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        reader: ReadFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        source_id: str | None = None,
        tp_rank: int = 0,
        ranks: RankPorts | None = None,
    ):
        config = config or ExtConfig()
        self.sync = sync
        self.tp_rank = tp_rank  # the shard this worker holds and writes
        # rank 0 of a TP > 1 instance: where every rank serves its pushes
        self.ranks = ranks
        self.reader = reader  # proof of write: source bytes at D's probes
        # the write polls the engine on its caller: at nice 19 (source_writer.py)
        self._writer = LowPriorityWriter(write_fn)
        self.base_addrs = list(base_addrs)
        self.block_len = block_len
        self.fingerprint = fingerprint
        self.local_session = local_session
        # this process's name in its /match_blocks answers (None: a new random
        # one); a push names it back
        self.source_id = source_id or secrets.token_hex(8)
        self.config = config
        self.faults: FaultConfig = config.faults
        self._now_ms = wall_clock_ms
        self.clock = clock  # monotonic: a push's budget runs from its receipt
        # what D's hold needs (protocol.MatchBlocksResponse): the engine reads
        # MC_TRANSFER_TIMEOUT as whole seconds
        self.engine_timeout_s = math.ceil(config.engine_transfer_timeout_s)
        # at most push_max_concurrent pushes within their bound; one whose write
        # outlived it (a frozen or cut-off destination) leaves its slot to others
        max_bytes = (
            -(-config.push_max_tokens // sync.block_size)
            * block_len
            * len(self.base_addrs)
        )
        self._slots = PushSlots(
            config.push_max_concurrent,
            config.push_timeout_s + config.engine_write_bound_s(max_bytes),
            clock,
        )
        # never into this instance's own engine, by address; each destination's layout
        self.destinations = Destinations(OwnEngine(local_session))
        # TP > 1: no write until every rank's engine is known (ranks_registered)
        self.ranks_ready = (fingerprint.tp_size or 1) == 1
        self.stats = Counters(
            matches=0,  # /match_blocks answered
            pushes=0,
            ok=0,
            failed=0,
            no_match=0,
            past_deadline=0,
            refused=0,
            peer_refused=0,
            busy=0,
            bytes=0,
            entries=0,
            write_seconds=0.0,
            proofs_ok=0,
            proofs_failed=0,
            proofs_refused=0,
        )
        self.bytes_to = BytesByDestination()
        # prompt tokens this instance's scheduler admitted and has not computed, as
        # of the last step's metadata (PushSourceStep; None: no step yet)
        self.prefill_backlog_tokens: int | None = None
        # proof of write: push id -> what it wrote, oldest first
        self._pushed: collections.OrderedDict[str, _Pushed] = collections.OrderedDict()
        self._pushed_blocks = 0
        self._pushed_lock = threading.Lock()

    def ranks_registered(self, engine_ports: list[int]) -> None:
        """Every rank of this instance has registered: never write into their engines."""
        self.destinations.own.siblings(engine_ports)
        self.ranks_ready = True

    def on_this_host(self, host: str | None) -> bool:
        """Whether a caller at ``host`` (an address) is on this host."""
        addr = literal(host or "")
        return addr is not None and reaches_this_host(
            addr, self.destinations.own.addresses
        )

    def try_begin(self) -> int | None:
        """Take a concurrent-push slot: its token, or None (all busy: 429)."""
        token = self._slots.begin()
        if token is None:
            self.stats.add(busy=1)
        return token

    def end(self, token: int) -> None:
        self._slots.end(token)

    def num_overdue(self) -> int:
        """Pushes whose write has outlived its bound (they hold no slot)."""
        return self._slots.overdue()

    def write_stats(self) -> dict[str, float]:
        """This worker's write statistics, every path (engine_write.py)."""
        return write_stats(self._writer.write_fn)

    def match(self, payload: Any) -> tuple[int, dict[str, Any]]:
        """Serve one /match_blocks body; returns (HTTP status, JSON body)."""
        self.stats.add(matches=1)
        try:
            req = parse_match_request(payload)
        except PushRequestError as e:
            return e.status, {"detail": e.detail()}
        if not req.token_ids:
            return 422, {
                "detail": {"field": "token_ids", "message": "must not be empty"}
            }
        if any(t < 0 for t in req.token_ids):
            return 422, {
                "detail": {
                    "field": "token_ids",
                    "message": "token ids must be non-negative",
                }
            }
        if len(req.token_ids) > self.config.push_max_tokens:
            return 413, {
                "detail": {
                    "field": "token_ids",
                    "message": (
                        f"{len(req.token_ids)} tokens, more than {self.config.push_max_tokens}"
                    ),
                }
            }
        try:
            block_ids, _, total = self.sync.match(
                req.token_ids, req.cache_salt, req.lora_name
            )
        except RuntimeError as e:  # no step has run yet: no hash configuration
            return 503, {"detail": {"field": "", "message": str(e)}}
        ports = self.ranks.ports() if self.ranks is not None else None
        if self.ranks is not None and ports is None:
            return 503, {"detail": {"field": "", "message": self.ranks.missing()}}
        bs = self.sync.block_size
        return 200, MatchBlocksResponse(
            matched_blocks=len(block_ids),
            matched_tokens=len(block_ids) * bs,
            total_full_blocks=total,
            fingerprint=self.fingerprint,
            engine_timeout_s=self.engine_timeout_s,
            now_unix_ms=self._now_ms(),
            source_id=self.source_id,
            tcp_orphan_retries=self.config.tcp_orphan_retries,
            engine_no_progress_s=self.config.engine_no_progress_s,
            engine_reconnect_s=self.config.engine_reconnect_s,
            pushes_in_flight=self._slots.working(),
            push_slots=self._slots.limit,
            prefill_backlog_tokens=self.prefill_backlog_tokens,
            rank_ports=ports,
        ).model_dump(exclude=None if ports else {"rank_ports"})  # as before, at TP 1

    def push(
        self, payload: Any, received: float | None = None, signed_ms: int | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Serve one /push_blocks body received at ``received`` (this server's
        clock), signed at ``signed_ms`` (None: not signed); (status, JSON body)."""
        if received is None:
            received = self.clock()
        try:
            req = parse_push_request(payload)
            if req.source_id != self.source_id:
                raise PushRequestError(
                    "source_id",
                    f"the push is for source {log_id(req.source_id)}, this is "
                    f"{self.source_id} (a request sent to another source, or to this "
                    "one before it restarted); nothing written",
                    421,
                )
            validate(
                req,
                block_size=self.sync.block_size,
                num_kv_tensors=len(self.base_addrs),
                block_len=self.block_len,
                fingerprint=self.fingerprint,
                max_tokens=self.config.push_max_tokens,
            )
            if req.tp_rank != self.tp_rank:
                raise PushRequestError(
                    "tp_rank",
                    f"the push asks for TP rank {req.tp_rank}'s shard, this is rank "
                    f"{self.tp_rank}; nothing written",
                    421,
                )
            if not self.ranks_ready:
                raise PushRequestError(
                    "tp_rank",
                    "this instance's TP ranks have not all registered yet; nothing "
                    "written, retry",
                    503,
                )
            dst_key = self.destinations.check(
                req.dst_session, req.dst_num_blocks, req.dst_kv_base_addrs, signed_ms
            )
        except PushRequestError as e:
            if e.status in (409, 421):
                self.stats.add(refused=1)
                logger.warning(
                    "push_blocks %s refused: %s", payload_request_id(payload), e
                )
            return e.status, {"detail": e.detail()}
        try:
            c_blocks, gens, total = self.sync.match(
                req.token_ids, req.cache_salt, req.lora_name
            )
        except RuntimeError as e:  # no step has run yet: no hash configuration
            return 503, {"detail": {"field": "", "message": str(e)}}
        bs = self.sync.block_size
        lo, hi = req.first_block, req.first_block + len(req.dst_block_ids)
        src_blocks, src_gens = c_blocks[lo:hi], gens[lo:hi]
        n = len(src_blocks)
        resp = PushBlocksResponse(
            status="no_match",
            matched_blocks=len(c_blocks),
            matched_tokens=len(c_blocks) * bs,
            total_full_blocks=total,
        )
        self.stats.add(pushes=1)
        if n == 0:
            resp.message = (
                f"this instance holds {len(c_blocks)} leading blocks of the prompt, "
                f"none from block {lo}"
            )
            self.stats.add(no_match=1)
            return 200, resp.model_dump()
        src, dst, lens = block_entries(
            self.base_addrs,
            req.dst_kv_base_addrs,
            self.block_len,
            src_blocks,
            req.dst_block_ids[:n],
        )
        late_ms = self._now_ms() - req.deadline_unix_ms
        what = "deadline"
        if req.budget_ms is not None:
            # whichever ends first: a clock behind D's cannot extend the window
            over_ms = int((self.clock() - received) * 1000) - req.budget_ms
            if over_ms > late_ms:
                late_ms, what = over_ms, f"budget of {req.budget_ms} ms"
        # refusals are kept per destination session and layout (peer_refusal.py)
        layout = tuple(req.dst_kv_base_addrs)
        refused = write_refusal(self._writer.write_fn, req.dst_session, layout)
        if refused is not None:
            # nothing submitted: D may free its blocks at once
            resp.status = "failed"
            resp.message = refused
            self.stats.add(failed=1, peer_refused=1)
            logger.warning("push_blocks %s: %s", log_id(req.request_id), refused)
            return 200, resp.model_dump()
        if late_ms > 0:
            # D may already have given these blocks to another request.
            resp.status = "failed"
            resp.message = (
                f"the push's {what} passed {late_ms} ms before the write could "
                "start; nothing written"
            )
            self.stats.add(failed=1, past_deadline=1)
            logger.warning("push_blocks %s: %s", log_id(req.request_id), resp.message)
            return 200, resp.model_dump()
        t0 = time.perf_counter()
        err = (
            write_fault(self.faults, len(req.token_ids), tp_rank=self.tp_rank)
            if self.faults.armed
            else None
        )
        try:
            if err is None:
                # no other layout is registered for the destination meanwhile
                with self.destinations.writing(
                    dst_key, req.dst_num_blocks, req.dst_kv_base_addrs
                ):
                    rc = self._writer(req.dst_session, src, dst, lens, layout)
                if rc != 0:
                    err = f"transfer engine returned {rc} writing to {req.dst_session}"
        except PushRequestError as e:  # re-registered before the write started
            err = e.message
        except Exception as e:  # the engine raising must not take the server down
            err = f"transfer engine raised {e!r} writing to {req.dst_session}"
        resp.seconds = time.perf_counter() - t0
        if err is None and not self.sync.table.generations_unchanged(
            src_blocks, src_gens
        ):
            err = "a source block was evicted or reused during the push; its bytes are not valid"
        if err is not None:
            resp.status, resp.message = "failed", err
            self.stats.add(failed=1)
            logger.warning("push_blocks %s: %s", log_id(req.request_id), err)
            return 200, resp.model_dump()
        resp.status, resp.pushed_blocks, resp.bytes = "ok", n, sum(lens)
        if self.reader is not None:
            resp.push_id = self._remember(
                src_blocks, src_gens, received + self.proof_kept_s(resp.bytes)
            )
        if n < len(req.dst_block_ids):
            resp.message = f"{n} of {len(req.dst_block_ids)} requested blocks held"
        self.stats.add(
            ok=1, bytes=resp.bytes, entries=len(lens), write_seconds=resp.seconds
        )
        self.bytes_to.add(req.dst_session, resp.bytes)
        logger.info(
            "push_blocks %s: %d blocks (%.1f MiB, %d entries) to %s in %.3f s "
            "(%.2f GB/s)",
            log_id(req.request_id),
            n,
            resp.bytes / 2**20,
            len(lens),
            req.dst_session,
            resp.seconds,
            resp.bytes / max(resp.seconds, 1e-9) / 1e9,
        )
        return 200, resp.model_dump()

    def proof_kept_s(self, nbytes: int) -> float:
        """How long after its receipt a push of ``nbytes`` can be proven: its hold,
        past which D no longer waits for anything of it."""
        return self.config.push_hold_for_s(nbytes)

    def _remember(
        self, blocks: Sequence[int], gens: Sequence[int], expires: float
    ) -> str:
        push_id = secrets.token_urlsafe(18)
        with self._pushed_lock:
            self._pushed[push_id] = _Pushed(blocks, gens, expires)
            self._pushed_blocks += len(blocks)
            now = self.clock()
            while self._pushed and (
                len(self._pushed) > PROOFS_KEPT
                or self._pushed_blocks > PROOF_BLOCKS_KEPT
                or next(iter(self._pushed.values())).expires <= now
            ):
                self._forget(next(iter(self._pushed)))
        return push_id

    def _forget(self, push_id: str) -> _Pushed | None:
        pushed = self._pushed.pop(push_id, None)
        if pushed is not None:
            self._pushed_blocks -= len(pushed.blocks)
        return pushed

    def proof(
        self, payload: Any, received: float | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Serve one /push_proof body; returns (HTTP status, JSON body)."""
        now = self.clock() if received is None else received
        try:
            req = parse_proof_request(payload)
        except PushRequestError as e:
            self.stats.add(proofs_refused=1)
            return e.status, {"detail": e.detail()}
        with self._pushed_lock:
            pushed = self._forget(
                req.push_id
            )  # one proof per push, whatever the answer
        if pushed is None or pushed.expires <= now:
            self.stats.add(proofs_refused=1)
            return 404, {
                "detail": {
                    "field": "push_id",
                    "message": (
                        "no push to prove under this id: never issued, already proven, or expired "
                        "(a push is kept until its hold has passed, MOONCAKE_PUSH_TIMEOUT_S + the "
                        "write bound + MOONCAKE_PUSH_CLOCK_SKEW_S after it was received)"
                    ),
                }
            }
        try:
            validate_probes(
                req.probes,
                pushed_blocks=len(pushed.blocks),
                num_kv_tensors=len(self.base_addrs),
                block_len=self.block_len,
            )
        except PushRequestError as e:
            self.stats.add(proofs_refused=1)
            return e.status, {"detail": e.detail()}
        assert self.reader is not None  # no id is issued without one
        values = [
            self.reader(slot, pushed.blocks[i], off).hex()
            for i, slot, off in req.probes
        ]
        # After the read: a block evicted before the read ended may hold another
        # request's bytes (the mirror learns of an eviction before the forward
        # pass that overwrites the block, worker_extension.HashMirrorStep).
        if not self.sync.table.generations_unchanged(pushed.blocks, pushed.gens):
            self.stats.add(proofs_failed=1)
            return 200, PushProofResponse(
                status="failed",
                message=(
                    "a pushed source block was evicted or reused since the write; its bytes can "
                    "no longer be shown"
                ),
            ).model_dump()
        self.stats.add(proofs_ok=1)
        return 200, PushProofResponse(status="ok", probe_values=values).model_dump()


def payload_request_id(payload: Any) -> str:
    return (
        "(request)"
        if not isinstance(payload, dict)
        else log_id(payload.get("request_id"))
    )
