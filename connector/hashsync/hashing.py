# SPDX-License-Identifier: Apache-2.0
"""Hash a prompt's full blocks exactly as the scheduler's prefix cache does.

The chain starts from the scheduler process's ``NONE_HASH`` (random per process
unless PYTHONHASHSEED is set), passed in via :class:`HashConfig`: this module
never reads the worker's global.
"""

from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import cast

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    hash_block_tokens,
    make_block_hash_with_group_id,
)
from vllm.v1.request import Request

from .hash_config import RESET_KEY, SCHEDULER_ID, HashConfig, HashConfigMismatchError

__all__ = [
    "BlockHash",
    "BlockHashWithGroupId",
    "HashConfig",
    "HashConfigMismatchError",
    "from_pool_key",
    "hash_prompt_blocks",
    "iter_prompt_block_hashes",
    "scheduler_hash_config",
    "to_pool_key",
]


def scheduler_hash_config(hash_algo: str) -> HashConfig:
    """Read this (scheduler) process's ``NONE_HASH``. Call lazily: ``EngineCore``
    runs ``init_none_hash`` only after it has built the connector."""
    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if not none_hash:
        raise RuntimeError(
            "kv_cache_utils.NONE_HASH is not initialised in this process "
            "(init_none_hash has not run yet)"
        )
    get_hash_fn_by_name(hash_algo)  # raise early on an unknown name
    return HashConfig(
        hash_algo=hash_algo,
        none_hash=bytes(none_hash),
        scheduler_id=SCHEDULER_ID,
        reset_key=RESET_KEY,
    )


def to_pool_key(block_hash: BlockHash, group_id: int = 0) -> BlockHashWithGroupId:
    """The key ``BlockPool.cached_block_hash_to_block`` uses for this block."""
    return make_block_hash_with_group_id(block_hash, group_id)


def from_pool_key(key: BlockHashWithGroupId) -> tuple[BlockHash, int]:
    """Split a block-pool key into (block hash, KV cache group id)."""
    return get_block_hash(key), get_group_id(key)


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    hash_algo: str,
    none_hash: bytes,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids``: a text-only request's
    ``Request.block_hashes`` in the scheduler whose ``NONE_HASH`` is ``none_hash``."""
    return list(
        iter_prompt_block_hashes(
            token_ids, block_size, hash_algo, none_hash, cache_salt, lora_name
        )
    )


def iter_prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    hash_algo: str,
    none_hash: bytes,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> Iterator[BlockHash]:
    """:func:`hash_prompt_blocks` one block at a time (lazily)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not none_hash:
        # hash_block_tokens falls back to the global NONE_HASH on a falsy parent.
        raise ValueError("none_hash must be non-empty bytes")
    hash_fn = get_hash_fn_by_name(hash_algo)
    # generate_block_hash_extra_keys reads only these attributes of a Request.
    key_source = cast(
        Request,
        SimpleNamespace(
            mm_features=None,
            prompt_embeds=None,
            cache_salt=cache_salt,
            # 0.32.0 keys a LoRA block by adapter name and path; only the name is
            # known here, so such a hash matches no block of a real adapter there
            lora_request=(
                SimpleNamespace(lora_name=lora_name, lora_path=None)
                if lora_name is not None
                else None
            ),
        ),
    )
    parent = BlockHash(bytes(none_hash))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra_keys, _ = generate_block_hash_extra_keys(key_source, start, end, 0)
        parent = hash_block_tokens(hash_fn, parent, token_ids[start:end], extra_keys)
        yield parent
