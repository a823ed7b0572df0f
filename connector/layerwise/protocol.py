# SPDX-License-Identifier: Apache-2.0
"""What P's scheduler tells P's worker each step about layer-wise transfers.

Carried in the connector metadata (scheduler process -> worker processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ComputedStep:
    """This step computes tokens of a layer-wise request."""

    transfer_id: str
    p_req_id: str
    block_ids: tuple[int, ...]  # the request's whole block list as of this step
    computed_tokens: int  # tokens whose KV is final once this step's layers ran
    prompt_len: int


@dataclass(frozen=True)
class FinishedRequest:
    """P's scheduler is done with a request whose blocks it keeps until the
    worker reports it in finished_sending."""

    transfer_id: str
    p_req_id: str
    block_ids: tuple[int, ...]
    prompt_len: int
    # True: the request did not complete its prefill (client gone, ...): the
    # transfer fails; its blocks are released once no write of it can run.
    aborted: bool


@dataclass
class LayerwiseMetadata:
    steps: list[ComputedStep] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    # Transfers whose P request ended holding no blocks: fail them, never report them.
    aborted: list[str] = field(default_factory=list)
    # D side: request ids of cleanup-only pulls (aborted before being scheduled).
    # P is told to free its blocks, but D's scheduler has already forgotten the
    # request and must never hear of it again (vLLM issue #43226).
    cleanup_reqs: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.steps or self.finished or self.aborted or self.cleanup_reqs)
