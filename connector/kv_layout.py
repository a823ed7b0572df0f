# SPDX-License-Identifier: Apache-2.0
"""Where the block dimension sits in an attention backend's KV cache tensor.

Upstream MooncakeConnector assumes the CUDA layouts: a K or V half shaped
(num_blocks, block_size, num_kv_heads, head_size), or an MLA cache shaped
(num_blocks, block_size, head_size). The CPU attention backend lays a layer out
as (2, num_blocks, num_kv_heads, block_size, head_size), so its halves have the
block size at dim -2 and upstream's registration asserts. Rather than special
casing backends, ask the backend itself: the dimension that changes when the
block size changes is the block dimension.

Verified on: the CPU backend (this project's CI). The CUDA FlashAttention and
MLA layouts give the same index upstream hard-codes (-3 and -2), which the unit
tests check against the backends' own get_kv_cache_shape.
"""

from __future__ import annotations

from typing import Protocol


class _HasKVCacheShape(Protocol):
    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]: ...


def kernel_block_dim(backend: type[_HasKVCacheShape], block_size: int, head_size: int) -> int:
    """Negative index of the block-size dimension in a registered KV tensor.

    Negative, so it is the same for a whole (2, ...) layer tensor and for the
    K and V halves the connector registers separately.
    """
    one = backend.get_kv_cache_shape(1, block_size, 1, head_size)
    two = backend.get_kv_cache_shape(1, 2 * block_size, 1, head_size)
    changed = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
    if len(one) != len(two) or len(changed) != 1:
        raise ValueError(
            f"Cannot locate the block dimension of {getattr(backend, '__name__', backend)}'s "
            f"KV cache: shapes {one} and {two} for block sizes {block_size} and "
            f"{2 * block_size} differ in dims {changed}, expected exactly one."
        )
    return changed[0] - len(one)
