# SPDX-License-Identifier: Apache-2.0
"""Turn (source block, destination block) pairs into transfer-engine entries: one
per KV tensor and run of blocks consecutive on both sides (the TCP transport queues
each entry; transport_env.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def contiguous_runs(
    src: Sequence[int], dst: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both block lists are consecutive."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    if not len(src):
        return []
    s, d = np.asarray(src), np.asarray(dst)
    brk = np.where((np.diff(s) != 1) | (np.diff(d) != 1))[0] + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [len(s)]))
    return [(int(s[a]), int(d[a]), int(b - a)) for a, b in zip(starts, ends)]


def block_entries(
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    block_len: int,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:
    """(src addrs, dst addrs, lengths) copying the blocks in every KV tensor."""
    if len(src_bases) != len(dst_bases):
        raise ValueError(
            f"{len(src_bases)} source KV tensors for {len(dst_bases)} destination"
        )
    runs = contiguous_runs(src_blocks, dst_blocks)
    src, dst, lens = [], [], []
    for sb, db in zip(src_bases, dst_bases):
        for s, d, n in runs:
            src.append(sb + s * block_len)
            dst.append(db + d * block_len)
            lens.append(n * block_len)
    return src, dst, lens
