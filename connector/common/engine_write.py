# SPDX-License-Identifier: Apache-2.0
"""Transfer-engine writes that return only when none of their bytes can still land.

Mooncake's ``batch_transfer_sync_write`` (0.3.13, TCP) gives up after
``max(5, atoi(MC_TRANSFER_TIMEOUT))`` s + 1 ns per byte and returns -1, but the
batch's slices stay queued in the transport: measured on this project's
machine with two processes on loopback, a 256 MiB write to a receiver stopped
for 9 s returned -1 after 5.3 s and every byte of it landed 3.7 s later. A
returned call is therefore no proof that nothing is in flight, and every
"free the blocks once the write returned" built on it could corrupt blocks that
were already given to another request.

:class:`TerminalWriter` writes each entry as a task of its own
(``transfer_submit_write``) and polls ``transfer_check_status`` until the
engine reports every task terminal: completed (1) or failed (-1), which
Mooncake reports only once every slice of the task is done or failed
(``MultiTransport::getTransferStatus``). Status -2 (a slice timed out) is not
terminal and polling goes on. Only then does the call return, 0 on success
and -1 otherwise, so callers keep their "returned = ended" accounting and it is
now true. Measured with the same stopped receiver: no early return, the call
returned when the bytes had landed (9.9 s); with the receiver stopped 45 s,
the transport failed the slices on the stalled connection after 30 s and the
queued ones completed when it resumed: the call returned after both.

The engine gives no upper bound of its own on a task's life (a receiver that
is stopped keeps its queued tasks pending). Past
``ExtConfig.engine_write_bound_s`` the write is logged as overdue, once, and
the wait goes on: its blocks stay out of use (the writer's source blocks, and
on the peer the blocks the peer holds for it); a peer that stops holding at the
bound is the residual risk docs/architecture.md states.

A task reported FAILED is not proof either: after a link cut longer than the
transport's 30 s no-progress watchdog, the bytes of its dropped connections
are still in the kernel's send queues and land when the link returns. A failed
write therefore returns only once :class:`~.send_queues.SendQueueFence` has
seen every byte the kernel held for the peer at that moment acknowledged or
dropped.

A peer whose writes keep failing is refused for a while (peer_refusal.py): a
refused write submits nothing and returns -1 at once.

Verified on the CPU backend over TCP (mooncake-transfer-engine-non-cuda
0.3.13.post1). The CUDA/RDMA build has the same Python calls; not run here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from vllm.logger import init_logger

from .config import ExtConfig
from .peer_refusal import Layout, RefusedPeers
from .send_queues import KernelSockets, SendQueueFence, fence_stats
from .write_bounds import stalled_delivery_bound_s

logger = init_logger(__name__)

WriteFn = Callable[[str, list[int], list[int], list[int]], int]

# transfer_check_status's answers (TransferEnginePy::transferCheckStatus)
TASK_COMPLETED = 1
TASK_FAILED = -1
TASK_PENDING = 0
TASK_SLICE_TIMEOUT = -2  # a slice exceeded slice_timeout; still pending
SUBMIT_FAILED = 0  # transfer_submit_write's batch id when nothing was submitted

# Poll cadence: spin briefly (a layer's write takes ~1 ms here), then back off.
_SPIN_POLLS = 50
_MIN_SLEEP_S = 50e-6
_MAX_SLEEP_S = 5e-4


class AsyncTaskEngine(Protocol):
    """The part of mooncake.engine.TransferEngine this module uses."""

    def transfer_submit_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int
    ) -> int: ...

    def transfer_check_status(self, batch_id: int) -> int: ...


class TerminalWriter:
    """``(session, src, dst, lens) -> 0 | -1``, returning only once every entry is
    terminal in the engine. Thread-safe: each call polls its own tasks."""

    def __init__(
        self,
        engine: AsyncTaskEngine,
        config: ExtConfig,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        fence: SendQueueFence | None = None,
        peers: RefusedPeers | None = None,
        protocol: str = "tcp",
    ):
        self.engine = engine
        self.config = config
        # after a failed write: the bytes still in the kernel's send queues (TCP),
        # or the fabric's bound (RDMA)
        self.fence = (
            fence
            if fence is not None
            else SendQueueFence(
                hold_s=stalled_delivery_bound_s(
                    config.tcp_orphan_retries, config.engine_no_progress_s
                ),
                rdma=protocol == "rdma",
                rdma_hold_s=config.rdma_failed_write_hold_s,
                # a fault test's fence that reads nothing (fault_injection.py)
                kernel=KernelSockets(readers={}) if config.faults.fence_blind else None,
            )
        )
        # peers whose writes keep failing, refused for a while
        self.peers = peers if peers is not None else RefusedPeers(clock=clock)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self.overdue = 0  # writes that outlived engine_write_bound_s (observability)

    def __call__(
        self,
        session: str,
        src: Sequence[int],
        dst: Sequence[int],
        lens: Sequence[int],
        layout: Layout = None,
    ) -> int:
        if not (len(src) == len(dst) == len(lens)):
            logger.error(
                "engine write to %s: %d sources, %d destinations, %d lengths",
                session,
                len(src),
                len(dst),
                len(lens),
            )
            return -1
        why = self.peers.refusal(session, layout)
        if why is not None:
            logger.debug("engine write: %s", why)
            return -1
        rc = self._write(session, src, dst, lens)
        self.peers.record(session, rc == 0, layout)
        return rc

    def refusal(self, session: str, layout: Layout = None) -> str | None:
        """Why a write to ``session`` (its KV ``layout``, where the caller knows it)
        would be refused now (peer_refusal.py), or None. Callers that can name the
        reason to their requester ask first."""
        return self.peers.refusal(session, layout)

    def _write(
        self, session: str, src: Sequence[int], dst: Sequence[int], lens: Sequence[int]
    ) -> int:
        start = self._clock()
        self.fence.note(session)
        tasks: list[int] = []
        submitted_all = True
        try:
            for s, d, n in zip(src, dst, lens):
                batch_id = self.engine.transfer_submit_write(
                    session, int(s), int(d), int(n)
                )
                if batch_id == SUBMIT_FAILED:
                    # Nothing of this entry was queued; what was queued before it
                    # still has to become terminal before we may return.
                    submitted_all = False
                    logger.error(
                        "engine write to %s: submitting an entry of %d bytes failed "
                        "(%d of %d entries queued)",
                        session,
                        n,
                        len(tasks),
                        len(src),
                    )
                    break
                tasks.append(batch_id)
        except Exception:
            # NOTE: what was queued before the entry that raised can still land:
            # it is waited for and fenced like any failed write before we report.
            submitted_all = False
            logger.exception(
                "engine write to %s: submitting entry %d of %d raised",
                session,
                len(tasks),
                len(src),
            )
        nbytes = sum(int(n) for n in lens)
        bound = self.config.engine_write_bound_s(nbytes)
        try:
            failed = self._wait_terminal(session, tasks, nbytes, start)
        except Exception:
            # NOTE: fail closed. The engine cannot say whether its tasks ended:
            # they may still be queued in the transport, which no kernel reading
            # shows, so the write is held for its whole bound, then fenced.
            logger.exception(
                "engine write to %s: reading its tasks' status raised; held for its "
                "bound (%.0f s from its start)",
                session,
                bound,
            )
            while (left := start + bound - self._clock()) > 0:
                self._sleep(min(left, 1.0))
            failed = len(tasks)
        if failed or not submitted_all:
            if tasks:
                # A FAILED task is no proof: its bytes may sit in the kernel's
                # send queues and land when the link returns (send_queues.py).
                self.fence.wait(session, bound, start)
            return -1
        return 0

    def _wait_terminal(
        self, session: str, tasks: list[int], nbytes: int, start: float
    ) -> int:
        """Poll until every task is terminal; returns how many failed."""
        pending = list(tasks)
        failed = 0
        bound = self.config.engine_write_bound_s(nbytes)
        warned = False
        polls = 0
        delay = _MIN_SLEEP_S
        while pending:
            still = []
            for batch_id in pending:
                status = self.engine.transfer_check_status(batch_id)
                if status == TASK_COMPLETED:
                    continue
                if status == TASK_FAILED:
                    failed += 1
                    continue
                still.append(batch_id)  # pending, or a slice timed out (not terminal)
            pending = still
            if not pending:
                break
            polls += 1
            if not warned and self._clock() - start > bound:
                warned = True
                with self._lock:
                    self.overdue += 1
                logger.error(
                    "engine write to %s (%d bytes): %d of %d entries still in flight %.0f s "
                    "after it started, past the engine's bound (handshake + MC_TRANSFER_TIMEOUT "
                    "+ 1 ns/byte + no-progress watchdog); its blocks stay out of use until the "
                    "engine reports every entry done or failed",
                    session,
                    nbytes,
                    len(pending),
                    len(tasks),
                    self._clock() - start,
                )
            if polls > _SPIN_POLLS:
                self._sleep(delay)
                delay = min(delay * 2, _MAX_SLEEP_S)
        return failed


def write_to(
    write_fn: Any,
    session: str,
    src: Sequence[int],
    dst: Sequence[int],
    lens: Sequence[int],
    layout: Layout = None,
) -> int:
    """``write_fn``'s write, naming the destination's ``layout`` to a
    :class:`TerminalWriter` (its refusals are kept per layout); another write
    function (upstream's engine call, a test's stand-in) gets the four
    arguments it takes."""
    if isinstance(write_fn, TerminalWriter):
        return write_fn(session, src, dst, lens, layout)
    return write_fn(session, src, dst, lens)


def write_refusal(write_fn: Any, session: str, layout: Layout = None) -> str | None:
    """Why ``write_fn`` (a :class:`TerminalWriter`, or another write function:
    never refused) refuses writes to ``session`` now, or None."""
    refusal = getattr(write_fn, "refusal", None)
    return refusal(session, layout) if refusal is not None else None


def write_stats(write_fn: Any) -> dict[str, float]:
    """The counters of a worker's writes (every path) as the stats routes and
    /metrics serve them: failed writes that waited for the kernel's send queues
    (send_queues.py), writes past the engine's bound, refused peers (zeros for
    another write function)."""
    peers = getattr(write_fn, "peers", None)
    return {
        **fence_stats(write_fn),
        "overdue_writes": getattr(write_fn, "overdue", 0),
        "refused_peers_now": peers.num_refused() if peers is not None else 0,
        "peer_refusals": getattr(peers, "refusals", 0),
        "refused_writes": getattr(peers, "refused_writes", 0),
    }


def terminal_write_fn(
    write_fn: WriteFn, config: ExtConfig, protocol: str = "tcp"
) -> WriteFn:
    """The write function this series uses for ``write_fn`` (the engine's
    ``batch_transfer_sync_write``, as upstream registers it): a
    :class:`TerminalWriter` over the same engine when the engine has the
    per-task calls, else ``write_fn`` itself (unit tests' stand-ins). Says once
    what a failed write waits for on this host."""
    engine: Any = getattr(write_fn, "__self__", None)
    if (
        engine is not None
        and hasattr(engine, "transfer_submit_write")
        and hasattr(engine, "transfer_check_status")
    ):
        writer = TerminalWriter(engine, config, protocol=protocol)
        writer.fence.say_at_start()
        return writer
    return write_fn


__all__ = [
    "TerminalWriter",
    "WriteFn",
    "terminal_write_fn",
    "write_refusal",
    "write_to",
    "write_stats",
]
