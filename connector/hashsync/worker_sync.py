# SPDX-License-Identifier: Apache-2.0
"""Block-hash sync, worker process: the mirror of the scheduler's prefix cache.

Applies each step's delta before the forward pass, so an eviction takes effect
before the block's new bytes are written; new blocks become matchable once the
step computing them has completed. Answers which of a prompt's full blocks this
instance holds, hashed exactly as its scheduler does (cache_salt, LoRA included).
A prefix-cache reset empties the mirror before it returns: directly when the
scheduler runs in this process, else by its ``POST /hashsync/reset``.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from .feed_protocol import FeedPage, FeedRequest, ResetNotice, reset_proof
from .hashing import hash_prompt_blocks
from .scheduler_recorder import get_recorder
from .worker_table import BlockHashTable

if TYPE_CHECKING:
    from .scheduler_recorder import HashDelta


class WorkerHashSync:
    """Worker side: the instance's hash -> block table and lookups against it."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.table = BlockHashTable(defer_stores=True)
        # the scheduler in this process (vLLM's "uni" executor) empties the table
        # on a reset directly; from another process it posts /hashsync/reset
        get_recorder().add_reset_listener(self.table.clear)

    def on_metadata(self, delta: HashDelta | None) -> None:
        """Before the forward pass: apply the step's delta."""
        if delta is not None and (len(delta) or delta.hash_config is not None):
            self.table.apply(delta)

    def on_reset_notice(self, notice: ResetNotice) -> tuple[int, str] | None:
        """The scheduler's reset, told over HTTP (``POST /hashsync/reset``): None once
        the table is empty, else (HTTP status, why) the notice is refused."""
        cfg = self.table.hash_config
        if cfg is None:
            # NOTE: no delta has arrived, so no key to check the notice with; the
            # mirror holds nothing, and the first delta carries the reset count
            return 409, "no step has reached this mirror yet: it holds nothing"
        if notice.scheduler_id != cfg.scheduler_id:
            return 409, (
                f"a reset of scheduler {notice.scheduler_id}; this mirror follows "
                f"scheduler {cfg.scheduler_id}"
            )
        if not cfg.reset_key or not hmac.compare_digest(
            notice.proof, reset_proof(cfg.reset_key, cfg.scheduler_id, notice.resets)
        ):
            return 403, (
                "its proof is not this instance's scheduler's: only the scheduler "
                "may reset this mirror"
            )
        # only the next reset: a notice cannot make the mirror drop later deltas
        applied = self.table.clear_next(notice.resets)
        if applied is None:
            return None
        if notice.resets <= applied:
            return 409, f"reset {notice.resets} is applied already (applied: {applied})"
        return 409, (
            f"reset {notice.resets} is not the next one (applied: {applied}); the "
            "next step's delta brings the mirror up to date"
        )

    def close(self) -> None:
        get_recorder().remove_reset_listener(self.table.clear)

    def after_step(self, event: Any = None) -> None:
        """After the forward's launch: the step's blocks are ready once ``event`` is."""
        self.table.seal_pending(event)
        self.table.commit_ready()

    def prompt_hashes(
        self, token_ids: list[int], cache_salt: str | None, lora_name: str | None
    ) -> list:
        cfg = self.table.hash_config
        if cfg is None:
            raise RuntimeError(
                "block-hash sync has not received the scheduler's hash "
                "configuration yet (no step has run); retry"
            )
        return hash_prompt_blocks(
            token_ids,
            self.block_size,
            cfg.hash_algo,
            cfg.none_hash,
            cache_salt=cache_salt,
            lora_name=lora_name,
        )

    def match(
        self,
        token_ids: list[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> tuple[list[int], list[int], int]:
        """(matched block ids, their generations, number of full blocks of the prompt)."""
        hashes = self.prompt_hashes(token_ids, cache_salt, lora_name)
        self.table.commit_ready()  # steps completed since the last after_step
        block_ids, gens = self.table.match_and_snapshot(hashes)
        return block_ids, gens, len(hashes)

    def feed(self, req: FeedRequest) -> FeedPage | None:
        """The page for a peer at ``req``'s position (None: no step has run yet)."""
        self.table.commit_ready()
        return self.table.feed_page(req.epoch, req.since, self.block_size)

    def debug(self, sample: int = 8) -> dict[str, Any]:
        cfg = self.table.hash_config
        return {
            "size": self.table.size(),
            "feed_epoch": self.table.feed_epoch,
            "feed_seq": self.table.feed_position(),
            "pending": self.table.num_pending(),
            "hash_algo": cfg.hash_algo if cfg else None,
            "block_size": self.block_size,
            "sample": self.table.sample(sample),
        }
