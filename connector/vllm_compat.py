# SPDX-License-Identifier: Apache-2.0
"""The one place where upstream's MooncakeConnector differs between vLLM 0.18.1 and 0.32.0.

Each difference is one function, chosen by what upstream's code has (a parameter, an
attribute), never by a version string; its reason stands next to it. Imported by
``hooks.py``, which upstream's ``mooncake_connector.py`` imports: no vLLM import at
module level.
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


# the scheduler's __init__ takes kv_cache_config from 0.20.0, the worker's requires
# it from 0.25.0
def init_kwargs(upstream_cls: type, kv_cache_config: Any) -> dict[str, Any]:
    """``upstream_cls.__init__``'s ``kv_cache_config`` keyword, where it takes one."""
    if _takes(upstream_cls.__init__, "kv_cache_config"):
        return {"kv_cache_config": kv_cache_config}
    return {}


# a request's block ids: one list (0.18.1), one list per KV cache group (0.32.0)
def _per_group(block_ids: Sequence[Any]) -> bool:
    return bool(block_ids) and isinstance(block_ids[0], (list, tuple))


def one_group_block_ids(block_ids: Sequence[Any]) -> list[int] | None:
    """A request's block ids as one list; None when it spans several KV cache groups
    (this series' features handle one group and leave such a request to upstream)."""
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
    """The registered KV as this series' writers address it: scheduler block ``b`` of
    region ``i`` is ``block_len`` bytes at ``base_addrs[i] + b * block_len``."""

    split_k_and_v: bool  # K and V are separate regions of each layer
    block_len: int  # bytes of one scheduler block in one region
    block_size: int  # tokens per scheduler block
    num_blocks: int


def split_k_and_v(worker: Any) -> bool:
    """Whether K and V of a layer are separate regions (0.18.1 unless MLA)."""
    topo = getattr(worker, "kv_topo", None)
    return bool(topo.split_k_and_v) if topo is not None else False


def kv_geometry(worker: Any) -> KVGeometry:
    """After upstream's ``register_kv_caches``: the worker's KV geometry."""
    # 0.18.1: kv_topo, one block_len and num_blocks; 0.32.0: block_len_per_layer
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


def bootstrap_server(
    vllm_config: VllmConfig, host: str, port: int, server_class: type | None = None
) -> Any:
    """Upstream's bootstrap server, not started, with a bounded ``start()``
    (``server_class``: a subclass of PrefillBootstrapServer)."""
    from .prefill_bootstrap import PrefillBootstrapServer

    cls = server_class or PrefillBootstrapServer
    # MooncakeBootstrapServer(vllm_config, host, port) up to 0.18.1, (host, port) later
    if _takes(cls.__init__, "vllm_config"):
        return cls(vllm_config, host, port)
    return cls(host, port)


def cached_tokens_of_whole_prompt(prompt_len: int) -> int:
    """``num_cached_tokens`` when the connector brings a whole prompt's KV (attention only)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnectorScheduler,
    )

    # 0.32.0 takes a connector's full hit as is; 0.18.1's Mooncake scheduler asks P
    # for N-1 tokens and vLLM recomputes the last one
    if hasattr(MooncakeConnectorScheduler, "_get_remote_prefill_token_count"):
        return prompt_len
    return prompt_len - 1


def send_layout_on_every_pull(worker: Any) -> None:
    """D: the KV layout in every pull request; call after ``register_kv_caches``."""
    # layer-wise push writes at the addresses the request carries, never from P's
    # per-peer layout cache; 0 is upstream's "layout on every pull" (0.33.0), and
    # register_kv_caches sets a new id
    if hasattr(worker, "_kv_layout_id"):
        worker._kv_layout_id = 0


def layout_omitted(meta: Any) -> bool:
    """P: D's pull request names a cached layout instead of carrying it."""
    return bool(getattr(meta, "layout_id", 0)) and not meta.kv_caches_base_addr


def layout_miss_status(status_enum: Any) -> Any:
    """P: ``LAYOUT_MISS`` (D resends with its layout, 0.33.0), else ``ERROR``."""
    return getattr(status_enum, "LAYOUT_MISS", status_enum.ERROR)


def pull_request_blocks(
    block_ids: Sequence[int], block_len: int, num_regions: int
) -> tuple[Any, dict[str, Any]]:
    """D's pull request as the running release's D writes it: ``(req_blocks, per-region
    fields)``. Only for tests that forge D's requests (upstream's D builds the real one)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeXferMetadata,
    )

    # 0.32.0: one list per KV cache group plus block_lens/kv_block_lens; 0.18.1: one list
    if "block_lens" not in MooncakeXferMetadata.__struct_fields__:
        return list(block_ids), {}
    lens = [block_len] * num_regions
    return [list(block_ids)], {"block_lens": lens, "kv_block_lens": list(lens)}
