"""KV cache usage of a running instance, from its Prometheus /metrics."""

from __future__ import annotations

import re
import time

import httpx

_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", re.M)


def kv_usage(url: str) -> float:
    """Fraction of the instance's KV blocks held by requests (cached free blocks excluded)."""
    m = _USAGE.search(httpx.get(url + "/metrics", timeout=10).text)
    if not m:
        raise RuntimeError(f"vllm:kv_cache_usage_perc not in {url}/metrics")
    return float(m.group(1))


def wait_no_blocks_in_use(*urls: str, timeout: float = 60, poll: float = 1.0) -> tuple[float, ...]:
    """Poll until no instance holds a block; return the last usages (all 0.0 on success)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = tuple(kv_usage(u) for u in urls)
        if all(u == 0.0 for u in usage) or time.monotonic() > deadline:
            return usage
        time.sleep(poll)
