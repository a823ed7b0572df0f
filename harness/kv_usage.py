"""KV cache usage of a running instance, from its Prometheus /metrics."""

from __future__ import annotations

import time

from harness.metrics import samples, scrape

USAGE = "vllm:kv_cache_usage_perc"


def kv_usage(url: str) -> float:
    """Fraction of the instance's KV blocks held by requests (cached free blocks excluded)."""
    found = samples(scrape(url), USAGE)
    if not found:
        raise RuntimeError(f"{USAGE} not in {url}/metrics")
    return found[0]


def wait_no_blocks_in_use(
    *urls: str, timeout: float = 60, poll: float = 1.0
) -> tuple[float, ...]:
    """Poll until no instance holds a block; return the last usages (all 0.0 on success)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = tuple(kv_usage(u) for u in urls)
        if all(u == 0.0 for u in usage) or time.monotonic() > deadline:
            return usage
        time.sleep(poll)
