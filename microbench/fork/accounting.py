"""What a fork burst cost each instance: the accounting of microbench.fork.

From counters read before and after a burst: prompt tokens by source per
instance (vLLM's ``prompt_tokens_by_source``), and the bytes the holder wrote to
each destination session (its ``GET /push/stats``). The shared context's KV is
``context_tokens x kv_bytes_per_token``; a destination that received it once
has a ratio of about 1 (a little more: the blocks of the forks' own tails that
happened to be full are never pushed, the context's partial last block is not
either).
"""

from __future__ import annotations

from collections.abc import Mapping

BYTES_PER_DESTINATION_MAX = 1.1  # of the shared context's KV


def grown(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` per key of ``after`` (a key new in ``after`` counts from 0)."""
    return {k: v - before.get(k, 0) for k, v in after.items()}


def burst_accounting(
    tokens_before: Mapping[str, Mapping[str, float]],
    tokens_after: Mapping[str, Mapping[str, float]],
    bytes_before: Mapping[str, float],
    bytes_after: Mapping[str, float],
    *,
    holder: str,
    context_tokens: int,
    kv_bytes_per_token: int,
) -> dict:
    """Per instance (``tokens_*``: name -> source -> tokens) the prompt tokens
    computed, hit in the local cache and taken from the connector during the
    burst; the times the context was computed outside its holder; per
    destination session the bytes written and their ratio to the context's KV."""
    instances = {
        name: grown(tokens_before[name], tokens_after[name]) for name in tokens_after
    }
    away = sum(
        t.get("local_compute", 0) for name, t in instances.items() if name != holder
    )
    context_bytes = context_tokens * kv_bytes_per_token
    written = {d: b for d, b in grown(bytes_before, bytes_after).items() if b > 0}
    ratios = {d: b / context_bytes for d, b in written.items()}
    return {
        "instances": instances,
        "computed_tokens": sum(t.get("local_compute", 0) for t in instances.values()),
        "contexts_computed_away": away / context_tokens if context_tokens else 0.0,
        "context_kv_bytes": context_bytes,
        "bytes_by_destination": written,
        "bytes_ratio_by_destination": ratios,
        "bytes_ratio_max": max(ratios.values(), default=None),
        "bytes_ok": all(r <= BYTES_PER_DESTINATION_MAX for r in ratios.values()),
    }


__all__ = ["BYTES_PER_DESTINATION_MAX", "burst_accounting", "grown"]
