# SPDX-License-Identifier: Apache-2.0
"""P's worker side of layer-wise push: the owner of every transfer and its writes.

The forward pass calls :meth:`LayerwiseSender.on_metadata` before the model
runs and :meth:`LayerwiseSender.layer_saved` after each attention layer; the
writes that became possible are queued to the writer thread of their decode
peer (one per D session, so a dead or slow peer stalls only its own
transfers), which issues them with the transfer engine
(``batch_transfer_sync_write``) in FIFO order while later layers compute. D's request for the KV (upstream's ZMQ
MooncakeXferMetadata) is served by :meth:`LayerwiseSender.serve`, which
answers each transfer exactly once.

No byte after the end (the invariant this class owns):
  A transfer's end is reported to D and its P blocks are handed back to the
  scheduler (finished_sending) only after every write it issued has returned
  and no further write of it can start. The writer admits each write through
  ``tracker.start_writes`` under ``self._lock`` (which drops the queued writes
  of an ended transfer), and every way a transfer ends (completion, timeout,
  abort, expiry, write error) takes that same lock; ``tracker.pop_finished``
  only returns transfers with no write in flight. On a timeout D is answered
  once the in-flight write has returned (bounded by the engine's transfer
  timeout), never before.

GPU ordering: on CUDA the attention kernels run asynchronously. Each write
waits, before the engine reads P's blocks, on the event recorded after the
latest computation of every KV tensor (slot) it reads: the layer's own event
for writes issued by layer_saved, the slots' latest events for writes issued
when D's addresses arrive or a request finishes. On the CPU backend there are
no events (compute is synchronous). Only the CPU path runs in this project's
CI; the ordering is unit-tested with fake events.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fastapi import HTTPException, Request  # module level: FastAPI resolves names

from vllm.logger import init_logger

from ..block_runs import contiguous_runs
from ..config import ExtConfig
from ..fault_injection import write_fault
from ..gpu_order import ComputeEvent, EventFactory, record_after_compute, wait_all
from ..io_affinity import deprioritize_current_poller, move_current_thread_to_io_cpus
from .protocol import LayerwiseMetadata
from .tracker import Destination, LayerwiseTracker, TransferState, WriteOp

logger = init_logger(__name__)

WriteFn = Callable[[str, list[int], list[int], list[int]], int]
# reply(ok transfer's D request ids, {D request id: error}, last reply?)
Reply = Callable[[list[str], dict[str, str], bool], Awaitable[None]]

STATS_KEPT = 256
MAX_PEERS = 64  # writer threads (decode sessions) at once
MAX_UNKNOWN = 1024  # destinations waiting for a transfer this instance has not seen


def slots_by_layer(kv_caches: dict[str, torch.Tensor], split_k_and_v: bool
                   ) -> tuple[dict[str, list[int]], list[int]]:
    """Map each layer to the indices of its registered KV tensors (slots).

    Follows the order and de-duplication of upstream's register_kv_caches, so
    slot i is kv_caches_base_addr[i] on both instances.
    """
    layer_slots: dict[str, list[int]] = {}
    addrs: list[int] = []
    for name, cache in kv_caches.items():
        slots = []
        for t in (cache if split_k_and_v else [cache]):
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


@dataclass
class TransferStats:
    """Timeline of one transfer on P (time.monotonic() seconds), for tests and benches."""

    transfer_id: str
    prompt_len: int = 0
    first_write_start: float | None = None
    last_write_end: float | None = None
    prefill_end: float | None = None  # P's last layer of the prompt's last chunk computed
    bytes_written: int = 0
    bytes_before_prefill_end: int = 0
    writes: int = 0
    writes_dropped: int = 0  # queued writes of an ended transfer that never ran
    outcome: str | None = None  # "completed" or the error
    ended_at: float | None = None  # its end was reported (D answered, blocks releasable)


@dataclass
class _Totals:
    writes: int = 0
    bytes: int = 0
    writes_dropped: int = 0
    transfers_completed: int = 0
    transfers_failed: int = 0


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
    ):
        self.layer_slots = layer_slots
        self.write_fn = write_fn
        self.local_base_addrs = list(base_addrs)
        self.block_len = block_len
        self.config = config
        self.timeout_s = config.layerwise_timeout_s
        self._event_factory = event_factory
        self._clock = clock
        self.tracker = LayerwiseTracker(len(self.local_base_addrs), block_size)
        self._lock = threading.Lock()
        self._writers_lock = threading.Lock()
        self._writers: dict[str, queue.Queue[_Batch | None]] = {}  # decode session -> queue
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._results: dict[str, tuple[float, str | None]] = {}  # ended: (when, error)
        self._deadlines: dict[str, float] = {}  # finished on P, no destination yet
        self._slot_events: list[ComputeEvent | None] = [None] * len(self.local_base_addrs)
        self._step_active = False
        self._step_final: list[str] = []  # transfers whose prompt completes this step
        self._layers_this_step = 0
        self._finished_sending: set[str] = set()
        self.totals = _Totals()
        self._stats: collections.OrderedDict[str, TransferStats] = collections.OrderedDict()

    @classmethod
    def for_kv_caches(cls, write_fn: WriteFn, kv_caches: dict[str, torch.Tensor],
                      split_k_and_v: bool, base_addrs: list[int], block_len: int,
                      block_size: int, config: ExtConfig) -> LayerwiseSender:
        layer_slots, addrs = slots_by_layer(kv_caches, split_k_and_v)
        if addrs != list(base_addrs):
            raise RuntimeError("layer-wise push: KV tensor order differs from the registered one")
        return cls(write_fn, layer_slots, base_addrs, block_len, block_size, config)

    # ---- forward thread ------------------------------------------------------
    def on_metadata(self, meta: LayerwiseMetadata) -> None:
        """Called before the forward pass with this step's layer-wise metadata."""
        ops: list[WriteOp] = []
        now = self._clock()
        with self._lock:
            for transfer_id in meta.aborted:
                self.tracker.fail(transfer_id, "the request was aborted on the prefill instance")
                self.tracker.release(transfer_id, "", 0, holds_blocks=False)
            for fin in meta.finished:
                st = self._stat(fin.transfer_id, fin.prompt_len)
                if fin.aborted:
                    self.tracker.fail(fin.transfer_id,
                                      "the request was aborted on the prefill instance")
                    self.tracker.release(fin.transfer_id, fin.p_req_id, fin.prompt_len)
                    continue
                if st.prefill_end is None:
                    st.prefill_end = now  # post-hoc: the prompt was computed by now
                ops += self.tracker.request_finished(fin.transfer_id, fin.p_req_id,
                                                     list(fin.block_ids), fin.prompt_len)
                t = self.tracker.get(fin.transfer_id)
                if t is not None and t.destination is None and not t.done:
                    self._deadlines[fin.transfer_id] = now + self.timeout_s
            ops += self.tracker.begin_step(meta.steps)
            self._step_active = bool(meta.steps)
            self._step_final = [s.transfer_id for s in meta.steps
                                if s.computed_tokens >= s.prompt_len]
            for s in meta.steps:
                self._stat(s.transfer_id, s.prompt_len)
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
        event = self._event_factory(kv_layer)  # None on synchronous (CPU) compute
        with self._lock:
            for s in slots:
                self._slot_events[s] = event
            ops = self.tracker.layer_computed(slots)
            self._layers_this_step += 1
            if self._layers_this_step == len(self.layer_slots):
                now = self._clock()
                for tid in self._step_final:
                    st = self._stats.get(tid)
                    if st is not None and st.prefill_end is None:
                        st.prefill_end = now
        self._submit(ops, (event,))

    def poll(self) -> set[str]:
        """Expire transfers D never asked for; return P requests whose blocks can be freed."""
        now = self._clock()
        with self._lock:
            for transfer_id, deadline in list(self._deadlines.items()):
                t = self.tracker.get(transfer_id)
                if t is None or t.done or t.destination is not None:
                    del self._deadlines[transfer_id]
                elif now > deadline:
                    del self._deadlines[transfer_id]
                    logger.warning("Layer-wise transfer %s: the decode instance did not ask for "
                                   "the KV within %.0fs; freeing the blocks.", transfer_id,
                                   self.timeout_s)
                    self.tracker.fail(transfer_id, "expired: the decode instance never asked")
            for transfer_id, (when, _) in list(self._results.items()):
                if now - when > 2 * self.timeout_s:
                    del self._results[transfer_id]
        self._dispatch()
        with self._lock:
            out, self._finished_sending = self._finished_sending, set()
        return out

    # ---- sender event loop (ZMQ) -----------------------------------------------
    async def push(self, transfer_id: str, dest: Destination) -> str | None:
        """Serve one transfer to D; returns None on success, else the error.

        Returns only once the transfer has ended and none of its writes is in
        flight (so D may reuse its blocks as soon as it hears back)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if transfer_id in self._results:
                return self._results[transfer_id][1] or "the transfer already ended"
            if transfer_id in self._waiters:
                return "a second request for a transfer that is being served"
            if self.tracker.unannounced(transfer_id) and \
                    self.tracker.num_unannounced() >= MAX_UNKNOWN:
                return (f"{MAX_UNKNOWN} requests already wait for transfers this prefill "
                        "instance has not scheduled; refusing more")
            self._waiters[transfer_id] = (loop, fut)
            ops = self.tracker.set_destination(transfer_id, dest)
        self._submit(ops, None)
        self._dispatch()
        try:
            reason = await self._wait_or_timeout(transfer_id, fut)
            if reason is None:
                return fut.result()
            with self._lock:
                self.tracker.fail(transfer_id, reason)
            self._dispatch()
            # The end is handed out once no write of it is in flight; an
            # admitted write returns within the engine's transfer timeout.
            try:
                return await asyncio.wait_for(asyncio.shield(fut), self.config.layerwise_quiesce_s)
            except asyncio.TimeoutError:
                logger.error("Layer-wise transfer %s: a write was still in flight %.0fs after "
                             "its timeout (the transfer engine did not return within "
                             "MC_TRANSFER_TIMEOUT)", transfer_id, self.config.layerwise_quiesce_s)
                return (f"layer-wise transfer {transfer_id} timed out; a write is still in "
                        "flight")
        finally:
            with self._lock:
                self._waiters.pop(transfer_id, None)

    async def _wait_or_timeout(self, transfer_id: str, fut: asyncio.Future) -> str | None:
        """Wait for the transfer's end (None), or return why it must be failed: P
        never scheduled it within MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S (an id
        nobody announced: a stale or forged request on P's unauthenticated ZMQ
        socket, which would otherwise hold a waiter for the whole timeout), or
        it did not end within the transfer timeout."""
        start = time.monotonic()
        unknown_s = min(self.config.layerwise_unknown_timeout_s, self.timeout_s)
        try:
            await asyncio.wait_for(asyncio.shield(fut), unknown_s)
            return None
        except asyncio.TimeoutError:
            pass
        with self._lock:
            unknown = self.tracker.unannounced(transfer_id)
        if unknown:
            return (f"this prefill instance never scheduled transfer {transfer_id} within "
                    f"{unknown_s:.0f}s (MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S)")
        try:
            await asyncio.wait_for(asyncio.shield(fut),
                                   max(0.0, self.timeout_s - (time.monotonic() - start)))
            return None
        except asyncio.TimeoutError:
            return f"timed out after {self.timeout_s:.0f}s"

    async def serve(self, session: str, base_addrs: list[int],
                    req_blocks: dict[str, tuple[str, list[int]]], reply: Reply) -> None:
        """P side of upstream's pull protocol, served from layer-wise pushes.

        One reply per batch of transfers that ended (CONTINUE), the last one
        FINISH; each transfer is answered exactly once."""
        tasks = {
            asyncio.create_task(self.push(transfer_id, Destination(session, list(base_addrs),
                                                                   list(block_ids)))): d_req_id
            for d_req_id, (transfer_id, block_ids) in req_blocks.items()
        }
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            ok, errs = [], {}
            for task in done:
                e = task.result()
                if e is None:
                    ok.append(tasks[task])
                else:
                    errs[tasks[task]] = e
            await reply(ok, errs, not pending)

    # ---- writer threads (one per decode peer) ---------------------------------
    def _submit(self, ops: list[WriteOp], events: tuple[ComputeEvent | None, ...] | None) -> None:
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
        for session, sops in by_session.items():
            writer = self._writer_for(session)
            if writer is None:
                with self._lock:
                    for tid in {op.transfer_id for op in sops}:
                        self.tracker.fail(tid, f"more than {MAX_PEERS} decode peers at once; "
                                          f"refusing a writer for {session}")
                self._dispatch()
                continue
            writer.put(_Batch(sops, uniq))

    def _writer_for(self, session: str) -> queue.Queue[_Batch | None] | None:
        """The queue of the writer thread serving ``session``, started on first use:
        a dead or slow decode peer stalls only the transfers to it."""
        with self._writers_lock:
            q = self._writers.get(session)
            if q is None:
                if len(self._writers) >= MAX_PEERS:
                    return None
                q = self._writers[session] = queue.Queue()
                threading.Thread(target=self._writer_loop, args=(session, q), daemon=True,
                                 name=f"vllm-mooncake-layerwise-{len(self._writers)}").start()
            return q

    def idle(self) -> bool:
        """No queued batch and no write in flight (tests)."""
        with self._writers_lock:
            queues = list(self._writers.values())
        with self._lock:
            inflight = any(t.inflight for t in self.tracker.transfers.values())
        return not inflight and all(q.empty() for q in queues)

    def _writer_loop(self, session: str, q: queue.Queue[_Batch | None]) -> None:
        """One decode peer's writer: admits each batch's writes (dropping those of
        ended transfers), waits for the compute they read, writes, reports."""
        move_current_thread_to_io_cpus(self.config.io_cpus)
        deprioritize_current_poller(self.config.io_cpus)  # the engine's sync write busy-polls
        while (batch := q.get()) is not None:
            with self._lock:
                run, dropped = self.tracker.start_writes(batch.ops)
                now = self._clock()
                for op in dropped:
                    self.totals.writes_dropped += 1
                    self._stat(op.transfer_id).writes_dropped += 1
                prompt_lens: dict[int, int] = {}  # prompt length -> writes done (faults)
                for op in run:
                    st = self._stat(op.transfer_id)
                    if st.first_write_start is None:
                        st.first_write_start = now
                    prompt_lens[self.tracker.transfers[op.transfer_id].prompt_len] = st.writes
            if run:
                wait_all(batch.events)
                self._write(session, run, prompt_lens)
            self._dispatch()

    def _write(self, session: str, ops: list[WriteOp], prompt_lens: dict[int, int]) -> None:
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
        if self.config.faults.armed:  # tests only
            for plen, writes_done in prompt_lens.items():
                err = err or write_fault(self.config.faults, plen, writes_done)
        try:
            if err is None:
                rc = self.write_fn(session, src, dst, lens)
                if rc != 0:
                    err = f"transfer engine returned {rc} writing to {session}"
        except Exception as e:  # never let the writer thread die
            err = f"transfer engine raised {e!r} writing to {session}"
        with self._lock:
            self.tracker.writes_done(ops, err is None, err)
            now = self._clock()
            self.totals.writes += len(src)
            if err is None:
                self.totals.bytes += sum(lens)
                for op, nbytes in zip(ops, op_bytes):
                    st = self._stat(op.transfer_id)
                    st.writes += 1
                    st.bytes_written += nbytes
                    st.last_write_end = now
                    if st.prefill_end is None:
                        st.bytes_before_prefill_end += nbytes
        if err:
            logger.error("Layer-wise push: %s", err)

    def shutdown(self) -> None:
        with self._writers_lock:
            for q in self._writers.values():
                q.put(None)

    # ---- completion ------------------------------------------------------------
    def _dispatch(self) -> None:
        """Report ended transfers with no write in flight, exactly once: answer
        their waiter (D) and hand their P blocks back to the scheduler."""
        resolved: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, str | None]] = []
        with self._lock:
            now = self._clock()
            for t in self.tracker.pop_finished():
                err = None if t.state is TransferState.COMPLETED else (t.error or "failed")
                if err is None:
                    self.totals.transfers_completed += 1
                else:
                    self.totals.transfers_failed += 1
                st = self._stat(t.transfer_id, t.prompt_len)
                st.outcome, st.ended_at = err or "completed", now
                self._results[t.transfer_id] = (now, err)
                waiter = self._waiters.pop(t.transfer_id, None)
                if waiter is not None:
                    resolved.append((*waiter, err))
                if err is not None:
                    logger.warning("Layer-wise transfer %s failed: %s", t.transfer_id, err)
            for t in self.tracker.releasable():
                if t.holds_blocks:
                    self._finished_sending.add(t.p_req_id)
                self.tracker.forget(t.transfer_id)
        for loop, fut, err in resolved:
            loop.call_soon_threadsafe(_set_result, fut, err)

    # ---- observability ---------------------------------------------------------
    def _stat(self, transfer_id: str, prompt_len: int = 0) -> TransferStats:
        """Caller holds self._lock."""
        st = self._stats.get(transfer_id)
        if st is None:
            st = self._stats[transfer_id] = TransferStats(transfer_id)
            while len(self._stats) > STATS_KEPT:
                self._stats.popitem(last=False)
        if prompt_len:
            st.prompt_len = prompt_len
        return st

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"totals": {**asdict(self.totals),
                               "waiting_unknown": self.tracker.num_unannounced()},
                    "transfers": [asdict(s) for s in self._stats.values()]}


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def register_routes(app: Any, get_sender: Callable[[], LayerwiseSender | None],
                    guard: Any = None) -> None:
    """GET /layerwise/transfers on P's bootstrap server: totals and the
    timeline of the last transfers (monotonic seconds of P's worker process)."""
    async def layerwise_transfers(request: Request) -> dict[str, Any]:
        if guard is not None and (denied := guard.check(request.headers.get("authorization"))):
            raise HTTPException(status_code=denied[0], detail=denied[1])
        sender = get_sender()
        if sender is None:
            raise HTTPException(status_code=404, detail="layer-wise push is not enabled here")
        return sender.snapshot()

    app.get("/layerwise/transfers")(layerwise_transfers)


__all__ = ["LayerwiseSender", "TransferStats", "register_routes", "slots_by_layer"]
