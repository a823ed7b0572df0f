# SPDX-License-Identifier: Apache-2.0
"""P's layer-wise writer threads: one FIFO per decode session with work.

A dead or slow decode peer stalls only the transfers to it. Only threads and
queues live here; what a batch means is the sender's (prefill_sender.py).
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
# Writers whose write has outlived its bound (a frozen or cut-off peer; the write
# goes on and its blocks stay held) leave the cap to the others, up to this many
# times MAX_PEERS writers in all.
OVERDUE_FACTOR = 4
# shutdown waits this long for the batches being run (a write to a frozen peer
# may last the engine's bound; shutdown does not wait for that)
SHUTDOWN_WAIT_S = 5.0

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
    thread: threading.Thread | None = None


class WriterPool(Generic[Batch]):
    """Runs ``run(session, batch)`` on the session's writer thread, in FIFO order,
    then ``after()``. A writer retires after ``idle_s`` without work; past
    ``overdue_after_s`` it leaves the MAX_PEERS cap (see OVERDUE_FACTOR).
    ``drop(session, batch)`` gets each batch that will never run (shutdown)."""

    def __init__(
        self,
        run: Callable[[str, Batch], None],
        after: Callable[[], None],
        io_cpus: list[int] | None,
        idle_s: float = 30.0,
        max_peers: int = MAX_PEERS,
        overdue_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        drop: Callable[[str, Batch], None] | None = None,
    ):
        self._run = run
        self._drop = drop
        self._after = after
        self._io_cpus = io_cpus
        self.idle_s = idle_s
        self.max_peers = max_peers
        self.overdue_after_s = overdue_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._writers: dict[str, _Writer[Batch]] = {}  # decode session -> its writer
        self._started = 0
        self._closed = False  # shut down: nothing starts any more

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, session: str, batch: Batch) -> bool:
        """Queue ``batch`` to the session's writer; False: refused (cap, shutdown)."""
        with self._lock:  # the put too: a writer retires only with nothing queued
            if self._closed:
                return False
            writer = self._writer_for(session)
            if writer is None:
                return False
            writer.pending += 1
            writer.queue.put(batch)
        return True

    def _writer_for(self, session: str) -> _Writer[Batch] | None:
        """The writer serving ``session``, started on first use. Caller holds _lock."""
        w = self._writers.get(session)
        if w is not None:
            return w
        if len(self._writers) >= self.max_peers:
            # the cap counts sessions with work: idle writers make room
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
        w.thread = threading.Thread(
            target=self._loop,
            args=(w,),
            daemon=True,
            name=f"vllm-mooncake-layerwise-{self._started}",
        )
        w.thread.start()
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
                closed = self._closed
                if closed:
                    w.pending -= 1
                else:
                    w.running_since = self._clock()
            if closed:
                # NOTE: taken from the queue just before shutdown drained it:
                # shutdown waits for this thread, so it is dropped before it returns
                self._dropped(w.session, batch)
                return
            try:
                self._run(w.session, batch)
            finally:
                with self._lock:
                    w.pending -= 1
                    w.running_since = None
            self._after()

    def _dropped(self, session: str, batch: Batch) -> None:
        if self._drop is not None:
            self._drop(session, batch)

    def shutdown(self, wait_s: float = SHUTDOWN_WAIT_S) -> list[str]:
        """Stop: no batch starts from now on (queued ones go to ``drop``); returns
        the sessions still running a batch after ``wait_s``."""
        dropped: list[tuple[str, Batch]] = []
        with self._lock:  # submit and the loops check _closed under it
            self._closed = True
            writers = list(self._writers.values())
            self._writers.clear()
            for w in writers:
                while True:
                    try:
                        batch = w.queue.get_nowait()
                    except queue.Empty:
                        break
                    if batch is not None:
                        w.pending -= 1
                        dropped.append((w.session, batch))
                w.queue.put(None)
        for session, batch in dropped:
            self._dropped(session, batch)
        deadline = time.monotonic() + wait_s
        me = threading.current_thread()
        for w in writers:
            if w.thread is not None and w.thread is not me:
                w.thread.join(max(0.0, deadline - time.monotonic()))
        return [
            w.session for w in writers if w.thread is not None and w.thread.is_alive()
        ]
