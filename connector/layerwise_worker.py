# SPDX-License-Identifier: Apache-2.0
"""Layer-wise KV push: the worker side (see layerwise.py for the design).

Prefill side (LayerwisePusher): the forward pass calls begin_step() before the
model runs and layer_saved() after each attention layer; the writes that became
possible are queued to one writer thread, which issues them with the transfer
engine (batch_transfer_sync_write) in FIFO order while later layers compute.
D's request for the KV (upstream's ZMQ MooncakeXferMetadata) is served by
serve_xfer_request(), which answers each transfer exactly once: when all of
its blocks are written, or with an error.

Decode side (fail_pulls): with layer-wise on, a failed or timed-out pull is
reported finished with its blocks marked invalid, so the scheduler recomputes
(or fails) the request instead of leaving it waiting forever, and its blocks
are freed.

GPU note: on CUDA the attention kernels run asynchronously; layer_saved()
records a CUDA event after the layer and the writer waits on it before reading
the KV. That path is written for CUDA but only the CPU backend (synchronous
compute, TCP transfer engine) is exercised in this project's CI.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.block_runs import (
    contiguous_runs,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.fault_injection import (
    write_fault,
    write_fault_armed,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.io_affinity import (
    deprioritize_current_poller,
    move_current_thread_to_io_cpus,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise import (
    LayerwiseMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise_tracker import (
    Destination,
    LayerwiseTracker,
    Transfer,
    TransferState,
    WriteOp,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    import zmq.asyncio

logger = init_logger(__name__)


def slots_by_layer(kv_caches: dict[str, torch.Tensor], split_k_and_v: bool) -> tuple[dict[str, list[int]], list[int]]:
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


class LayerwisePusher:
    """Pushes a prefill worker's KV to decode instances layer by layer."""

    def __init__(
        self,
        write_fn: Callable[[str, list[int], list[int], list[int]], int],
        kv_caches: dict[str, torch.Tensor],
        split_k_and_v: bool,
        local_base_addrs: list[int],
        block_len: int,
        block_size: int,
        timeout_s: float,
    ):
        self.layer_slots, addrs = slots_by_layer(kv_caches, split_k_and_v)
        if addrs != list(local_base_addrs):
            raise RuntimeError("layer-wise push: KV tensor order differs from the registered one")
        self.write_fn = write_fn
        self.local_base_addrs = list(local_base_addrs)
        self.block_len = block_len
        self.timeout_s = timeout_s
        self.tracker = LayerwiseTracker(len(addrs), block_size)
        self.lock = threading.Lock()
        self._queue: queue.Queue[tuple[list[WriteOp], Any] | None] = queue.Queue()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._results: dict[str, tuple[float, str | None]] = {}  # ended: (when, error)
        self._deadlines: dict[str, float] = {}  # finished on P, no destination yet
        self._step_active = False
        self.finished_sending: set[str] = set()
        self.stats = {"writes": 0, "bytes": 0, "transfers_completed": 0, "transfers_failed": 0}
        self._writer = threading.Thread(target=self._writer_loop, name="vllm-mooncake-layerwise",
                                        daemon=True)
        self._writer.start()

    # ---- forward thread ------------------------------------------------------
    def on_metadata(self, meta: LayerwiseMetadata) -> None:
        """Called before the forward pass with this step's layer-wise metadata."""
        ops: list[WriteOp] = []
        with self.lock:
            for transfer_id in meta.aborted:
                self.tracker.fail(transfer_id, "the request was aborted on the prefill instance")
            for transfer_id, p_req_id, block_ids, prompt_len, aborted in meta.finished:
                if aborted:
                    self.tracker.fail(transfer_id, "the request was aborted on the prefill instance")
                    self.tracker.release(transfer_id, p_req_id, prompt_len)
                    continue
                ops += self.tracker.request_finished(transfer_id, p_req_id, block_ids, prompt_len)
                t = self.tracker.get(transfer_id)
                if t is not None and t.destination is None and not t.done:
                    self._deadlines[transfer_id] = time.monotonic() + self.timeout_s
            ops += self.tracker.begin_step(meta.steps)
            self._step_active = bool(meta.steps)
        self._submit(ops, None)
        self._dispatch(aborted=set(meta.aborted))

    def layer_saved(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Called after an attention layer wrote its KV for this step."""
        if not self._step_active:
            return
        slots = self.layer_slots.get(layer_name)
        if not slots:
            return
        with self.lock:
            ops = self.tracker.layer_computed(slots)
        if ops:
            event = None
            if kv_layer.is_cuda:  # compute is asynchronous: write after the layer is done
                event = torch.cuda.Event()
                event.record()
            self._submit(ops, event)

    def poll(self) -> set[str]:
        """Expire transfers D never asked for; return P requests whose blocks can be freed."""
        now = time.monotonic()
        with self.lock:
            for transfer_id, deadline in list(self._deadlines.items()):
                t = self.tracker.get(transfer_id)
                if t is None or t.done or t.destination is not None:
                    del self._deadlines[transfer_id]
                elif now > deadline:
                    del self._deadlines[transfer_id]
                    logger.warning("Layer-wise transfer %s: the decode instance did not ask for "
                                   "the KV within %.0fs; freeing the blocks.", transfer_id, self.timeout_s)
                    self.tracker.fail(transfer_id, "expired: the decode instance never asked")
            for transfer_id, (when, _) in list(self._results.items()):
                if now - when > 2 * self.timeout_s:
                    del self._results[transfer_id]
        self._dispatch()
        with self.lock:
            out, self.finished_sending = self.finished_sending, set()
        return out

    # ---- sender event loop (ZMQ) -----------------------------------------------
    async def push(self, transfer_id: str, dest: Destination) -> str | None:
        """Serve one transfer to D; returns None on success, else the error."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self.lock:
            if transfer_id in self._results:
                return self._results[transfer_id][1] or "the transfer already ended"
            if transfer_id in self._waiters:
                return "a second request for a transfer that is being served"
            self._waiters[transfer_id] = (loop, fut)
            ops = self.tracker.set_destination(transfer_id, dest)
        self._submit(ops, None)
        self._dispatch()
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            with self.lock:
                self.tracker.fail(transfer_id, f"timed out after {self.timeout_s:.0f}s")
            self._dispatch()
            return f"layer-wise transfer {transfer_id} timed out after {self.timeout_s:.0f}s"
        finally:
            with self.lock:
                self._waiters.pop(transfer_id, None)

    # ---- writer thread ---------------------------------------------------------
    def _submit(self, ops: list[WriteOp], event: Any) -> None:
        if ops:
            self._queue.put((ops, event))

    def _writer_loop(self) -> None:
        move_current_thread_to_io_cpus()
        deprioritize_current_poller()  # the engine's sync write busy-polls here
        while True:
            item = self._queue.get()
            if item is None:
                return
            ops, event = item
            if event is not None:
                event.synchronize()
            by_session: dict[str, list[WriteOp]] = {}
            for op in ops:
                by_session.setdefault(op.session, []).append(op)
            for session, sops in by_session.items():
                src, dst, lens = [], [], []
                for op in sops:
                    base = self.local_base_addrs[op.slot]
                    for s, d, n in contiguous_runs(op.src_blocks, op.dst_blocks):
                        src.append(base + s * self.block_len)
                        dst.append(op.dst_base_addr + d * self.block_len)
                        lens.append(n * self.block_len)
                err = self._injected_fault(sops)
                try:
                    if err is None:
                        rc = self.write_fn(session, src, dst, lens)
                        if rc != 0:
                            err = f"transfer engine returned {rc} writing to {session}"
                except Exception as e:  # never let the writer thread die
                    err = f"transfer engine raised {e!r} writing to {session}"
                with self.lock:
                    self.tracker.writes_done(sops, err is None, err)
                    self.stats["writes"] += len(src)
                    self.stats["bytes"] += sum(lens) if err is None else 0
                if err:
                    logger.error("Layer-wise push: %s", err)
                self._dispatch()

    def _injected_fault(self, ops: list[WriteOp]) -> str | None:
        if not write_fault_armed():  # tests only: keep the writer off the lock otherwise
            return None
        with self.lock:
            for op in ops:
                t = self.tracker.transfers.get(op.transfer_id)
                if t is not None and (err := write_fault(t.prompt_len)):
                    return err
        return None

    def shutdown(self) -> None:
        self._queue.put(None)

    # ---- completion ------------------------------------------------------------
    def _dispatch(self, aborted: set[str] | None = None) -> None:
        """Hand ended transfers to their waiters and free P blocks, exactly once."""
        resolved: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, str | None]] = []
        with self.lock:
            for t in self.tracker.pop_finished():
                err = None if t.state is TransferState.COMPLETED else (t.error or "failed")
                self.stats["transfers_completed" if err is None else "transfers_failed"] += 1
                self._results[t.transfer_id] = (time.monotonic(), err)
                waiter = self._waiters.pop(t.transfer_id, None)
                if waiter is not None:
                    resolved.append((*waiter, err))
                if err is not None:
                    logger.warning("Layer-wise transfer %s failed: %s", t.transfer_id, err)
            # A P request's blocks are freed once it finished normally and its
            # transfer ended; an aborted request's blocks were freed by the scheduler.
            for transfer_id, t in list(self.tracker.transfers.items()):
                if not t.done:
                    continue
                if aborted and transfer_id in aborted:
                    self.tracker.forget(transfer_id)
                elif t.request_finished:
                    self.finished_sending.add(t.p_req_id)
                    self.tracker.forget(transfer_id)
        for loop, fut, err in resolved:
            loop.call_soon_threadsafe(_set_result, fut, err)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


