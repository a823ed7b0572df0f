# SPDX-License-Identifier: Apache-2.0
"""The scheduler's prefix-cache hash configuration (stdlib only: block_pool.py
imports it through the recorder)."""

import secrets
from dataclasses import dataclass, field

# this process's scheduler, as peers' holder indexes see it: an instance that
# follows its own feed knows itself by it (push/decode_index.py)
SCHEDULER_ID = secrets.token_hex(8)
# the key of this scheduler process's reset notices (feed_protocol.reset_proof):
# it reaches the worker only in the connector metadata, never a page or an answer
RESET_KEY = secrets.token_hex(32)


class HashConfigMismatchError(RuntimeError):
    """The worker was told two different hash configurations."""


@dataclass(frozen=True, slots=True)
class HashConfig:
    """How the scheduler hashes, and the key of its reset notices."""

    hash_algo: str  # cache_config.prefix_caching_hash_algo
    none_hash: bytes  # kv_cache_utils.NONE_HASH of the scheduler process
    scheduler_id: str = ""  # SCHEDULER_ID of the scheduler process
    # RESET_KEY of the scheduler process ("": its notices are refused)
    reset_key: str = field(default="", repr=False)

    def check_same(self, other: "HashConfig") -> None:
        if self != other:
            raise HashConfigMismatchError(
                "prefix-cache hash configuration changed: "
                f"{self.hash_algo}/{self.none_hash.hex()[:16]}.. vs "
                f"{other.hash_algo}/{other.none_hash.hex()[:16]}.."
            )
