# SPDX-License-Identifier: Apache-2.0
"""Order remote reads of KV after the compute that writes it (CUDA streams).

On CUDA the forward pass only launches kernels, so whatever lets a peer read blocks
(a layer-wise write, a /push_blocks write) first waits for an event recorded after
them. On CPU compute is synchronous: :func:`record_after_compute` returns None.
Only the CPU path runs in CI; the ordering is unit-tested with a fake event.
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
    """An event after the work queued on ``kv_tensor``'s stream; None on CPU."""
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
