# SPDX-License-Identifier: Apache-2.0
"""The messages of the prefix-cache feed and of the scheduler's reset notice.

``POST /hashsync/feed``: a peer asks a source which keys its mirror gained or
lost since the peer's position, or (``reset`` page) which it holds now when it
cannot continue from there. ``POST /hashsync/reset``: the scheduler tells its
worker's mirror (in another process) of a prefix-cache reset, proved by
:func:`reset_proof` with a key only the two share. Both are signed; the receiving
side treats everything as untrusted (strict, bounded models).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

FEED_PATH = "/hashsync/feed"
RESET_PATH = "/hashsync/reset"
RESET_CONTEXT = b"mooncake-reset-v1"
FEED_MAX_WAIT_MS = 10_000  # the longest a feed request waits for a change
FEED_PAGE_MAX_EVENTS = 32_768  # keys a page of changes lists at most
FEED_SNAPSHOT_MAX_KEYS = 65_536  # keys a reset page lists at most
FEED_LOG_MAX = 1 << 18  # changes a source keeps for peers that fall behind
# hex of a BlockHashWithGroupId: an 8..64-byte hash and its 4-byte group id
KEY_HEX_MIN, KEY_HEX_MAX = 2 * (8 + 4), 2 * (64 + 4)
# "+<hex>" a key the source began to hold, "-<hex>" one it stopped holding
Event = Annotated[
    StrictStr, Field(min_length=1 + KEY_HEX_MIN, max_length=1 + KEY_HEX_MAX)
]
Token = Annotated[StrictStr, Field(min_length=1, max_length=64)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FeedRequest(_Strict):
    """A peer's position: the source process it followed and its last change."""

    epoch: Token | None = None
    since: Annotated[StrictInt, Field(ge=0, le=2**62)] = 0
    wait_ms: Annotated[StrictInt, Field(ge=0, le=FEED_MAX_WAIT_MS)] = 0


class FeedPage(_Strict):
    """What changed since the peer's position, or (``reset``) the keys held now."""

    epoch: Token  # this source process's
    seq: Annotated[StrictInt, Field(ge=0, le=2**62)]  # the position after this page
    reset: StrictBool  # forget this source's keys, then apply ``events``
    events: Annotated[
        list[Event], Field(max_length=max(FEED_PAGE_MAX_EVENTS, FEED_SNAPSHOT_MAX_KEYS))
    ]
    more: StrictBool  # more changes are waiting: ask again without waiting for one
    hash_algo: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    none_hash: Annotated[StrictStr, Field(min_length=2, max_length=256)]  # hex
    scheduler_id: Annotated[StrictStr, Field(max_length=64)]
    block_size: Annotated[StrictInt, Field(ge=1, le=1 << 16)]


class ResetNotice(_Strict):
    """The scheduler process ``scheduler_id`` reset its prefix cache, for the
    ``resets``-th time; ``proof``: :func:`reset_proof` of both."""

    scheduler_id: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    resets: Annotated[StrictInt, Field(ge=1, le=2**62)]
    proof: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


def reset_proof(key: str, scheduler_id: str, resets: int) -> str:
    """hex HMAC-SHA256(key, "mooncake-reset-v1" LF scheduler id LF resets): only
    the scheduler process (and its worker, told ``key``) can make it."""
    if not key:
        raise ValueError("no reset key: a notice cannot be proved")
    msg = b"\n".join([RESET_CONTEXT, scheduler_id.encode(), str(resets).encode()])
    return hmac.new(key.encode(), msg, hashlib.sha256).hexdigest()


def decode_event(event: str) -> tuple[bool, bytes]:
    """(stored?, key) of one event; ValueError on anything else."""
    sign, hexkey = event[:1], event[1:]
    if sign not in ("+", "-") or len(hexkey) % 2:
        raise ValueError(f"not a feed event: {event[:24]!r}")
    return sign == "+", bytes.fromhex(hexkey)


__all__ = [
    "FEED_LOG_MAX",
    "FEED_MAX_WAIT_MS",
    "FEED_PAGE_MAX_EVENTS",
    "FEED_PATH",
    "FEED_SNAPSHOT_MAX_KEYS",
    "FeedPage",
    "RESET_PATH",
    "ResetNotice",
    "KEY_HEX_MAX",
    "FeedRequest",
    "decode_event",
    "reset_proof",
]