async def serve_xfer_request(pusher: LayerwisePusher, worker: Any, identity: bytes,
                             sock: zmq.asyncio.Socket, meta: Any) -> None:
    """P side of upstream's pull protocol, served from layer-wise pushes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeXferResponse,
        MooncakeXferResponseStatus,
    )

    async def reply(resp: Any) -> None:
        await sock.send_multipart((identity, worker._encoder.encode(resp)))

    if meta.remote_tp_size != worker.tp_size:
        await reply(MooncakeXferResponse(
            status=MooncakeXferResponseStatus.ERROR,
            err_msg=(f"layer-wise push needs equal TP sizes (prefill {worker.tp_size}, "
                     f"decode {meta.remote_tp_size}); unset MOONCAKE_LAYERWISE"),
        ))
        return
    session = f"{meta.remote_hostname}:{meta.remote_port}"
    tasks = {
        asyncio.create_task(pusher.push(transfer_id, Destination(session, list(meta.kv_caches_base_addr),
                                                                 list(block_ids)))): d_req_id
        for d_req_id, (transfer_id, block_ids) in meta.req_blocks.items()
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
        await reply(MooncakeXferResponse(
            status=MooncakeXferResponseStatus.CONTINUE if pending else MooncakeXferResponseStatus.FINISH,
            ok_reqs=ok or None,
            err_reqs=list(errs) or None,
            err_msg="; ".join(sorted(set(errs.values()))) or None,
        ))


def fail_pulls(worker: Any, pull_metas: dict[str, Any], req_ids: Any, reason: str) -> None:
    """Decode side: end failed pulls so their requests never wait forever.

    Each request is reported finished once, with its blocks marked invalid so the
    scheduler recomputes them (kv_load_failure_policy=recompute) or fails the
    request (fail); cleanup-only pulls are never reported.
    """
    for req_id in req_ids:
        pm = pull_metas.get(req_id)
        if pm is None or getattr(pm, "_lw_ended", False):
            continue
        pm._lw_ended = True
        logger.error("KV pull for request %s failed: %s", req_id, reason)
        if pm.d_req_id in worker._lw_cleanup_reqs:
            worker._lw_cleanup_reqs.discard(pm.d_req_id)
            continue
        worker._lw_invalid_block_ids.update(pm.local_block_ids)
        worker.finished_recving_reqs.add(pm.d_req_id)


def finish_pull(worker: Any, pull_meta: Any) -> bool:
    """Decode side: should a completed pull be reported to the scheduler? (exactly once)"""
    if getattr(pull_meta, "_lw_ended", False):
        return False
    pull_meta._lw_ended = True
    if pull_meta.d_req_id in worker._lw_cleanup_reqs:
        worker._lw_cleanup_reqs.discard(pull_meta.d_req_id)
        return False
    return True


__all__ = ["LayerwisePusher", "serve_xfer_request", "fail_pulls", "finish_pull", "Transfer"]
