# SPDX-License-Identifier: Apache-2.0
"""P-side state machine of layer-wise pushes: no I/O, threads or vLLM imports.

The sender (prefill_sender.py) calls it under one lock and runs the WriteOps it
returns. A slot is one registered KV tensor (slot i on P is slot i on D); per
slot, ``ready``/``issued``/``written`` count the request's blocks holding final
KV / handed to the writer / written (a contiguous prefix). D's destination may
arrive before, during or after the prefill; one for an id P's scheduler has not
announced waits aside (bounded by the sender): only the scheduler creates
transfers. Each transfer ends exactly once: completed or failed.

Invariant "no byte after the end" (relied on by prefill_sender.py):
- :meth:`start_writes` admits a write only for a transfer that has not ended and
  counts it in flight in the same call; transfers end under the same (sender's)
  lock, so no queued write of an ended transfer can start;
- :meth:`pop_finished` hands out an ended transfer (its end reported to D, its P
  blocks freeable) only once none of its writes is in flight.

Per-step calls touch only the transfers they name; nothing scans them all.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from .protocol import ComputedStep

# transfer ids of requests P's scheduler received and has not scheduled yet
# that are remembered (the oldest forgotten: a pull for one then waits only
# the unknown timeout, as for an id P never received)
MAX_RECEIVED = 65536


class TransferState(str, Enum):
    ACTIVE = "active"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(frozen=True)
class Destination:
    session: str  # "host:rpc_port" of D's transfer engine
    base_addrs: list[int]  # D's KV base address per slot
    block_ids: list[
        int
    ]  # D's blocks for the request (the prompt's tail if D had a prefix hit)


@dataclass(frozen=True)
class WriteOp:
    """Write blocks src_blocks[i] of slot `slot` on P to dst_blocks[i] on D."""

    transfer_id: str
    session: str
    slot: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    dst_base_addr: int
    first_block: int  # index (in the request) of src_blocks[0]
    epoch: int  # bumped when P re-allocates the request's blocks (preemption)
    dst_layout: tuple[int, ...] = ()  # D's KV base addresses, every slot's


@dataclass
class Transfer:
    transfer_id: str
    p_req_id: str
    prompt_len: int
    block_size: int
    num_slots: int
    block_ids: list[int] = field(default_factory=list)
    step_target: int = 0  # blocks final once the current step's layers are done
    ready: list[int] = field(default_factory=list)
    issued: list[int] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    # per slot: ranges [start, end) written beyond written[slot] (a later write
    # that landed before an earlier one); merged once the gap is written
    ahead: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    destination: Destination | None = None
    state: TransferState = TransferState.ACTIVE
    error: str | None = None
    epoch: int = 0
    request_finished: bool = False  # P's scheduler is done with the request
    holds_blocks: bool = True  # P's scheduler waits for finished_sending to free them
    inflight: int = 0  # writes admitted by start_writes and not yet done
    end_reported: bool = False  # handed out by pop_finished

    def __post_init__(self):
        self.ready = [0] * self.num_slots
        self.issued = [0] * self.num_slots
        self.written = [0] * self.num_slots

    @property
    def total_blocks(self) -> int:
        return math.ceil(self.prompt_len / self.block_size)

    @property
    def skip_blocks(self) -> int:
        """Leading blocks D already holds (prefix hit on D): never sent."""
        assert self.destination is not None
        return self.total_blocks - len(self.destination.block_ids)

    @property
    def done(self) -> bool:
        return self.state is not TransferState.ACTIVE


class LayerwiseTracker:
    """All layer-wise transfers of one prefill worker."""

    def __init__(self, num_slots: int, block_size: int):
        self.num_slots = num_slots
        self.block_size = block_size
        self.transfers: dict[str, Transfer] = {}
        self._step: list[str] = []  # transfers computed by the current forward step
        self._finished: list[Transfer] = []  # ended, not yet collected
        self._releasable: dict[str, Transfer] = {}  # end reported and P request done
        # D's addresses that arrived before P's scheduler announced the transfer,
        # and the block ids they name in all; changed only through
        # _add_pending/_pop_pending, which keep the counts of waiting()
        self._pending: dict[str, Destination] = {}
        self._pending_block_ids = 0
        # Transfers whose request P's scheduler received (it is queued there) and
        # has not announced yet, oldest first, at most MAX_RECEIVED.
        self._received: collections.OrderedDict[str, None] = collections.OrderedDict()
        # the ids in both _pending and _received, and the block ids they name
        self._pending_received: set[str] = set()
        self._pending_received_block_ids = 0
        self.inflight = 0  # writes in flight, all transfers
        # P requests that reused the transfer_id of another live request: never
        # sent (the id's transfer fails: D cannot tell whose KV it would get)
        self._duplicates: dict[str, str] = {}  # p_req_id -> transfer_id
        self._released_duplicates: list[str] = []  # ended: P frees their blocks

    # ---- prefill side events -------------------------------------------------
    def received(self, transfer_ids: Iterable[str]) -> None:
        """P's scheduler queued these transfers' requests (not :meth:`unknown`)."""
        for transfer_id in transfer_ids:
            if transfer_id in self.transfers:
                continue
            self._received[transfer_id] = None
            self._received.move_to_end(transfer_id)
            dest = self._pending.get(transfer_id)
            if dest is not None and transfer_id not in self._pending_received:
                self._pending_received.add(transfer_id)
                self._pending_received_block_ids += len(dest.block_ids)
            while len(self._received) > MAX_RECEIVED:
                self._unmark_received(next(iter(self._received)))

    def begin_step(self, steps: Iterable[ComputedStep]) -> list[WriteOp]:
        """A forward step starts; ``steps`` are the layer-wise requests it computes."""
        self._step = []
        ops: list[WriteOp] = []
        for step in steps:
            transfer_id, block_ids, computed = (
                step.transfer_id,
                list(step.block_ids),
                step.computed_tokens,
            )
            t = self._announced(transfer_id, step.p_req_id, step.prompt_len)
            if t is None or t.done:
                continue
            # P re-allocated the request (preemption): progress restarts, D's
            # blocks are rewritten with the same content
            if block_ids[: len(t.block_ids)] != t.block_ids:
                t.epoch += 1
                t.ready = [0] * self.num_slots
                t.issued = [0] * self.num_slots
                t.written = [0] * self.num_slots
                t.ahead = {}
            t.block_ids = list(block_ids)
            if computed >= t.prompt_len:
                t.step_target = t.total_blocks
            else:
                t.step_target = computed // self.block_size
            t.step_target = min(t.step_target, len(t.block_ids))
            self._step.append(transfer_id)
            ops += self._attach_pending(t)
        return ops

    def layer_computed(self, slots: list[int]) -> list[WriteOp]:
        """The current step finished computing the KV of these slots (one layer)."""
        ops: list[WriteOp] = []
        for transfer_id in self._step:
            t = self.transfers.get(transfer_id)
            if t is None or t.done:
                continue
            for s in slots:
                t.ready[s] = max(t.ready[s], t.step_target)
            ops += self._issue(t, slots)
        return ops

    def set_destination(self, transfer_id: str, dest: Destination) -> list[WriteOp]:
        """D's addresses arrived: issue everything computed so far."""
        t = self.transfers.get(transfer_id)
        if t is None:
            if transfer_id in self._pending:
                return []  # a duplicate; the first one stands
            self._add_pending(transfer_id, dest)  # D was faster: wait for P
            return []
        if t.done:
            return []
        if t.destination is not None:
            self._fail(t, "a second destination arrived for the same transfer")
            return []
        if len(dest.base_addrs) != self.num_slots:
            self._fail(
                t,
                f"destination has {len(dest.base_addrs)} KV tensors, this instance "
                f"{self.num_slots}: the two instances must run the same model",
            )
            return []
        if len(dest.block_ids) > t.total_blocks:
            self._fail(
                t,
                f"destination expects {len(dest.block_ids)} blocks, the prompt has "
                f"{t.total_blocks}",
            )
            return []
        t.destination = dest
        ops = self._issue(t, list(range(self.num_slots)))
        self._maybe_complete(t)
        return ops

    def start_writes(
        self, ops: Iterable[WriteOp]
    ) -> tuple[list[WriteOp], list[WriteOp]]:
        """The writer is about to run these ops: (admitted, dropped). Ops of an
        ended transfer or a stale epoch are dropped and must never run;
        admitted ops count as in flight until :meth:`writes_done`."""
        admitted, dropped = [], []
        for op in ops:
            t = self.transfers.get(op.transfer_id)
            if t is None or t.done or op.epoch != t.epoch:
                dropped.append(op)
                continue
            t.inflight += 1
            self.inflight += 1
            admitted.append(op)
        return admitted, dropped

    def writes_done(
        self, ops: list[WriteOp], ok: bool, error: str | None = None
    ) -> None:
        """The writer finished these admitted ops (all or nothing)."""
        for op in ops:
            t = self.transfers.get(op.transfer_id)
            if t is None:
                continue
            if t.inflight <= 0:
                raise AssertionError(
                    f"writes_done for transfer {op.transfer_id} with no write "
                    "in flight: every op must go through start_writes"
                )
            t.inflight -= 1
            self.inflight -= 1
            if t.done or op.epoch != t.epoch:
                continue
            if not ok:
                self._fail(t, error or "transfer engine write failed")
                continue
            _mark_written(
                t, op.slot, op.first_block, op.first_block + len(op.src_blocks)
            )
            self._maybe_complete(t)

    def request_finished(
        self, transfer_id: str, p_req_id: str, block_ids: list[int], prompt_len: int
    ) -> list[WriteOp]:
        """P's scheduler finished the request: every block is final in every slot
        (a post-hoc transfer is issued whole here)."""
        t = self._announced(transfer_id, p_req_id, prompt_len)
        if t is None:
            self._release_duplicate(p_req_id)
            return []
        self._mark_request_finished(t)
        if t.done:
            return []
        if block_ids[: len(t.block_ids)] != t.block_ids:
            t.epoch += 1
            t.issued = [0] * self.num_slots
            t.written = [0] * self.num_slots
            t.ahead = {}
        t.block_ids = list(block_ids)
        final = min(t.total_blocks, len(t.block_ids))
        t.ready = [final] * self.num_slots
        if t.destination is None:
            return self._attach_pending(t)
        ops = self._issue(t, list(range(self.num_slots)))
        self._maybe_complete(t)
        return ops

    def release(
        self,
        transfer_id: str,
        p_req_id: str,
        prompt_len: int,
        holds_blocks: bool = True,
        reason: str = "the request ended on the prefill instance",
    ) -> None:
        """P's request ended without completing (abort): the transfer fails.
        holds_blocks=False: the scheduler freed its blocks already."""
        t = self._announced(transfer_id, p_req_id, prompt_len)
        if t is None:
            self._release_duplicate(p_req_id, holds_blocks)
            return
        # the transfer takes over a waiting destination: D is answered now
        self._pop_pending(transfer_id)
        t.holds_blocks = t.holds_blocks and holds_blocks
        self._mark_request_finished(t)
        self._fail(t, reason)

    def fail(self, transfer_id: str, reason: str) -> None:
        """Fail an announced transfer (abort, preemption, expiry); others stay."""
        t = self.transfers.get(transfer_id)
        if t is not None:
            self._fail(t, reason)

    def drop_pending(self, transfer_id: str) -> bool:
        """Drop a never-announced transfer's destination; True if there was one."""
        return self._pop_pending(transfer_id) is not None

    # ---- results -------------------------------------------------------------
    def pop_finished(self) -> list[Transfer]:
        """Transfers that ended and have no write in flight, each returned exactly once.
        An ended transfer stays known (late steps cannot restart it) until forget()."""
        out = [t for t in self._finished if t.inflight == 0]
        self._finished = [t for t in self._finished if t.inflight > 0]
        for t in out:
            t.end_reported = True
            if t.request_finished:
                self._releasable[t.transfer_id] = t
        return out

    def pop_released_duplicates(self) -> list[str]:
        """Ended P requests that reused a live transfer_id (never sent), each once."""
        out, self._released_duplicates = self._released_duplicates, []
        return out

    def num_duplicates(self) -> int:
        """Live P requests that reused another live request's transfer_id."""
        return len(self._duplicates)

    def pop_releasable(self) -> list[Transfer]:
        """Reported transfers whose P request is done, each once: free and forget them."""
        out = list(self._releasable.values())
        self._releasable.clear()
        return out

    def forget(self, transfer_id: str) -> None:
        """Drop all state of a transfer (P's request is gone, no write in flight)."""
        t = self.transfers.get(transfer_id)
        if t is not None and t.inflight:
            raise AssertionError(
                f"forget({transfer_id}) with {t.inflight} writes in flight"
            )
        self.transfers.pop(transfer_id, None)
        self._pop_pending(transfer_id)
        self._releasable.pop(transfer_id, None)
        if transfer_id in self._step:
            self._step.remove(transfer_id)

    def get(self, transfer_id: str) -> Transfer | None:
        return self.transfers.get(transfer_id)

    def unknown(self, transfer_id: str) -> bool:
        """Neither announced nor received by P's scheduler (early, stale or forged)."""
        return transfer_id not in self._received and (
            transfer_id in self._pending or transfer_id not in self.transfers
        )

    def queued(self, transfer_id: str) -> bool:
        """Received by P's scheduler (queued there), not announced yet."""
        return transfer_id in self._received

    def num_unannounced(self) -> int:
        """Destinations waiting for an unannounced transfer (both kinds)."""
        return len(self._pending)

    def num_unannounced_block_ids(self) -> int:
        """The block ids those destinations hold (what they cost in memory)."""
        return self._pending_block_ids

    def waiting(self, queued: bool) -> tuple[int, int]:
        """(destinations, block ids) waiting for a request queued on P, or else unknown."""
        if queued:
            return len(self._pending_received), self._pending_received_block_ids
        return (
            len(self._pending) - len(self._pending_received),
            self._pending_block_ids - self._pending_received_block_ids,
        )

    # ---- internals -----------------------------------------------------------
    def _announced(
        self, transfer_id: str, p_req_id: str, prompt_len: int
    ) -> Transfer | None:
        """The transfer announced for ``p_req_id``; None if that request reused
        the transfer_id of another live request (then neither is sent)."""
        self._unmark_received(transfer_id)
        if p_req_id and p_req_id in self._duplicates:
            return None
        t = self.transfers.get(transfer_id)
        if t is not None and t.p_req_id and p_req_id and t.p_req_id != p_req_id:
            self._duplicates[p_req_id] = transfer_id
            self._fail(
                t,
                f"two requests on the prefill instance use transfer_id {transfer_id} "
                f"({t.p_req_id} and {p_req_id}): neither is sent; give each request "
                "a transfer_id of its own",
            )
            return None
        return self._get_or_create(transfer_id, p_req_id, prompt_len)

    def _release_duplicate(self, p_req_id: str, holds_blocks: bool = True) -> None:
        self._duplicates.pop(p_req_id, None)
        if holds_blocks:
            self._released_duplicates.append(p_req_id)

    def _get_or_create(
        self, transfer_id: str, p_req_id: str, prompt_len: int
    ) -> Transfer:
        """The transfer P's scheduler announces (a step, or the request's end)."""
        t = self.transfers.get(transfer_id)
        if t is None:
            t = Transfer(
                transfer_id, p_req_id, prompt_len, self.block_size, self.num_slots
            )
            self.transfers[transfer_id] = t
        elif p_req_id and not t.p_req_id:
            t.p_req_id = p_req_id
        return t

    def _mark_request_finished(self, t: Transfer) -> None:
        t.request_finished = True
        if t.end_reported:
            self._releasable[t.transfer_id] = t

    def _attach_pending(self, t: Transfer) -> list[WriteOp]:
        dest = self._pop_pending(t.transfer_id)
        return [] if dest is None else self.set_destination(t.transfer_id, dest)

    def _add_pending(self, transfer_id: str, dest: Destination) -> None:
        self._pending[transfer_id] = dest
        self._pending_block_ids += len(dest.block_ids)
        if transfer_id in self._received:
            self._pending_received.add(transfer_id)
            self._pending_received_block_ids += len(dest.block_ids)

    def _pop_pending(self, transfer_id: str) -> Destination | None:
        dest = self._pending.pop(transfer_id, None)
        if dest is None:
            return None
        self._pending_block_ids -= len(dest.block_ids)
        if transfer_id in self._pending_received:
            self._pending_received.remove(transfer_id)
            self._pending_received_block_ids -= len(dest.block_ids)
        return dest

    def _unmark_received(self, transfer_id: str) -> None:
        """The received mark ends (announced, or the oldest forgotten)."""
        self._received.pop(transfer_id, None)
        if transfer_id in self._pending_received:
            self._pending_received.remove(transfer_id)
            self._pending_received_block_ids -= len(
                self._pending[transfer_id].block_ids
            )

    def _issue(self, t: Transfer, slots: list[int]) -> list[WriteOp]:
        if t.destination is None or t.done:
            return []
        skip = t.skip_blocks
        ops = []
        for s in slots:
            start = max(t.issued[s], skip)
            end = t.ready[s]
            if end <= start:
                continue
            src = t.block_ids[start:end]
            dst = t.destination.block_ids[start - skip : end - skip]
            ops.append(
                WriteOp(
                    t.transfer_id,
                    t.destination.session,
                    s,
                    tuple(src),
                    tuple(dst),
                    t.destination.base_addrs[s],
                    start,
                    t.epoch,
                    tuple(t.destination.base_addrs),
                )
            )
            t.issued[s] = end
        # Slots fully skipped (D holds everything) count as written.
        for s in slots:
            if t.written[s] < skip:
                t.written[s] = min(skip, t.total_blocks)
        return ops

    def _maybe_complete(self, t: Transfer) -> None:
        if t.done or t.destination is None:
            return
        if all(w >= t.total_blocks for w in t.written):
            t.state = TransferState.COMPLETED
            self._finished.append(t)

    def _fail(self, t: Transfer, reason: str) -> None:
        if t.done:
            return
        t.state = TransferState.FAILED
        t.error = reason
        self._finished.append(t)


def _mark_written(t: Transfer, slot: int, start: int, end: int) -> None:
    """Blocks [start, end) of ``slot`` were written. written[slot] grows only over
    a contiguous prefix: writes may land out of order (different threads)."""
    if start > t.written[slot]:
        t.ahead.setdefault(slot, []).append((start, end))
        return
    t.written[slot] = max(t.written[slot], end)
    ahead = t.ahead.get(slot)
    while ahead:
        ready = [r for r in ahead if r[0] <= t.written[slot]]
        if not ready:
            break
        for r in ready:
            ahead.remove(r)
            t.written[slot] = max(t.written[slot], r[1])
