# SPDX-License-Identifier: Apache-2.0
"""Keep KV-transfer threads off the compute cores on CPU-only hosts (MOONCAKE_IO_CPUS).

On a GPU host the model computes on the GPU and the KV moves through the NIC,
so the transfer never competes with the compute. vLLM's CPU backend binds the
worker process to its compute cores, and every thread started from it inherits
that binding: the transfer engine's, ZMQ's and the connector's threads then
steal cycles from the prefill the transfer is supposed to hide behind.

With MOONCAKE_IO_CPUS set (a CPU list such as "1" or "2-3"), the threads the
connector starts (the Mooncake transfer engine's, the sender/receiver loops and
their pools, the bootstrap server, the layer-wise writer) are started on those
CPUs instead; the compute threads are left alone. Unset, nothing changes.
Linux only. This is how this project emulates on a 2-core CPU machine the
separation a GPU host has by construction; GPU hosts do not need it.

The CPUs may be another instance's only when both instances run in one
scheduling group (one session where the kernel's autogroup is on, one cgroup
with the CPU controller): a group weighs little on a core it barely uses, and
its threads there starve while the other instance keeps the core busy (vLLM
0.32.0's worker spins while it waits for its engine). One of them holding the
GIL stops the instance's compute (tests/integration/test_io_cpus.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from .config import load


@contextlib.contextmanager
def threads_started_on_io_cpus(cpus: frozenset[int] | None = None) -> Iterator[None]:
    """Threads started inside this block run on MOONCAKE_IO_CPUS (if set)."""
    cpus = load().io_cpus if cpus is None else cpus
    if not cpus:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def move_current_thread_to_io_cpus(cpus: frozenset[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


POLLER_NICE = 19


def lower_current_thread_priority(nice: int = POLLER_NICE) -> bool:
    """Set this thread's nice (Linux: per thread, setpriority on its TID); False
    where that is not possible. A thread's nice cannot be raised back without
    privileges: call it on a thread of its own."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True


def deprioritize_current_poller(cpus: frozenset[int] | None) -> bool:
    """Lower this thread's CPU priority (nice 19) when MOONCAKE_IO_CPUS is set.

    A write polls the transfer engine for completion on the calling thread
    (engine_write.py spins first; the engine's own batch_transfer_sync_* calls
    busy-poll throughout). With the IO CPUs shared by the transport threads that
    actually move the bytes (and, under load, by a decode instance's compute),
    a poller at normal priority takes their CPU time: seen in mb7 under load,
    where transfers then crawled into Mooncake's 30 s timeout. At nice 19 it
    only polls with what is left. Unset MOONCAKE_IO_CPUS, the writer shares the
    instance's compute cores: at nice 19 it would also wait to *submit* each
    layer's write until the compute leaves it a slice (measured in mb7 under 8
    decode streams: P's last layer -> last write done 9.4 s instead of ~0.1 s,
    10-40% of the bytes written before P ended), so it keeps normal priority."""
    if not cpus:
        return False
    return lower_current_thread_priority(POLLER_NICE)
