# SPDX-License-Identifier: Apache-2.0
"""P's scheduler side of layer-wise push: which blocks each step computes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from .protocol import (
    ComputedStep,
    FinishedRequest,
    LayerwiseMetadata,
    TransferMode,
    requested_mode,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)
MAX_WARNED = 64  # distinct bad mode values warned about (a client cannot flood the log)


@dataclass
class _Tracked:
    transfer_id: str
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)


class LayerwiseScheduler:
    """Scheduler-side state of P's layer-wise transfers."""

    def __init__(self, min_tokens: int):
        self.min_tokens = min_tokens
        self._reqs: dict[str, _Tracked] = {}
        self._pending = LayerwiseMetadata()
        self._warned: set[str] = set()

    def mode(self, request: Request) -> TransferMode:
        """The request's ``mooncake_mode``, else by MOONCAKE_LAYERWISE_MIN_TOKENS."""
        try:
            chosen = requested_mode(getattr(request, "kv_transfer_params", None))
        except ValueError as e:
            chosen = None
            if str(e) not in self._warned and len(self._warned) < MAX_WARNED:
                self._warned.add(str(e))
                logger.warning(
                    "Request %s: %s; using this instance's default "
                    "(MOONCAKE_LAYERWISE_MIN_TOKENS=%d)",
                    request.request_id,
                    e,
                    self.min_tokens,
                )
        if chosen is not None:
            return chosen
        return (
            TransferMode.LAYERWISE
            if request.num_prompt_tokens >= self.min_tokens
            else TransferMode.POSTHOC
        )

    def received(self, transfer_id: str) -> None:
        """A do_remote_decode request was queued: told to the worker next step."""
        self._pending.received.append(transfer_id)

    def track(self, request: Request, transfer_id: str) -> None:
        """Register a do_remote_decode request (post-hoc: sent whole at the end)."""
        if self.mode(request) is TransferMode.LAYERWISE:
            self._reqs[request.request_id] = _Tracked(
                transfer_id, request.num_prompt_tokens
            )

    def request_finished(
        self, request: Request, block_ids: list[int], transfer_id: str
    ) -> bool:
        """P's request ended; True: the scheduler keeps its blocks until
        finished_sending (also after an abort: no write in flight may read them
        once reused)."""
        from vllm.v1.request import RequestStatus

        self._reqs.pop(request.request_id, None)
        if not block_ids:
            self._pending.aborted.append(transfer_id)
            return False
        self._pending.finished.append(
            FinishedRequest(
                transfer_id,
                request.request_id,
                tuple(block_ids),
                request.num_prompt_tokens,
                aborted=request.status != RequestStatus.FINISHED_LENGTH_CAPPED,
            )
        )
        return True

    def build(self, scheduler_output: SchedulerOutput) -> LayerwiseMetadata:
        meta, self._pending = self._pending, LayerwiseMetadata()
        if not self._reqs:
            return meta
        # Preempted: its blocks went back to the pool in this very schedule and
        # this step may compute other requests' KV into them, so its transfer
        # fails now (D prefills locally). A request resumed without having been
        # listed as preempted (reset_prefix_cache preempts outside a step) lost
        # its blocks the same way. Either way the request is not sent per layer
        # any more; it is still reported when it finishes (request_finished).
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if (t := self._reqs.pop(req_id, None)) is not None:
                meta.preempted.append(t.transfer_id)
        for req_id in cached.resumed_req_ids:
            if (t := self._reqs.pop(req_id, None)) is not None:
                meta.preempted.append(t.transfer_id)
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = single_group(new.block_ids, new.req_id)
            computed = new.num_computed_tokens + num_scheduled.get(new.req_id, 0)
            meta.steps.append(
                ComputedStep(
                    t.transfer_id,
                    new.req_id,
                    tuple(t.block_ids),
                    computed,
                    t.prompt_len,
                )
            )
        for i, req_id in enumerate(cached.req_ids):
            t = self._reqs.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids:
                t.block_ids += single_group(new_ids, req_id)
            computed = cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0)
            if computed > t.prompt_len:
                continue  # decoding on P: the prompt's KV was complete already
            meta.steps.append(
                ComputedStep(
                    t.transfer_id, req_id, tuple(t.block_ids), computed, t.prompt_len
                )
            )
        return meta


def single_group(block_ids: Any, req_id: str) -> list[int]:
    if len(block_ids) != 1:
        raise NotImplementedError(
            f"Layer-wise push supports one KV cache group, request {req_id} has "
            f"{len(block_ids)} (hybrid models are not supported; unset MOONCAKE_LAYERWISE)."
        )
    return list(block_ids[0])
