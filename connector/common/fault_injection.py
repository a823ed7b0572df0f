# SPDX-License-Identifier: Apache-2.0
"""Fault injection for the project's correctness and lifecycle tests.

A correctness check is only worth something if it is seen to fail, and a
"no byte after the end" guarantee only if a late write is provoked. Each fault
is armed by one environment variable (read once, config.FaultConfig) and does
nothing unless it is set. Never set them outside tests.

MOONCAKE_FAULT_ZERO_RECV_BLOCK=K        D: the K-th block of every request whose KV
                                        came from a peer is zeroed (all layers, K and V)
                                        right after the transfer, before it is scheduled
MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN=N  P/C: every layer-wise or /push_blocks write of a
                                        prompt of exactly N tokens fails (as if the engine
                                        had returned -1)
MOONCAKE_FAULT_DELAY_WRITE=N:S          P/C: such writes return S seconds late, bytes
                                        landing at the end (a slow link or peer)
MOONCAKE_FAULT_HOLD_WRITE=N:W:S         P: after W writes of a layer-wise transfer of such
                                        a prompt, its writer waits S seconds before the
                                        next one: the moment a fault test acts (the
                                        transfer's "writes" in GET /layerwise/transfers
                                        reads W while it waits)
MOONCAKE_FAULT_FENCE_BLIND=1            P/C: every writer's send-queue fence reads nothing,
                                        as on a host whose kernel it cannot read (failed
                                        writes are held for the bound)
MOONCAKE_FAULT_KEEP_ASKING_SOURCE=URL   D: failed pushes from this source neither cost nor
                                        count against it (a test of hostile answers asks
                                        one fake source many times)
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
    faults: FaultConfig, prompt_len: int, writes_done: int = 0
) -> str | None:
    """Apply the write faults armed for a prompt of ``prompt_len`` tokens.

    Called by the writing side right before its engine call. A delay sleeps
    here (the write then lands late, as over a slow link); a failure returns
    the error to report instead of writing. None: write normally.
    ``writes_done``: how many writes of this transfer already returned."""
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
    if faults.fail_write_prompt_len == prompt_len:
        return f"FAULT INJECTION (MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN={prompt_len}): write failed"
    return None
