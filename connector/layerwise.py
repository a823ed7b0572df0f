# SPDX-License-Identifier: Apache-2.0
"""Layer-wise KV push (MOONCAKE_LAYERWISE=1): configuration and scheduler side.

Upstream MooncakeConnector moves a request's KV after its whole prefill, so the
transfer sits on the critical path of the decode instance's first token. With
MOONCAKE_LAYERWISE=1 the prefill instance writes each layer's KV into the decode
instance's blocks as soon as that layer is computed, hiding the transfer behind
the remaining layers (and chunks) of the prefill.

The protocol seen by the decode instance is upstream's: D sends its block ids
and KV base addresses to P's worker over ZMQ (MooncakeXferMetadata) and waits
for a FINISH response. Only P changes: its scheduler tells its worker, every
step, which blocks of which layer-wise transfer the step computes
(LayerwiseMetadata.steps), and its worker pushes them per layer
(layerwise_worker.py) instead of waiting for the request to finish.

Environment (read by both instances; unset means exactly upstream's behaviour):
  MOONCAKE_LAYERWISE=1               enable
  MOONCAKE_LAYERWISE_MIN_TOKENS=N    prompts shorter than N tokens use the
                                     post-hoc path (default 256)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

ENV_ENABLE = "MOONCAKE_LAYERWISE"
ENV_MIN_TOKENS = "MOONCAKE_LAYERWISE_MIN_TOKENS"
DEFAULT_MIN_TOKENS = 256


def layerwise_enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "0").strip().lower() not in ("", "0", "false", "no", "off")


def layerwise_min_tokens() -> int:
    raw = os.environ.get(ENV_MIN_TOKENS, str(DEFAULT_MIN_TOKENS))
    try:
        value = int(raw)
    except ValueError as e:
        raise ValueError(f"{ENV_MIN_TOKENS} must be an integer, got {raw!r}") from e
    if value < 0:
        raise ValueError(f"{ENV_MIN_TOKENS} must be >= 0, got {value}")
    return value


# (transfer_id, p_req_id, block_ids, tokens computed once the step is done, prompt_len)
Step = tuple[str, str, list[int], int, int]


@dataclass
class LayerwiseMetadata:
    """What P's scheduler tells P's worker each step (part of the connector metadata)."""

    # Layer-wise requests this step computes.
    steps: list[Step] = field(default_factory=list)
    # Requests that finished whose blocks the scheduler keeps until the worker
    # reports them finished sending: (transfer_id, p_req_id, block_ids,
    # prompt_len, aborted). aborted: the request did not complete its prefill
    # (client gone, ...): its transfer fails, its blocks are released.
    finished: list[tuple[str, str, list[int], int, bool]] = field(default_factory=list)
    # Transfers whose P request ended holding no blocks: fail them, never report them.
    aborted: list[str] = field(default_factory=list)
    # D side: request ids of cleanup-only pulls (aborted before being scheduled).
    # P is told to free its blocks, but the D scheduler has already forgotten the
    # request and must never hear of it again (vLLM issue #43226).
    cleanup_reqs: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.steps or self.finished or self.aborted or self.cleanup_reqs)


@dataclass
class _Tracked:
    transfer_id: str
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)


class LayerwiseScheduler:
    """Scheduler-side state of P's layer-wise transfers."""

    def __init__(self, min_tokens: int | None = None):
        self.min_tokens = layerwise_min_tokens() if min_tokens is None else min_tokens
        self._reqs: dict[str, _Tracked] = {}
        self._pending = LayerwiseMetadata()

    def track(self, request: Request, transfer_id: str) -> bool:
        """Register a do_remote_decode request; False if it takes the post-hoc path."""
        prompt_len = request.num_prompt_tokens
        if prompt_len < self.min_tokens:
            return False
        self._reqs[request.request_id] = _Tracked(transfer_id, prompt_len)
        return True

    def request_finished(self, request: Request, block_ids: list[int], delay_free: bool,
                         transfer_id: str) -> None:
        """P's request ended. With delay_free the scheduler keeps its blocks until
        the worker reports it in finished_sending (also after an abort, so no
        write in flight reads a re-used block, and so this metadata is delivered:
        the engine keeps stepping while blocks are held)."""
        from vllm.v1.request import RequestStatus

        self._reqs.pop(request.request_id, None)
        aborted = request.status != RequestStatus.FINISHED_LENGTH_CAPPED
        if delay_free:
            self._pending.finished.append((transfer_id, request.request_id, list(block_ids),
                                           request.num_prompt_tokens, aborted))
        else:
            self._pending.aborted.append(transfer_id)

    def cleanup_pull(self, request_id: str) -> None:
        self._pending.cleanup_reqs.add(request_id)

    def build(self, scheduler_output: SchedulerOutput) -> LayerwiseMetadata:
        meta, self._pending = self._pending, LayerwiseMetadata()
        if not self._reqs:
            return meta
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(_single_group(new.block_ids, new.req_id))
            computed = new.num_computed_tokens + num_scheduled.get(new.req_id, 0)
            meta.steps.append((t.transfer_id, new.req_id, list(t.block_ids), computed, t.prompt_len))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._reqs.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = list(_single_group(new_ids, req_id)) if new_ids else []
            elif new_ids:
                t.block_ids += _single_group(new_ids, req_id)
            computed = cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0)
            if computed > t.prompt_len:
                continue  # decoding on P: the prompt's KV was complete already
            meta.steps.append((t.transfer_id, req_id, list(t.block_ids), computed, t.prompt_len))
        return meta


def _single_group(block_ids: Any, req_id: str) -> list[int]:
    if len(block_ids) != 1:
        raise NotImplementedError(
            f"Layer-wise push supports one KV cache group, request {req_id} has "
            f"{len(block_ids)} (hybrid models are not supported; unset {ENV_ENABLE})."
        )
    return list(block_ids[0])
