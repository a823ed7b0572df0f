# SPDX-License-Identifier: Apache-2.0
"""Keep KV-transfer threads off the compute cores on CPU-only hosts (MOONCAKE_IO_CPUS).

vLLM's CPU backend binds the worker to its compute cores, and threads started from
it inherit that. With MOONCAKE_IO_CPUS set, the threads the connector starts
(transfer engine, sender and receiver loops, bootstrap server, layer-wise writer)
run on those CPUs instead; compute threads are left alone. Unset, nothing changes.
Linux only. Sharing the CPUs with another instance needs one scheduling group
(kernel autogroup or CPU cgroup), else its threads starve
(tests/integration/test_io_cpus.py).
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
    """Set this thread's nice (per TID); False where impossible. It cannot be raised
    back without privileges: call it on a thread of its own."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True


def deprioritize_current_poller(cpus: frozenset[int] | None) -> bool:
    """Lower this polling thread to nice 19 when MOONCAKE_IO_CPUS is set, so it
    leaves the IO CPUs to the transport threads that move the bytes."""
    # on the compute cores nice 19 would delay submitting each layer's write
    # (measured: 9.4 s instead of ~0.1 s): keep normal priority there
    if not cpus:
        return False
    return lower_current_thread_priority(POLLER_NICE)
