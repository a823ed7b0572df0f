# SPDX-License-Identifier: Apache-2.0
"""Read a few bytes of this instance's registered KV blocks (proof of write).

D plants canaries at secret probe positions of the blocks it asks a push source
for, reads them once C answered, and only then sends C the positions; C must answer
its source bytes there (push/decode_receiver.py). Through torch, so CPU and CUDA
alike: on CUDA a write is a copy queued on the current stream, ordered by an event
(gpu_order.py), a read a small device-to-host copy. Verified on CPU only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

PROBE_BYTES = 8  # bytes a probe of a proof of write reads (the push wire's too)

ReadFn = Callable[
    [int, int, int], bytes
]  # (slot, block id, offset) -> PROBE_BYTES bytes


class KVReader:
    def __init__(
        self, slot_tensors: Sequence[torch.Tensor], block_len: int, num_blocks: int
    ):
        self.block_len = block_len
        self.num_blocks = num_blocks
        self._flat = [t.view(torch.uint8).reshape(-1) for t in slot_tensors]
        for t in self._flat:
            if t.numel() < num_blocks * block_len:
                raise ValueError(
                    "a registered KV tensor is smaller than num_blocks * block_len"
                )

    @classmethod
    def for_kv_caches(
        cls,
        kv_caches: dict[str, torch.Tensor],
        split_k_and_v: bool,
        block_len: int,
        num_blocks: int,
    ) -> KVReader:
        tensors, seen = [], set()
        for cache in kv_caches.values():  # the order and de-duplication of registration
            for t in cache if split_k_and_v else [cache]:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    tensors.append(t)
        return cls(tensors, block_len, num_blocks)

    @property
    def tensor(self) -> torch.Tensor:
        """One of the KV tensors: an event recorded on its device's current stream
        completes after the writes queued so far (gpu_order.record_after_compute)."""
        return self._flat[0]

    def _start(self, slot: int, block: int, offset: int) -> int:
        if not (
            0 <= slot < len(self._flat)
            and 0 <= block < self.num_blocks
            and 0 <= offset <= self.block_len - PROBE_BYTES
        ):
            raise ValueError(f"probe ({slot}, {block}, {offset}) outside the KV cache")
        return block * self.block_len + offset

    def read(self, slot: int, block: int, offset: int) -> bytes:
        start = self._start(slot, block, offset)
        return bytes(
            self._flat[slot][start : start + PROBE_BYTES].cpu().numpy().tobytes()
        )

    def write(self, slot: int, block: int, offset: int, data: bytes) -> None:
        start = self._start(slot, block, offset)
        t = self._flat[slot]
        t[start : start + PROBE_BYTES] = torch.frombuffer(
            bytearray(data), dtype=torch.uint8
        ).to(t.device)
