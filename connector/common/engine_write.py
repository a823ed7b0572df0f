# SPDX-License-Identifier: Apache-2.0
"""Transfer-engine writes that return only when none of their bytes can still land.

``batch_transfer_sync_write`` (0.3.13, TCP) returns -1 at its timeout while the
batch's slices stay queued and can land later, so freeing blocks once it returned
could corrupt blocks given to another request. :class:`TerminalWriter` submits each
entry as a task and returns 0 or -1 only once the engine reports every task
completed or failed (-2, a slice timeout, is not) and, after a failure, once
:class:`~.send_queues.SendQueueFence` has passed: "returned = ended" holds. Past
``ExtConfig.engine_write_bound_s`` a write is logged overdue and still waited for.
Writes to a refused peer (peer_refusal.py) submit nothing. Verified on CPU over TCP.
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
        """Why a write to ``session`` (with ``layout``) would be refused now, or None."""
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
    """``write_fn``'s write; only a :class:`TerminalWriter` is told ``layout``."""
    if isinstance(write_fn, TerminalWriter):
        return write_fn(session, src, dst, lens, layout)
    return write_fn(session, src, dst, lens)


def write_refusal(write_fn: Any, session: str, layout: Layout = None) -> str | None:
    """Why ``write_fn`` refuses writes to ``session`` now, or None."""
    refusal = getattr(write_fn, "refusal", None)
    return refusal(session, layout) if refusal is not None else None


def write_stats(write_fn: Any) -> dict[str, float]:
    """A worker's write counters for the stats routes and /metrics (else zeros)."""
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
    """A :class:`TerminalWriter` over ``write_fn``'s engine when it has the per-task
    calls, else ``write_fn`` itself (tests' stand-ins)."""
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
