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
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENV_IO_CPUS = "MOONCAKE_IO_CPUS"


def parse_cpu_list(text: str) -> set[int]:
    """'0,2-3' -> {0, 2, 3}."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError as e:
            raise ValueError(f"{ENV_IO_CPUS}: bad CPU list {text!r}") from e
        if b < a:
            raise ValueError(f"{ENV_IO_CPUS}: bad CPU range {part!r} in {text!r}")
        cpus.update(range(a, b + 1))
    return cpus


def io_cpus() -> set[int] | None:
    raw = os.environ.get(ENV_IO_CPUS, "").strip()
    if not raw or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = parse_cpu_list(raw)
    missing = cpus - set(range(os.cpu_count() or 1))
    if not cpus or missing:
        raise ValueError(f"{ENV_IO_CPUS}={raw!r}: CPUs {sorted(missing)} do not exist on this host")
    return cpus


@contextlib.contextmanager
def threads_started_on_io_cpus() -> Iterator[None]:
    """Threads started inside this block run on MOONCAKE_IO_CPUS (if set)."""
    cpus = io_cpus()
    if cpus is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def move_current_thread_to_io_cpus() -> None:
    cpus = io_cpus()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


POLLER_NICE = 19


def deprioritize_current_poller() -> bool:
    """Lower this thread's CPU priority (nice 19) when MOONCAKE_IO_CPUS is set.

    The transfer engine's batch_transfer_sync_* calls busy-poll for completion
    on the calling thread. With the IO CPUs shared by the transport threads that
    actually move the bytes (and, under load, by a decode instance's compute),
    a poller at normal priority takes their CPU time: seen in mb7 under load,
    where transfers then crawled into Mooncake's 30 s timeout. At nice 19 it
    only polls with what is left. On Linux a thread's nice is per thread
    (setpriority on its TID). Unset MOONCAKE_IO_CPUS: nothing changes."""
    if io_cpus() is None or not hasattr(os, "setpriority"):
        return False
    import threading

    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), POLLER_NICE)
    return True
