# SPDX-License-Identifier: Apache-2.0
"""Where upstream's MooncakeConnector differs between the vLLM releases we run on.

The same overlay serves the pinned series (vLLM 0.18.1, ``patches/``) and its roll
onto 0.32.0 (``rolls/0.32.0/``). Each difference the subclasses meet is one
function here, chosen by what upstream's code has (a parameter, an attribute),
never by a version string, so a release in between gets what its own code has:

- the connector's halves take ``kv_cache_config`` (the scheduler's from 0.20.0,
  the worker's as a required argument from 0.25.0): :func:`init_kwargs`;
- a request's block ids come as one list per KV cache group (0.32.0) instead of
  one list (0.18.1): :func:`one_group_block_ids`, :func:`all_block_ids`;
- the worker's registered KV: ``kv_topo.split_k_and_v``, ``block_len`` and
  ``num_blocks`` (0.18.1) became ``block_len_per_layer`` over block-major regions,
  with kernel blocks that may be smaller than the scheduler's (0.32.0):
  :func:`kv_geometry`, :func:`split_k_and_v`;
- ``MooncakeBootstrapServer(vllm_config, host, port)`` became
  ``MooncakeBootstrapServer(host, port)``: :func:`bootstrap_server`;
- D's pull request may leave out D's KV layout once P has cached it under a
  ``layout_id`` (0.33.0): :func:`send_layout_on_every_pull`,
  :func:`layout_omitted`, :func:`layout_miss_status`.
- D's pull request carries one list of block ids per KV cache group and each
  region's block length (0.32.0): :func:`pull_request_blocks`, for the tests that
  forge D's requests.

Imported by ``hooks.py``, which upstream's ``mooncake_connector.py`` imports: no
vLLM import at module level.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def _takes(func: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def init_kwargs(upstream_cls: type, kv_cache_config: Any) -> dict[str, Any]:
    """What a subclass passes to ``upstream_cls.__init__`` after
    ``(vllm_config, engine_id)``: ``kv_cache_config`` where upstream's takes it."""
    if _takes(upstream_cls.__init__, "kv_cache_config"):
        return {"kv_cache_config": kv_cache_config}
    return {}


def _per_group(block_ids: Sequence[Any]) -> bool:
    return bool(block_ids) and isinstance(block_ids[0], (list, tuple))


def one_group_block_ids(block_ids: Sequence[Any]) -> list[int] | None:
    """A request's block ids as one list, from a list or from one list per KV cache
    group. None when the request spans several groups: this series' features
    handle one group, and leave such a request to upstream."""
    if not _per_group(block_ids):
        return list(block_ids)
    if len(block_ids) != 1:
        return None
    return list(block_ids[0])


def all_block_ids(block_ids: Sequence[Any]) -> list[int]:
    """Every block id of a request, from a list or from one list per group."""
    if not _per_group(block_ids):
        return list(block_ids)
    return [b for group in block_ids for b in group]


@dataclass(frozen=True)
class KVGeometry:
    """The registered KV as this series' writers address it: block ``b`` of region
    ``i`` is ``block_len`` bytes at ``base_addrs[i] + b * block_len``, ``b`` being the
    scheduler's block id."""

    split_k_and_v: bool  # K and V are separate regions of each layer
    block_len: int  # bytes of one scheduler block in one region
    block_size: int  # tokens per scheduler block
    num_blocks: int


def split_k_and_v(worker: Any) -> bool:
    """Whether the worker registered K and V of a layer as separate regions (0.18.1,
    unless MLA); newer releases register each layer's tensor, block-major."""
    topo = getattr(worker, "kv_topo", None)
    return bool(topo.split_k_and_v) if topo is not None else False


