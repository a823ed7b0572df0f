# SPDX-License-Identifier: Apache-2.0
"""Run C's push write on a fresh thread at the lowest CPU priority (nice 19).

The write polls the engine for completion on its calling thread
(engine_write.TerminalWriter) while the transport's own threads move the bytes.
Where both share a core (vLLM binds the instance to its cores), the poller at
nice 0 takes about half of it from the io thread; at nice 19 it only gets the
cycles the io thread leaves and still sees the completion as soon as it is done.
A thread's nice cannot be raised back without privileges, so each write gets a
new thread and the caller waits for it: the write stays synchronous for the
push's "no byte after the end" accounting.
"""

from __future__ import annotations

import threading

from ..common.engine_write import WriteFn, write_to
from ..common.io_affinity import POLLER_NICE, lower_current_thread_priority

WRITER_NICE = POLLER_NICE


class LowPriorityWriter:
    """Calls ``write_fn`` on a new thread at ``nice`` and returns its result
    (or raises what it raised) once it has returned."""

    def __init__(self, write_fn: WriteFn, nice: int = WRITER_NICE):
        if not 0 <= nice <= 19:
            raise ValueError(
                f"nice {nice} is not in 0..19 (a writer never raises its priority)"
            )
        self.write_fn = write_fn
        self.nice = nice

    def __call__(
        self,
        session: str,
        src: list[int],
        dst: list[int],
        lens: list[int],
        layout: tuple[int, ...] | None = None,
    ) -> int:
        result: list[int] = []
        error: list[BaseException] = []

        def run() -> None:
            lower_current_thread_priority(self.nice)  # best effort (io_affinity)
            try:
                result.append(write_to(self.write_fn, session, src, dst, lens, layout))
            except BaseException as e:  # handed to the caller, who decides
                error.append(e)

        t = threading.Thread(target=run, name="push-write", daemon=True)
        t.start()
        t.join()
        if error:
            raise error[0]
        return result[0]
