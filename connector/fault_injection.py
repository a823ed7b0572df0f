# SPDX-License-Identifier: Apache-2.0
"""Fault injection for the project's correctness tests.

A correctness check is only worth something if it is seen to fail. With
VMP_FAULT_ZERO_RECV_BLOCK=K set on the decode instance, the K-th block of every
request whose KV was received from a peer is zeroed (all layers, K and V) right
after the transfer completes and before the request is scheduled, so the
decode instance computes on wrong KV. Unset (the default), nothing happens.
Never set it outside tests.
"""

from __future__ import annotations

import os

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

ENV_ZERO_RECV_BLOCK = "VMP_FAULT_ZERO_RECV_BLOCK"


def zero_received_block(
    kv_caches: dict[str, torch.Tensor], block_ids: list[int], split_k_and_v: bool
) -> None:
    """If the fault is armed, zero one received block of a request in every layer."""
    which = os.environ.get(ENV_ZERO_RECV_BLOCK)
    if not which or not block_ids:
        return
    block_id = block_ids[min(int(which), len(block_ids) - 1)]
    for cache in kv_caches.values():
        if split_k_and_v:
            cache[:, block_id].zero_()
        else:
            cache[block_id].zero_()
    logger.warning("FAULT INJECTION (%s): zeroed received block %d", ENV_ZERO_RECV_BLOCK, block_id)


ENV_FAIL_WRITE_PROMPT_LEN = "VMP_FAULT_FAIL_WRITE_PROMPT_LEN"


def write_fault_armed() -> bool:
    return bool(os.environ.get(ENV_FAIL_WRITE_PROMPT_LEN))


def write_fault(prompt_len: int) -> str | None:
    """With VMP_FAULT_FAIL_WRITE_PROMPT_LEN=N on the sending instance, every
    layer-wise write and every /push_blocks write of a prompt of exactly N
    tokens fails as if the transfer engine had returned -1 (tests of the
    write-failure paths).
    Returns the error to report, or None when the fault is not armed for it."""
    which = os.environ.get(ENV_FAIL_WRITE_PROMPT_LEN)
    if not which or int(which) != prompt_len:
        return None
    return f"FAULT INJECTION ({ENV_FAIL_WRITE_PROMPT_LEN}={which}): write failed"