def kv_geometry(worker: Any) -> KVGeometry:
    """After upstream's ``register_kv_caches``: the worker's KV geometry."""
    if hasattr(worker, "kv_topo"):  # one block length for every region
        return KVGeometry(
            split_k_and_v(worker),
            worker.block_len,
            worker.block_size,
            worker.num_blocks,
        )
    # One block length per registered region (one region per layer, or per head
    # for layouts whose block is not contiguous), each block-major. A scheduler
    # block is `ratio` consecutive kernel blocks (upstream's
    # _logical_to_kernel_block_ids), so in scheduler blocks a region is still
    # base + b * block_len.
    lens = set(worker.block_len_per_layer)
    if len(lens) != 1:
        raise RuntimeError(
            "this series' MooncakeConnector needs one block length for every "
            f"registered KV region; upstream registered {sorted(lens)} bytes "
            "(a model whose layers differ in KV size is not supported)"
        )
    ratio = getattr(worker, "_physical_blocks_per_logical_kv_block", 1)
    return KVGeometry(
        split_k_and_v=split_k_and_v(worker),
        block_len=lens.pop() * ratio,
        block_size=worker.block_size * ratio,
        num_blocks=worker.kv_cache_config.num_blocks,
    )


def bootstrap_server(vllm_config: VllmConfig, host: str, port: int) -> Any:
    """Upstream's bootstrap server, not yet started, whose ``start()`` has a deadline
    (prefill_bootstrap.PrefillBootstrapServer)."""
    from .prefill_bootstrap import PrefillBootstrapServer

    if _takes(PrefillBootstrapServer.__init__, "vllm_config"):
        return PrefillBootstrapServer(vllm_config, host, port)
    return PrefillBootstrapServer(host, port)


def cached_tokens_of_whole_prompt(prompt_len: int) -> int:
    """A request's cached tokens (``num_cached_tokens``) when the connector brings the
    KV of its whole ``prompt_len``-token prompt, by P's pull or by a prefix push, for
    attention-only models: all but the last up to 0.18.1 (its Mooncake scheduler asks
    P for N-1 tokens and vLLM's scheduler recomputes the last one of a full hit); all
    of them where upstream's Mooncake scheduler has ``_get_remote_prefill_token_count``
    (0.32.0, whose scheduler takes a full hit from a connector as it is)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnectorScheduler,
    )

    if hasattr(MooncakeConnectorScheduler, "_get_remote_prefill_token_count"):
        return prompt_len
    return prompt_len - 1


def send_layout_on_every_pull(worker: Any) -> None:
    """D: put the KV layout (base addresses, block lengths) in every pull request.
    Layer-wise push writes at the addresses of the request itself; P does not look
    them up in upstream's per-peer layout cache. Where upstream's D may leave the
    layout out (``_kv_layout_id``, 0.33.0), 0 is its own "layout on every pull"
    value; call after ``register_kv_caches``, which sets a new id."""
    if hasattr(worker, "_kv_layout_id"):
        worker._kv_layout_id = 0


def layout_omitted(meta: Any) -> bool:
    """P: D's pull request names a cached layout instead of carrying it."""
    return bool(getattr(meta, "layout_id", 0)) and not meta.kv_caches_base_addr


def layout_miss_status(status_enum: Any) -> Any:
    """P: the answer that makes upstream's D send the request again with its layout
    (``LAYOUT_MISS``, 0.33.0); ``ERROR`` where there is none (no such D exists)."""
    return getattr(status_enum, "LAYOUT_MISS", status_enum.ERROR)


def pull_request_blocks(
    block_ids: Sequence[int], block_len: int, num_regions: int
) -> tuple[Any, dict[str, Any]]:
    """D's pull request (upstream's ``MooncakeXferMetadata``) for one request's
    ``block_ids`` over ``num_regions`` registered regions of ``block_len`` bytes per
    block, as the running release's D writes it: the request's ``req_blocks`` block
    ids, and the message's per-region fields. One list per KV cache group plus
    ``block_lens``/``kv_block_lens`` where the message has them (0.32.0); one list
    and no such fields before. The connector never builds this message (upstream's
    D does); tests that forge D's requests do."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeXferMetadata,
    )

    if "block_lens" not in MooncakeXferMetadata.__struct_fields__:
        return list(block_ids), {}
    lens = [block_len] * num_regions
    return [list(block_ids)], {"block_lens": lens, "kv_block_lens": list(lens)}
