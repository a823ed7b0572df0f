# SPDX-License-Identifier: Apache-2.0
"""P's answer to D's pull request with layer-wise push on: a refusal at once when
it cannot be served layer-wise (TP sizes, missing KV layout, limits or KV
fingerprint, several KV cache groups; each kind warned once per interval), else
the layer-wise sender's answers, served in a task of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeXferResponse,
    MooncakeXferResponseStatus,
)
from vllm.logger import init_logger

from ..common.config import ExtConfig
from ..common.fingerprint import KVFingerprint, WarnLimiter, handshake_refusal
from ..vllm_compat import layout_miss_status, layout_omitted, one_group_block_ids
from .prefill_sender import LayerwiseSender

logger = init_logger(__name__)


class PullAnswers:
    """P's answers to D's pull requests, and the tasks serving them."""

    def __init__(self, config: ExtConfig):
        self.config = config
        self._serving: set[asyncio.Task] = set()  # answers in progress
        self._warnings = WarnLimiter(logger)

    async def serve(
        self,
        sender: LayerwiseSender,
        fingerprint: KVFingerprint | None,
        meta: Any,
        tp_size: int,
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        """Answer D's pull request ``meta`` through ``send``."""
        if meta.remote_tp_size != tp_size:
            refusal = (
                f"layer-wise push needs equal TP sizes (prefill {tp_size}, "
                f"decode {meta.remote_tp_size}); unset MOONCAKE_LAYERWISE"
            )
            self._warnings.warn(refusal, "Layer-wise push refused: %s", refusal)
            await send(
                MooncakeXferResponse(
                    status=MooncakeXferResponseStatus.ERROR, err_msg=refusal
                )
            )
            return
        if layout_omitted(meta):
            # Layer-wise writes at the addresses the request carries: ask D for them
            # (upstream's D sends the request again with its layout).
            await send(
                MooncakeXferResponse(
                    status=layout_miss_status(MooncakeXferResponseStatus),
                    err_msg=(
                        "layer-wise push needs the decode instance's KV layout in "
                        "each pull request"
                    ),
                )
            )
            return
        limits = getattr(meta, "ext", None)
        # D must still wait when P may answer, and D's KV cache must be this
        # instance's in all but its number of blocks: P writes its own blocks
        # (block_len bytes at block ids) at D's addresses
        refusal = self.config.layerwise_refusal(limits) or handshake_refusal(
            fingerprint, limits, len(meta.kv_caches_base_addr)
        )
        if refusal is not None:
            self._warnings.warn(refusal, "Layer-wise push refused: %s", refusal)
            await send(
                MooncakeXferResponse(
                    status=MooncakeXferResponseStatus.ERROR, err_msg=refusal
                )
            )
            return
        if limits is None:
            session = f"{meta.remote_hostname}:{meta.remote_port}"[:80]
            self._warnings.warn(
                f"no-limits:{session}",
                "The pull request of decode instance %s "
                "carries no pull timeout (an instance without this series' "
                "hooks): this prefill instance cannot check that it answers "
                "before the decode gives up",
                session,
            )

        async def reply(ok: list[str], errs: dict[str, str], last: bool) -> None:
            status = (
                MooncakeXferResponseStatus.FINISH
                if last
                else MooncakeXferResponseStatus.CONTINUE
            )
            await send(
                MooncakeXferResponse(
                    status=status,
                    ok_reqs=ok or None,
                    err_reqs=list(errs) or None,
                    err_msg="; ".join(sorted(set(errs.values()))) or None,
                )
            )

        # Block ids come as one list, or one list per KV cache group (0.32.0):
        # layer-wise push serves requests of one group and refuses the others.
        req_blocks: dict[str, tuple[str, list[int]]] = {}
        several_groups: dict[str, str] = {}
        for d_req_id, (transfer_id, block_ids) in dict(meta.req_blocks).items():
            ids = one_group_block_ids(block_ids)
            if ids is None:
                several_groups[d_req_id] = (
                    f"layer-wise push serves requests of one KV cache group; this "
                    f"one spans {len(block_ids)}: unset MOONCAKE_LAYERWISE"
                )
            else:
                req_blocks[d_req_id] = (transfer_id, ids)
        if several_groups:
            self._warnings.warn(
                "several-groups",
                "Layer-wise push refused: %s",
                next(iter(several_groups.values())),
            )
            await reply([], several_groups, not req_blocks)
            if not req_blocks:
                return

        # Served as a task of its own: one of upstream's few sender worker tasks
        # must not wait out a transfer (the sender bounds how many may wait).
        task = asyncio.create_task(
            sender.serve(
                f"{meta.remote_hostname}:{meta.remote_port}",
                list(meta.kv_caches_base_addr),
                req_blocks,
                reply,
            )
        )
        self._serving.add(task)
        task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task) -> None:
        self._serving.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            logger.error(
                "Layer-wise: serving a decode instance's request failed: %r", e
            )
