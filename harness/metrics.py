"""Prometheus /metrics of a running vLLM instance: histogram sums and counts.

Used to read what the engine itself measured for one request (e.g. TTFT from
its arrival in the engine to its first token) as the difference of a
histogram's sum and count around that request.
"""

from __future__ import annotations

import re

import httpx


def histogram(url: str, name: str, timeout: float = 10.0) -> tuple[float, float]:
    """(sum, count) of histogram ``name`` (e.g. "vllm:time_to_first_token_seconds"),
    added over its label sets."""
    text = httpx.get(url + "/metrics", timeout=timeout).text
    total = {"sum": 0.0, "count": 0.0}
    for kind in total:
        pat = re.compile(rf"^{re.escape(name)}_{kind}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", re.M)
        found = pat.findall(text)
        if not found:
            raise RuntimeError(f"{name}_{kind} not in {url}/metrics")
        total[kind] = sum(float(v) for v in found)
    return total["sum"], total["count"]
