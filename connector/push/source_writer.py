# SPDX-License-Identifier: Apache-2.0
"""Run C's push write on a thread at the lowest CPU priority (nice 19).

Every write of this series polls the engine for completion on the calling
thread (engine_write.TerminalWriter: it spins for its first polls, then sleeps
with a back-off); the engine's own ``batch_transfer_sync_write``, which the
figures below were measured with, busy-polls without sleeping (mooncake 0.3.13,
``TransferEnginePy::batchTransferSync``). The bytes are moved by the
transport's own threads (TCP: one io thread). When the caller and those
threads share one core, as on this project's CPU machine where vLLM binds the
whole instance to its cores (VLLM_CPU_OMP_THREADS_BIND), the poller takes half
of that core from the io thread: measured with the engine alone (writer
process pinned to one core, reader on the other, 256 MiB), the poller used
0.14 s of CPU against the io thread's 0.10 s, and the same write took 0.62 s
polled at nice 0 against 0.37 s at nice 19 (medians of 7, loaded machine;
0.28 s against 0.21 s unloaded). At nice 19 the poller only gets the cycles the
io thread leaves, so it still sees the completion as soon as the io thread is
done; on a host with idle cores nothing changes.

Each write gets a fresh thread (a thread's nice cannot be raised back without
privileges, so the caller's own thread is left alone), and the caller waits
for it: the write stays synchronous for the push's "no byte after the end"
accounting. The layer-wise writer's threads poll at the same nice
(io_affinity.deprioritize_current_poller).
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
