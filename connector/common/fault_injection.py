# SPDX-License-Identifier: Apache-2.0
"""Fault injection for the project's tests: each fault is armed by one variable (read
once, config.FaultConfig), does nothing unless set, and is never set outside tests.

MOONCAKE_FAULT_ZERO_RECV_BLOCK=K       D: zero the K-th block received from a peer
MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN=N P/C: layer-wise and push writes of N-token prompts fail
                                       (N@R: TP rank R's writes only)
MOONCAKE_FAULT_DELAY_WRITE=N:S         P/C: such writes return S s late, bytes landed
MOONCAKE_FAULT_HOLD_WRITE=N:W:S        P: after W writes of such a transfer, its writer
                                       waits S s (GET /layerwise/transfers shows W)
MOONCAKE_FAULT_FENCE_BLIND=1           P/C: the send-queue fence reads nothing
MOONCAKE_FAULT_KEEP_ASKING_SOURCE=URL  D: failed pushes from URL do not count
"""

from __future__ import annotations

import time

import torch

from vllm.logger import init_logger

from .config import FaultConfig, load

logger = init_logger(__name__)


def zero_received_block(
    kv_caches: dict[str, torch.Tensor], block_ids: list[int], split_k_and_v: bool
) -> None:
    """If the fault is armed, zero one received block of a request in every layer."""
    which = load().faults.zero_recv_block
    if which is None or not block_ids:
        return
    block_id = block_ids[min(which, len(block_ids) - 1)]
    for cache in kv_caches.values():
        if split_k_and_v:
            cache[:, block_id].zero_()
        else:
            cache[block_id].zero_()
    logger.warning(
        "FAULT INJECTION (MOONCAKE_FAULT_ZERO_RECV_BLOCK): zeroed received block %d",
        block_id,
    )


def write_fault(
    faults: FaultConfig, prompt_len: int, writes_done: int = 0, tp_rank: int = 0
) -> str | None:
    """Apply the write faults armed for a ``prompt_len``-token prompt, right before
    the engine call (``writes_done``: this transfer's writes so far). Delays sleep
    here; returns the error to report instead of writing, or None."""
    if (
        faults.hold_write_prompt_len == prompt_len
        and writes_done == faults.hold_write_after
        and faults.hold_write_s > 0
    ):
        logger.warning(
            "FAULT INJECTION (MOONCAKE_FAULT_HOLD_WRITE): holding the writer of a "
            "%d-token prompt after %d writes for %.1f s",
            prompt_len,
            writes_done,
            faults.hold_write_s,
        )
        time.sleep(faults.hold_write_s)
    if faults.delay_write_prompt_len == prompt_len and faults.delay_write_s > 0:
        logger.warning(
            "FAULT INJECTION (MOONCAKE_FAULT_DELAY_WRITE): delaying a write of a "
            "%d-token prompt by %.1f s",
            prompt_len,
            faults.delay_write_s,
        )
        time.sleep(faults.delay_write_s)
    if faults.fail_write_prompt_len == prompt_len and faults.fail_write_rank in (
        None,
        tp_rank,
    ):
        return f"FAULT INJECTION (MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN={prompt_len}): write failed"
    return None
