# SPDX-License-Identifier: Apache-2.0
"""What P's scheduler tells its worker each step about layer-wise transfers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# P's kv_transfer_params key that chooses how one request's KV is sent.
MODE_PARAM = "mooncake_mode"


class TransferMode(str, Enum):
    """How P sends one request's KV (both through the layer-wise sender)."""

    LAYERWISE = "layerwise"  # each layer's KV as soon as it is computed
    POSTHOC = "posthoc"  # the whole prompt's KV once its prefill ended


def requested_mode(params: Mapping[str, Any] | None) -> TransferMode | None:
    """The mode a request's kv_transfer_params ask for; None: the instance default.
    ValueError names the accepted values (the caller warns and uses the default)."""
    value = (params or {}).get(MODE_PARAM)
    if value is None:
        return None
    try:
        return TransferMode(value) if isinstance(value, str) else TransferMode(None)
    except ValueError:
        raise ValueError(
            f"kv_transfer_params[{MODE_PARAM!r}]={str(value)[:40]!r} is not one of "
            f"{[m.value for m in TransferMode]}"
        ) from None


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
    # Transfers whose P request was preempted since the last step (its blocks
    # were freed and may be computed into for other requests by this step):
    # fail them before the forward; the request itself goes on and is reported
    # when it finishes.
    preempted: list[str] = field(default_factory=list)
    # Transfers of do_remote_decode requests that entered P's scheduler since the
    # last step: queued here, not yet scheduled. A pull for one waits for its
    # prefill, however long P's queue is, instead of being refused as an id P
    # never received (MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S).
    received: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.steps
            or self.finished
            or self.aborted
            or self.preempted
            or self.received
        )
