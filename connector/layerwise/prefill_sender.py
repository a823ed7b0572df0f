# SPDX-License-Identifier: Apache-2.0
"""P's worker side of layer-wise push: the owner of every transfer and its writes.

The forward thread calls :meth:`LayerwiseSender.on_metadata` before the model
runs and :meth:`LayerwiseSender.layer_saved` after each attention layer (O(1):
it only records the layer); the issuer thread turns layers into writes, queued
to their D session's writer (prefill_writers.py). :meth:`LayerwiseSender.serve`
answers D's pull (MooncakeXferMetadata), each transfer exactly once.

No byte after the end: a transfer's end is reported to D, and its P blocks are
handed back (finished_sending), only once every write it issued has returned
and none can start. Writers admit writes through ``tracker.start_writes`` under
``self._lock``, every way a transfer ends takes that lock, and an engine write
returns only once none of its bytes can land (engine_write.py). So on a timeout
D is answered only when the in-flight write returns, however long that takes.

D's pull never creates a transfer. A pull for an id P has neither scheduled nor
received waits at most MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S and leaves no trace;
all waiting state is bounded (MAX_*). Before the engine reads P's blocks, each
write waits on the events recorded after its slots' latest computation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm.logger import init_logger

from ..common.block_runs import contiguous_runs
from ..common.config import ExtConfig
from ..common.engine_write import WriteFn, write_refusal, write_stats, write_to
from ..common.fault_injection import write_fault
from ..common.gpu_order import (
    ComputeEvent,
    EventFactory,
    record_after_compute,
    wait_all,
)
from ..common.io_affinity import move_current_thread_to_io_cpus
from .prefill_stats import TransferLog, TransferStats
from .prefill_tracker import Destination, LayerwiseTracker, TransferState, WriteOp
from .prefill_writers import SHUTDOWN_WAIT_S, WriterPool
from .protocol import LayerwiseMetadata

logger = init_logger(__name__)

# reply(ok transfer's D request ids, {D request id: error}, last reply?)
Reply = Callable[[list[str], dict[str, str], bool], Awaitable[None]]

# destinations waiting for a transfer this instance has neither scheduled nor
# received, and the block ids they name, in all (each kind below is bounded
# apart, so neither crowds out the other)
MAX_UNKNOWN = 1024
MAX_UNKNOWN_BLOCK_IDS = 1 << 20
# ... and for a request queued on this instance (received, not yet scheduled):
# these wait up to the transfer timeout, not the unknown one
MAX_WAITING_QUEUED = 1024
MAX_WAITING_QUEUED_BLOCK_IDS = 1 << 20
# Transfers served from one of D's requests (D sends one per P worker and step:
# at most its max_num_seqs); the rest of a larger one is refused at once.
MAX_TRANSFERS_PER_REQUEST = 1024
# transfer ids answered "never scheduled" that are remembered (oldest forgotten)
MAX_REFUSED_IDS = 4096
# How often D's answer, waiting for an in-flight write, checks it against the
# engine's bound (only to log; the answer itself comes when the write returns).
OVERDUE_CHECK_S = 1.0
# decode instances named in the "arrived after prefill" warning (once each)
MAX_LATE_PEERS = 64
# The issuer thread wakes at least this often to check for shutdown.
ISSUER_WAIT_S = 1.0
SHUTDOWN_REASON = "the prefill instance is shutting down"


def slots_by_layer(
    kv_caches: dict[str, torch.Tensor], split_k_and_v: bool
) -> tuple[dict[str, list[int]], list[int]]:
    """Map each layer to its registered KV tensors' indices (slots), in upstream's
    register_kv_caches order: slot i is kv_caches_base_addr[i] on both instances."""
    layer_slots: dict[str, list[int]] = {}
    addrs: list[int] = []
    for name, cache in kv_caches.items():
        slots = []
        for t in cache if split_k_and_v else [cache]:
            addr = t.data_ptr()
            if addr in addrs:
                continue
            slots.append(len(addrs))
            addrs.append(addr)
        layer_slots[name] = slots
    return layer_slots, addrs


@dataclass
class _Batch:
    ops: list[WriteOp]
    events: tuple[ComputeEvent, ...]  # wait for these before reading P's blocks
    queued_at: float  # handed to the peer's writer (its FIFO wait: TransferStats)


@dataclass(frozen=True)
class _InFlight:
    """The engine write one writer is in (for the overdue log)."""

    started: float
    nbytes: int
    transfer_ids: frozenset[str]


class LayerwiseSender:
    """Pushes a prefill worker's KV to decode instances layer by layer."""

    def __init__(
        self,
        write_fn: WriteFn,
        layer_slots: dict[str, list[int]],
        base_addrs: list[int],
        block_len: int,
        block_size: int,
        config: ExtConfig,
        event_factory: EventFactory = record_after_compute,
        clock: Callable[[], float] = time.monotonic,
        max_blocks_per_request: int | None = None,
        cpu_clock: Callable[[], float] = time.thread_time,
        tp_rank: int = 0,
    ):
        # this worker's: D's rank of the same number pulls from it
        self.tp_rank = tp_rank
        # a pull naming more blocks than a request of max_model_len has is refused
        self.max_blocks_per_request = max_blocks_per_request
        self.layer_slots = layer_slots
        self.write_fn = write_fn
        self.local_base_addrs = list(base_addrs)
        self.block_len = block_len
        self.config = config
        self.timeout_s = config.layerwise_timeout_s
        self._event_factory = event_factory
        self._clock = clock
        # CPU time the forward thread spent in layer_saved on steps with layer-wise
        # work (its own thread's clock: another process cannot add to it), and
        # how many such calls; written by the forward thread only
        self._cpu_clock = cpu_clock
        self._layer_hook_cpu_s = 0.0
        self._layer_hook_calls = 0
        self.tracker = LayerwiseTracker(len(self.local_base_addrs), block_size)
        self._lock = threading.Lock()
        self.writers: WriterPool[_Batch] = WriterPool(
            self._run_batch,
            self._dispatch,
            config.io_cpus,
            # a layer's write is small: past the engine's own bound its peer is
            # frozen or cut off, and healthy peers must not wait for it
            overdue_after_s=config.engine_write_bound_s(0),
            clock=clock,
            drop=self._drop_batch,
        )
        self._in_flight: dict[str, _InFlight] = {}  # decode session -> its engine write
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        # ended: (when, error), in order of time (pruned from the front)
        self._results: collections.OrderedDict[str, tuple[float, str | None]] = (
            collections.OrderedDict()
        )
        # finished on P, no destination yet: deadline, in order of deadline (one timeout)
        self._deadlines: collections.OrderedDict[str, float] = collections.OrderedDict()
        # Ids whose pull was answered "never scheduled" (that decode instance gave
        # up and prefills locally), oldest first, at most MAX_REFUSED_IDS; a request
        # P runs later under one waits only the unknown timeout for another pull
        # before its blocks are freed (_refused_deadlines, in order of deadline).
        self._refused_ids: collections.OrderedDict[str, None] = (
            collections.OrderedDict()
        )
        self._refused_deadlines: collections.OrderedDict[str, float] = (
            collections.OrderedDict()
        )
        # P requests whose blocks the scheduler keeps until we report them
        self._handed_over: set[str] = set()
        self._slot_events: list[ComputeEvent | None] = [None] * len(
            self.local_base_addrs
        )
        self._step_active = False
        self._step_final: list[str] = []  # transfers whose prompt completes this step
        self._layers_this_step = 0
        self._finished_sending: set[str] = set()
        self.log = TransferLog()  # changed under self._lock
        # decode sessions warned of a pull that arrived after the prefill
        self._late_peers: set[str] = set()
        # Layers computed and not yet turned into writes: (slots, event), in
        # order; layer_saved appends, issue_computed_layers drains (under _lock).
        self._computed_layers: collections.deque[
            tuple[list[int], ComputeEvent | None]
        ] = collections.deque()
        self._issue_ready = threading.Condition(self._lock)
        self._stopping = False
        self._issuer_cpu_s = 0.0  # the issuer thread's CPU time (its own clock)
        self._forward_tid: int | None = None  # the forward thread (on_metadata's)
        self._issuer = threading.Thread(
            target=self._issuer_loop, daemon=True, name="vllm-mooncake-issue-layers"
        )
        self._issuer.start()

    @classmethod
    def for_kv_caches(
        cls,
        write_fn: WriteFn,
        kv_caches: dict[str, torch.Tensor],
        split_k_and_v: bool,
        base_addrs: list[int],
        block_len: int,
        block_size: int,
        config: ExtConfig,
        max_blocks_per_request: int | None = None,
        tp_rank: int = 0,
    ) -> LayerwiseSender:
        layer_slots, addrs = slots_by_layer(kv_caches, split_k_and_v)
        if addrs != list(base_addrs):
            raise RuntimeError(
                "layer-wise push: KV tensor order differs from the registered one"
            )
        return cls(
            write_fn,
            layer_slots,
            base_addrs,
            block_len,
            block_size,
            config,
            max_blocks_per_request=max_blocks_per_request,
            tp_rank=tp_rank,
        )

    # ---- forward thread ------------------------------------------------------
    def on_metadata(self, meta: LayerwiseMetadata) -> None:
        """Called before the forward pass with this step's layer-wise metadata."""
        self._forward_tid = threading.get_native_id()  # for forward_thread_cpu_s
        # the previous step's layers, if the issuer lags: issued against that
        # step's tracker state, before this step begins
        self.issue_computed_layers()
        ops: list[WriteOp] = []
        now = self._clock()
        with self._lock:
            self.tracker.received(meta.received)
            # Before this step's forward: a preempted request's blocks may be
            # computed into for another request by it; its queued writes must
            # not read them (start_writes drops them once the transfer ended).
            for transfer_id in meta.preempted:
                self.tracker.fail(
                    transfer_id, "the request was preempted on the prefill instance"
                )
            for transfer_id in meta.aborted:
                self.tracker.release(
                    transfer_id,
                    "",
                    0,
                    holds_blocks=False,
                    reason="the request was aborted on the prefill instance",
                )
            for fin in meta.finished:
                self._handed_over.add(fin.p_req_id)
                st = self.log.of(fin.transfer_id, fin.prompt_len)
                if fin.aborted:
                    self.tracker.release(
                        fin.transfer_id,
                        fin.p_req_id,
                        fin.prompt_len,
                        reason="the request was aborted on the prefill instance",
                    )
                    continue
                if st.prefill_end is None:
                    st.prefill_end = now  # post-hoc: the prompt was computed by now
                ops += self.tracker.request_finished(
                    fin.transfer_id, fin.p_req_id, list(fin.block_ids), fin.prompt_len
                )
                t = self.tracker.get(fin.transfer_id)
                if t is not None and t.destination is None and not t.done:
                    self._deadlines[fin.transfer_id] = now + self.timeout_s
                    self._deadlines.move_to_end(fin.transfer_id)
                    if fin.transfer_id in self._refused_ids:
                        del self._refused_ids[fin.transfer_id]
                        self._refused_deadlines[fin.transfer_id] = (
                            now + self._unknown_timeout_s()
                        )
            ops += self.tracker.begin_step(meta.steps)
            self._step_active = bool(meta.steps)
            self._step_final = [
                s.transfer_id for s in meta.steps if s.computed_tokens >= s.prompt_len
            ]
            for s in meta.steps:
                self.log.of(s.transfer_id, s.prompt_len).layerwise = True
            self._layers_this_step = 0
        self._submit(ops, None)
        self._dispatch()

    def layer_saved(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Called after an attention layer wrote its KV for this step."""
        if not self._step_active:
            return
        slots = self.layer_slots.get(layer_name)
        if not slots:
            return
        cpu0 = self._cpu_clock()
        event = self._event_factory(kv_layer)  # None on synchronous (CPU) compute
        with self._issue_ready:
            for s in slots:
                self._slot_events[s] = event
            # O(1) here: the issuer thread turns the layer into each transfer's
            # writes (issue_computed_layers)
            self._computed_layers.append((slots, event))
            self._issue_ready.notify()
            self._layers_this_step += 1
            if self._layers_this_step == len(self.layer_slots):
                now = self._clock()
                for tid in self._step_final:
                    st = self.log.get(tid)
                    if st is not None and st.prefill_end is None:
                        st.prefill_end = now
        self._layer_hook_cpu_s += self._cpu_clock() - cpu0
        self._layer_hook_calls += 1

    def issue_computed_layers(self) -> None:
        """Turn the layers computed so far into their transfers' writes; queue them."""
        batches: list[tuple[list[WriteOp], ComputeEvent | None]] = []
        with self._lock:
            while self._computed_layers:
                slots, event = self._computed_layers.popleft()
                ops = self.tracker.layer_computed(slots)
                if ops:
                    batches.append((ops, event))
        for ops, event in batches:
            self._submit(ops, (event,))

    def _issuer_loop(self) -> None:
        move_current_thread_to_io_cpus(self.config.io_cpus)
        cpu0 = time.thread_time()
        while not self._stopping:
            with self._issue_ready:
                if not self._computed_layers:
                    self._issue_ready.wait(ISSUER_WAIT_S)
            self.issue_computed_layers()
            self._issuer_cpu_s = time.thread_time() - cpu0

    def poll(self) -> set[str]:
        """Expire transfers D never asked for; return P requests whose blocks can be freed."""
        now = self._clock()
        with self._lock:
            self._expire(
                self._refused_deadlines,
                now,
                "Layer-wise transfer %s: its decode instance was answered that this "
                "prefill instance never scheduled it, and nobody asked again within "
                "%.0fs of the request's end; freeing the blocks.",
                self._unknown_timeout_s(),
                "expired: its decode instance had been answered that it was never "
                "scheduled",
            )
            self._expire(
                self._deadlines,
                now,
                "Layer-wise transfer %s: the decode instance did not ask for the KV "
                "within %.0fs; freeing the blocks.",
                self.timeout_s,
                "expired: the decode instance never asked",
            )
            while self._results:
                transfer_id, (when, _) = next(iter(self._results.items()))
                if now - when <= 2 * self.timeout_s:
                    break
                del self._results[transfer_id]
        self._dispatch()
        with self._lock:
            # requests that reused a live transfer_id: never sent, freed at their end
            self._finished_sending.update(self.tracker.pop_released_duplicates())
            out, self._finished_sending = self._finished_sending, set()
            stray = out - self._handed_over
            out -= stray
            self._handed_over -= out
        if stray:  # never reaches vLLM's scheduler, which knows only its own requests
            logger.error(
                "Layer-wise push: not reporting %d request ids the scheduler never "
                "handed over: %s",
                len(stray),
                sorted(stray)[:8],
            )
        return out

    # ---- sender event loop (ZMQ) -----------------------------------------------
    async def push(self, transfer_id: str, dest: Destination) -> str | None:
        """Serve one transfer to D: None on success, else the error. Returns only
        once the transfer has ended and none of its writes is in flight (so D may
        reuse its blocks as soon as it hears back)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if transfer_id in self._results:
                return self._results[transfer_id][1] or "the transfer already ended"
            if transfer_id in self._waiters:
                return "a second request for a transfer that is being served"
            if self.tracker.get(transfer_id) is None:  # waits for the scheduler
                refusal = self._waiting_refusal(transfer_id, len(dest.block_ids))
                if refusal is not None:
                    return refusal
            self._waiters[transfer_id] = (loop, fut)
            late = self._note_destination(transfer_id, dest.session)
            ops = self.tracker.set_destination(transfer_id, dest)
        if late:
            logger.warning(
                "Layer-wise push to the decode instance whose transfer engine is %s: "
                "the decode request arrived after prefill "
                "(transfer %s): the dispatcher sends P and D one after the other "
                "(vllm-router with --kv-connector mooncake does; a decode instance "
                "too busy to ask sooner looks the same), so layer-wise "
                "cannot overlap the prefill and the KV is sent after it, as "
                "post-hoc would. Counted in /metrics (vllm_mooncake_ext_layerwise_"
                "destination_after_prefill_total) and /layerwise/transfers; "
                "docs/routers.md names dispatchers that send both at once. Warned "
                "once per decode instance.",
                dest.session,
                transfer_id,
            )
        self._submit(ops, None)
        self._dispatch()
        try:
            reason = await self._wait_or_timeout(transfer_id, fut)
            if reason is None:
                return fut.result()
            with self._lock:
                if self.tracker.drop_pending(transfer_id):
                    # never scheduled here: nothing was written; if P runs this id
                    # later, its blocks wait for a pull only the unknown timeout
                    self._refused_ids[transfer_id] = None
                    self._refused_ids.move_to_end(transfer_id)
                    while len(self._refused_ids) > MAX_REFUSED_IDS:
                        self._refused_ids.popitem(last=False)
                    return reason
                self.tracker.fail(transfer_id, reason)
            self._dispatch()
            return await self._answer_when_written(transfer_id, dest.session, fut)
        finally:
            with self._lock:
                self._waiters.pop(transfer_id, None)

    def _waiting_refusal(self, transfer_id: str, num_blocks: int) -> str | None:
        """Why a destination may not wait for its unannounced transfer, or None."""
        queued = self.tracker.queued(transfer_id)
        waiting, blocks = self.tracker.waiting(queued)
        if queued:
            max_n, max_blocks = MAX_WAITING_QUEUED, MAX_WAITING_QUEUED_BLOCK_IDS
            what = "requests queued on this prefill instance"
        else:
            max_n, max_blocks = MAX_UNKNOWN, MAX_UNKNOWN_BLOCK_IDS
            what = "transfers this prefill instance has not scheduled"
        if waiting < max_n and blocks + num_blocks <= max_blocks:
            return None
        return (
            f"{waiting} requests naming {blocks} blocks already wait for {what} "
            f"(at most {max_n} requests, {max_blocks} blocks); refusing more"
        )

    def _note_destination(self, transfer_id: str, session: str) -> bool:
        """Record D's pull (under the lock); True: warn it came after P's prefill."""
        st = self.log.get(transfer_id)  # None: P has not scheduled it yet (early)
        if st is None or st.destination_at is not None:
            return False
        st.destination_at = self._clock()
        if not st.layerwise or st.prefill_end is None:
            return False
        st.destination_after_prefill = True
        self.log.totals.add(destination_after_prefill=1)
        if session in self._late_peers or len(self._late_peers) >= MAX_LATE_PEERS:
            return False
        self._late_peers.add(session)
        return True

    async def _answer_when_written(
        self, transfer_id: str, session: str, fut: asyncio.Future
    ) -> str | None:
        """The ended transfer's answer, once no write of it is in flight. There
        is no timeout: until the engine's write returns, its bytes may land in
        D's blocks. A write in flight past the engine's bound is logged (once)."""
        logged = False
        while True:
            wait = OVERDUE_CHECK_S
            if not logged:
                with self._lock:
                    w = self._in_flight.get(session)
                if w is not None and transfer_id in w.transfer_ids:
                    age = self._clock() - w.started
                    bound = self.config.engine_write_bound_s(w.nbytes)
                    if age > bound:
                        logged = True
                        logger.error(
                            "Layer-wise transfer %s ended, but its write to %s (%d bytes) is "
                            "still in flight %.0f s after it started, past the engine's bound "
                            "(%.0f s); the decode instance is answered once it returns",
                            transfer_id,
                            session,
                            w.nbytes,
                            age,
                            bound,
                        )
                    else:
                        wait = min(wait, bound - age + 0.01)
            try:
                return await asyncio.wait_for(asyncio.shield(fut), wait)
            except asyncio.TimeoutError:
                continue

    def _expire(
        self,
        deadlines: collections.OrderedDict[str, float],
        now: float,
        warning: str,
        after_s: float,
        reason: str,
    ) -> None:
        """Fail the transfers whose deadline passed with no destination. Under the lock."""
        while deadlines:
            transfer_id, deadline = next(iter(deadlines.items()))
            if now <= deadline:
                break
            del deadlines[transfer_id]
            t = self.tracker.get(transfer_id)
            if t is None or t.done or t.destination is not None:
                continue
            logger.warning(warning, transfer_id, after_s)
            self.tracker.fail(transfer_id, reason)

    def _unknown_timeout_s(self) -> float:
        return min(self.config.layerwise_unknown_timeout_s, self.timeout_s)

    async def _wait_or_timeout(
        self, transfer_id: str, fut: asyncio.Future
    ) -> str | None:
        """Wait for the transfer's end (None), or return why it must fail: still
        unknown to P after the unknown timeout, or not ended within the timeout."""
        start = time.monotonic()
        unknown_s = self._unknown_timeout_s()
        try:
            await asyncio.wait_for(asyncio.shield(fut), unknown_s)
            return None
        except asyncio.TimeoutError:
            pass
        with self._lock:
            unknown = self.tracker.unknown(transfer_id)
        # a stale or forged id (P's ZMQ socket is unauthenticated) must not hold a
        # waiter for the whole transfer timeout
        if unknown:
            return (
                f"this prefill instance never scheduled transfer {transfer_id} within "
                f"{unknown_s:.0f}s (MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S) and holds no "
                "request for it"
            )
        try:
            await asyncio.wait_for(
                asyncio.shield(fut),
                max(0.0, self.timeout_s - (time.monotonic() - start)),
            )
            return None
        except asyncio.TimeoutError:
            return f"timed out after {self.timeout_s:.0f}s"

    async def serve(
        self,
        session: str,
        base_addrs: list[int],
        req_blocks: dict[str, tuple[str, list[int]]],
        reply: Reply,
    ) -> None:
        """Upstream's pull protocol: CONTINUE per batch of ended transfers, then FINISH."""
        items = list(req_blocks.items())
        served = items[:MAX_TRANSFERS_PER_REQUEST]
        refused = {
            d_req_id: (
                f"one request named {len(items)} transfers; a prefill worker "
                f"serves at most {MAX_TRANSFERS_PER_REQUEST} per request"
            )
            for d_req_id, _ in items[MAX_TRANSFERS_PER_REQUEST:]
        }
        cap = self.max_blocks_per_request
        if cap is not None:
            too_long = {
                d_req_id: (
                    f"the pull names {len(block_ids)} blocks; a request of this "
                    f"instance's max_model_len has at most {cap}"
                )
                for d_req_id, (_, block_ids) in served
                if len(block_ids) > cap
            }
            refused.update(too_long)
            served = [i for i in served if i[0] not in too_long]
        tasks = {
            asyncio.create_task(
                self.push(
                    transfer_id, Destination(session, list(base_addrs), list(block_ids))
                )
            ): d_req_id
            for d_req_id, (transfer_id, block_ids) in served
        }
        if refused:
            await reply([], refused, not tasks)
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(
                pending, return_when=asyncio.FIRST_COMPLETED
            )
            ok, errs = [], {}
            for task in done:
                e = task.result()
                if e is None:
                    ok.append(tasks[task])
                else:
                    errs[tasks[task]] = e
            await reply(ok, errs, not pending)

    # ---- writer threads (one per decode peer with work) ------------------------
    def _submit(
        self, ops: list[WriteOp], events: tuple[ComputeEvent | None, ...] | None
    ) -> None:
        """Queue the writes to their destination's writer (one FIFO per decode peer)."""
        if not ops:
            return
        if events is None:  # reads what earlier layers/steps computed
            with self._lock:
                events = tuple(self._slot_events[s] for s in {op.slot for op in ops})
        uniq = tuple({id(e): e for e in events if e is not None}.values())
        by_session: dict[str, list[WriteOp]] = {}
        for op in ops:
            by_session.setdefault(op.session, []).append(op)
        now = self._clock()
        for session, sops in by_session.items():
            if not self.writers.submit(session, _Batch(sops, uniq, now)):
                reason = (
                    SHUTDOWN_REASON
                    if self.writers.closed
                    else f"more than {self.writers.max_peers} decode peers with "
                    f"writes at once; refusing a writer for {session}"
                )
                with self._lock:
                    for tid in {op.transfer_id for op in sops}:
                        self.tracker.fail(tid, reason)
                self._dispatch()

    @property
    def writer_idle_s(self) -> float:
        """A decode session's writer thread retires after this long without work."""
        return self.writers.idle_s

    @writer_idle_s.setter
    def writer_idle_s(self, seconds: float) -> None:
        self.writers.idle_s = seconds

    def _drop_batch(self, session: str, batch: _Batch) -> None:
        """A batch dropped at shutdown never runs: its transfers end failed."""
        with self._lock:
            for op in batch.ops:
                self.log.totals.add(writes_dropped=1)
                self.log.of(op.transfer_id).writes_dropped += 1
            for tid in {op.transfer_id for op in batch.ops}:
                self.tracker.fail(tid, SHUTDOWN_REASON)
        self._dispatch()

    def _run_batch(self, session: str, batch: _Batch) -> None:
        with self._lock:
            run, dropped = self.tracker.start_writes(batch.ops)
            now = self._clock()
            for op in dropped:
                self.log.totals.add(writes_dropped=1)
                self.log.of(op.transfer_id).writes_dropped += 1
            prompt_lens: dict[int, int] = {}  # prompt length -> writes done (faults)
            for op in run:
                st = self.log.of(op.transfer_id)
                if st.first_write_start is None:
                    st.first_write_start = now
                st.queue_wait_max_s = max(st.queue_wait_max_s, now - batch.queued_at)
                prompt_lens[self.tracker.transfers[op.transfer_id].prompt_len] = (
                    st.writes
                )
        if run:
            wait_all(batch.events)
            self._write(session, run, prompt_lens)

    def _write(
        self, session: str, ops: list[WriteOp], prompt_lens: dict[int, int]
    ) -> None:
        src, dst, lens = [], [], []
        op_bytes = []
        for op in ops:
            base = self.local_base_addrs[op.slot]
            n0 = len(lens)
            for s, d, n in contiguous_runs(op.src_blocks, op.dst_blocks):
                src.append(base + s * self.block_len)
                dst.append(op.dst_base_addr + d * self.block_len)
                lens.append(n * self.block_len)
            op_bytes.append(sum(lens[n0:]))
        err = None
        with self._lock:
            self._in_flight[session] = _InFlight(
                self._clock(), sum(lens), frozenset(op.transfer_id for op in ops)
            )
        if self.config.faults.armed:  # tests only
            for plen, writes_done in prompt_lens.items():
                err = err or write_fault(
                    self.config.faults, plen, writes_done, self.tp_rank
                )
        # a peer whose writes keep failing: refused for a while, nothing written
        # refusals are kept per session and layout (peer_refusal.py): a pull naming
        # D's session with a layout of its own does not get D's own pulls refused
        layouts = {op.dst_layout for op in ops}
        layout = layouts.pop() if len(layouts) == 1 else None
        err = err or write_refusal(self.write_fn, session, layout)
        if err is None and self.writers.closed:
            # NOTE: a batch that started before shutdown and reaches the engine
            # after it began is failed, not written: shutdown waits only for
            # writes already in the engine
            err = SHUTDOWN_REASON
        try:
            if err is None:
                rc = write_to(self.write_fn, session, src, dst, lens, layout)
                if rc != 0:
                    err = f"transfer engine returned {rc} writing to {session}"
        except Exception as e:  # never let the writer thread die
            err = f"transfer engine raised {e!r} writing to {session}"
        with self._lock:
            self._in_flight.pop(session, None)
            self.tracker.writes_done(ops, err is None, err)
            now = self._clock()
            self.log.totals.add(writes=len(src))
            if err is None:
                self.log.totals.add(bytes=sum(lens))
                for op, nbytes in zip(ops, op_bytes):
                    st = self.log.of(op.transfer_id)
                    st.writes += 1
                    st.bytes_written += nbytes
                    st.last_write_end = now
                    if st.prefill_end is None:
                        st.bytes_before_prefill_end += nbytes
        if err:
            logger.error("Layer-wise push: %s", err)

    def shutdown(self) -> None:
        """No write enters the engine after this returns: queued writes are dropped
        (their transfers fail, D is answered); waits up to SHUTDOWN_WAIT_S for
        the writes already in the engine."""
        with self._issue_ready:
            self._stopping = True
            self._issue_ready.notify()
        self._issuer.join(timeout=2 * ISSUER_WAIT_S)
        running = self.writers.shutdown(SHUTDOWN_WAIT_S)
        if running:
            logger.error(
                "Layer-wise push: shutting down while writes to %s have not "
                "returned %.0f s later; their transfers end (and their decode "
                "instances are answered) only when those writes return",
                sorted(running),
                SHUTDOWN_WAIT_S,
            )
        self._dispatch()

    # ---- completion ------------------------------------------------------------
    def _dispatch(self) -> None:
        """Report ended transfers with no write in flight: answer D, free P's blocks."""
        resolved: list[
            tuple[asyncio.AbstractEventLoop, asyncio.Future, str | None]
        ] = []
        with self._lock:
            now = self._clock()
            for t in self.tracker.pop_finished():
                err = (
                    None
                    if t.state is TransferState.COMPLETED
                    else (t.error or "failed")
                )
                if err is None:
                    self.log.totals.add(transfers_completed=1)
                else:
                    self.log.totals.add(transfers_failed=1)
                st = self.log.of(t.transfer_id, t.prompt_len)
                st.outcome, st.ended_at = err or "completed", now
                self._results[t.transfer_id] = (now, err)
                waiter = self._waiters.pop(t.transfer_id, None)
                if waiter is not None:
                    resolved.append((*waiter, err))
                if err is not None:
                    logger.warning(
                        "Layer-wise transfer %s failed: %s", t.transfer_id, err
                    )
            for t in self.tracker.pop_releasable():
                if t.holds_blocks:
                    self._finished_sending.add(t.p_req_id)
                self.tracker.forget(t.transfer_id)
        for loop, fut, err in resolved:
            # a closed loop (shutdown) raises RuntimeError: nobody waits there
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_result, fut, err)

    # ---- observability ---------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Totals and the last transfers' timelines (GET /layerwise/transfers)."""
        with self._lock:
            # pulls waiting for an id P has neither scheduled nor received
            out = self.log.snapshot(self.tracker.waiting(queued=False)[0])
            # pulls waiting for a request queued on P (received, not scheduled)
            out["totals"]["waiting_queued"] = self.tracker.waiting(queued=True)[0]
            out["writes_in_flight"] = self.tracker.inflight
            # live P requests that reused another live request's transfer_id
            out["duplicate_transfer_ids"] = self.tracker.num_duplicates()
        # writer threads now (one per decode session with work), and whether one
        # has a batch queued or running
        out["writers"] = self.writers.num_writers()
        with self._lock:
            layers_to_issue = bool(self._computed_layers)
        out["writes_queued"] = self.writers.queued() or layers_to_issue
        # writes past the engine's bound (frozen or cut-off peers): out of the cap
        out["overdue_writers"] = self.writers.num_overdue()
        out["totals"]["layer_hook_cpu_s"] = self._layer_hook_cpu_s
        out["totals"]["layer_hook_calls"] = self._layer_hook_calls
        # the issuer thread's CPU time (the per-transfer work of each layer)
        out["totals"]["layer_issue_cpu_s"] = self._issuer_cpu_s
        # the forward thread's CPU time since it started: what P's compute cost,
        # on a clock other processes cannot advance (mb7's P slowdown)
        out["totals"]["forward_thread_cpu_s"] = thread_cpu_s(self._forward_tid)
        out.update(write_stats(self.write_fn))  # failed, fenced, refused writes
        return out


def thread_cpu_s(native_id: int | None) -> float | None:
    """CPU seconds a thread of this process has run (schedstat); None if unknown."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


__all__ = ["LayerwiseSender", "TransferStats", "slots_by_layer"]
