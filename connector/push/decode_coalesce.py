# SPDX-License-Identifier: Apache-2.0
"""D: requests for one held prefix coalesce onto one push.

:class:`PrefixClaims` names, per source and prompt block (vLLM's chained block
hash: salt, LoRA adapter and every token before it), the request matching or
pushing it. A request whose first block beyond D's own hit is claimed by another
waits (decode_scheduler.py): once that push landed, vLLM caches its blocks and
the waiter gets them as a local hit. The wait ends when the claimant no longer
fetches, or after a bound; then the request goes its own way.
"""

from __future__ import annotations

from typing import Any

from ..hashsync.hashing import hash_prompt_blocks

CLAIMS_KEPT = 1 << 16  # claimed blocks remembered (a bound, not a working size)
# the hashing of the claims' keys: vLLM's chained block hashes, compared only
# with each other on this instance (any algorithm and seed would do)
CLAIM_HASH_ALGO = "sha256"
CLAIM_NONE_HASH = b"mooncake-push-claims"


class PrefixClaims:
    """Which request fetches which block of a prompt. Not thread-safe: the
    scheduler's thread only."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        # (source, block digest) -> request id, and each request's keys
        self._owner: dict[tuple[str, bytes], str] = {}
        self._claimed: dict[str, set[tuple[str, bytes]]] = {}
        self._digests: dict[str, list[bytes]] = {}  # request id -> its prompt's

    def digests(self, request: Any, lora: str | None) -> list[bytes]:
        rid = request.request_id
        found = self._digests.get(rid)
        if found is None:
            found = hash_prompt_blocks(
                request.prompt_token_ids or (),
                self.block_size,
                CLAIM_HASH_ALGO,
                CLAIM_NONE_HASH,
                request.cache_salt,
                lora,
            )
            self._digests[rid] = found
        return found

    def holder(
        self, request: Any, lora: str | None, source: str, first: int
    ) -> str | None:
        """The request that claimed block ``first`` of this prompt from
        ``source``, or None."""
        digests = self.digests(request, lora)
        if first >= len(digests):
            return None
        return self._owner.get((source, digests[first]))

    def claim(
        self, request: Any, lora: str | None, source: str, first: int, n: int
    ) -> None:
        """Blocks ``first`` .. ``first + n - 1`` of this prompt are fetched by it
        from ``source``."""
        rid = request.request_id
        keys = [(source, d) for d in self.digests(request, lora)[first : first + n]]
        if len(self._owner) + len(keys) > CLAIMS_KEPT:
            return  # a bound on memory: past it, requests fetch on their own
        for key in keys:
            self._owner.setdefault(key, rid)
        self._claimed.setdefault(rid, set()).update(keys)

    def drop(self, rid: str) -> None:
        """The request no longer fetches (and is forgotten)."""
        for key in self._claimed.pop(rid, ()):
            if self._owner.get(key) == rid:
                del self._owner[key]
        self._digests.pop(rid, None)

    def claimants(self) -> list[str]:
        return list(self._claimed)
