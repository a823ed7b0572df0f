# SPDX-License-Identifier: Apache-2.0
"""Order remote reads of KV after the compute that writes it (CUDA streams).

On CUDA the forward pass only *launches* kernels: when ``save_kv_layer`` or
``get_finished`` runs, the KV they produce may not exist yet. Anything that
lets a peer read those blocks (a layer-wise write, a /push_blocks write of a
block published in the hash table) must first wait for an event recorded
after the kernels. On the CPU backend compute is synchronous and no event is
needed: :func:`record_after_compute` returns None there.

Written for CUDA; only the CPU path runs in this project's CI (no GPU). The
ordering itself is unit-tested with a fake event that records when it was
waited on (tests/unit/connector/common/test_gpu_order.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class ComputeEvent(Protocol):
    """The part of torch.cuda.Event we use."""

    def query(self) -> bool: ...  # True once the work before it has completed

    def synchronize(self) -> None: ...  # block until then


EventFactory = Callable[[torch.Tensor], "ComputeEvent | None"]


def record_after_compute(kv_tensor: torch.Tensor) -> ComputeEvent | None:
    """An event completing after the work queued so far on the current stream
    of ``kv_tensor``'s device, or None when that device computes synchronously."""
    if not kv_tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(kv_tensor.device))
    return event


def wait_all(events) -> None:
    """Block until every event (None: nothing to wait for) has completed."""
    for event in events:
        if event is not None:
            event.synchronize()


def completed(event: ComputeEvent | None) -> bool:
    return event is None or event.query()
