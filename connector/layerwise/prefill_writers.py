# SPDX-License-Identifier: Apache-2.0
"""P's layer-wise writer threads: one per decode session with work, each a FIFO.

A dead or slow decode peer stalls only the transfers to it. What a batch
means (which writes may still start, the write itself, what ends) is the
sender's (prefill_sender.py); this module only owns the threads and their queues.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..common.io_affinity import (
    deprioritize_current_poller,
    move_current_thread_to_io_cpus,
)

MAX_PEERS = 64  # decode sessions with queued or running writes at once
# Writers whose write has outlived its bound (a frozen or cut-off peer) leave the
# cap to the others, up to this many times MAX_PEERS writers in all.
OVERDUE_FACTOR = 4

Batch = TypeVar("Batch")


@dataclass(eq=False)
class _Writer(Generic[Batch]):
    """The writer thread of one decode session and its FIFO."""

    session: str
    queue: queue.Queue[Batch | None]
    # batches queued or being handled; changed under WriterPool._lock (with every
    # put), so 0 means nothing is queued and nothing is in flight
    pending: int = 0
    running_since: float | None = None  # the batch being run started then (clock)


class WriterPool(Generic[Batch]):
    """Runs ``run(session, batch)`` on the session's writer thread, in FIFO order,
    then ``after()``. A writer retires once it had nothing to do for ``idle_s``;
    at :data:`MAX_PEERS` sessions with work a new session is refused. A writer
    whose batch has run longer than ``overdue_after_s`` (the engine's bound: its
    peer is frozen or cut off) is counted as overdue and no longer counts
    toward that cap, so healthy peers proceed; its write goes on (its blocks stay
    out of use), and at most OVERDUE_FACTOR x MAX_PEERS writers exist at all."""

    def __init__(
        self,
        run: Callable[[str, Batch], None],
        after: Callable[[], None],
        io_cpus: list[int] | None,
        idle_s: float = 30.0,
        max_peers: int = MAX_PEERS,
        overdue_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._run = run
        self._after = after
        self._io_cpus = io_cpus
        self.idle_s = idle_s
        self.max_peers = max_peers
        self.overdue_after_s = overdue_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._writers: dict[str, _Writer[Batch]] = {}  # decode session -> its writer
        self._started = 0

    def submit(self, session: str, batch: Batch) -> bool:
        """Queue ``batch`` to the session's writer; False: refused (too many peers)."""
        with self._lock:  # the put too: a writer retires only with nothing queued
            writer = self._writer_for(session)
            if writer is None:
                return False
            writer.pending += 1
            writer.queue.put(batch)
        return True

    def _writer_for(self, session: str) -> _Writer[Batch] | None:
        """The writer serving ``session``, started on first use. Caller holds _lock.
        At max_peers, writers with nothing to do are retired to make room: the cap
        counts sessions with work, not every session seen."""
        w = self._writers.get(session)
        if w is not None:
            return w
        if len(self._writers) >= self.max_peers:
            for idle in [w for w in self._writers.values() if w.pending == 0]:
                del self._writers[idle.session]
                idle.queue.put(None)
            working = len(self._writers) - self._num_overdue()
            if (
                working >= self.max_peers
                or len(self._writers) >= OVERDUE_FACTOR * self.max_peers
            ):
                return None
        w = self._writers[session] = _Writer(session, queue.Queue())
        self._started += 1
        threading.Thread(
            target=self._loop,
            args=(w,),
            daemon=True,
            name=f"vllm-mooncake-layerwise-{self._started}",
        ).start()
        return w

    def _num_overdue(self) -> int:
        """Writers whose running batch has outlived overdue_after_s. Caller holds _lock."""
        if self.overdue_after_s is None:
            return 0
        now = self._clock()
        return sum(
            1
            for w in self._writers.values()
            if w.running_since is not None
            and now - w.running_since > self.overdue_after_s
        )

    def num_overdue(self) -> int:
        """Writers whose write has outlived the engine's bound (a frozen peer)."""
        with self._lock:
            return self._num_overdue()

    def num_writers(self) -> int:
        """Writer threads serving a decode session now."""
        with self._lock:
            return len(self._writers)

    def queued(self) -> bool:
        """A batch is queued or being run."""
        with self._lock:
            return any(w.pending for w in self._writers.values())

    def _loop(self, w: _Writer[Batch]) -> None:
        move_current_thread_to_io_cpus(self._io_cpus)
        deprioritize_current_poller(self._io_cpus)  # the write polls the engine
        while True:
            try:
                batch = w.queue.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if w.pending == 0:
                        if self._writers.get(w.session) is w:
                            del self._writers[w.session]
                        return
                continue
            if batch is None:
                return
            with self._lock:
                w.running_since = self._clock()
            try:
                self._run(w.session, batch)
            finally:
                with self._lock:
                    w.pending -= 1
                    w.running_since = None
            self._after()

    def shutdown(self) -> None:
        with self._lock:
            for w in self._writers.values():
                w.queue.put(None)
            self._writers.clear()
