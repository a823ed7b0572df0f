"""Prometheus /metrics of a running vLLM instance: one reader for gauges and histograms.

Used for the KV usage (harness/kv_usage.py) and to read what the engine itself
measured for one request (e.g. TTFT from its arrival in the engine to its first
token) as the difference of a histogram's sum and count around that request.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TypeVar

from harness.pd_client import CLIENT

T = TypeVar("T")


def scrape(url: str, timeout: float = 10.0) -> str:
    """The instance's /metrics text."""
    return CLIENT.get(url + "/metrics", timeout=timeout).text


def samples(text: str, name: str, labels: dict[str, str] | None = None) -> list[float]:
    """The values of metric ``name`` in a /metrics text, one per label set (only
    the label sets holding every ``labels`` pair, if given)."""
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", re.M)
    want = [
        re.compile(rf'(?:\{{|,){re.escape(k)}="{re.escape(v)}"(?:,|\}})')
        for k, v in (labels or {}).items()
    ]
    return [
        float(v) for found, v in pat.findall(text) if all(w.search(found) for w in want)
    ]


def counter(url: str, name: str, timeout: float = 10.0) -> float:
    """Counter ``name`` (e.g. "vllm:external_prefix_cache_hits_total") added over
    its label sets."""
    found = samples(scrape(url, timeout), name)
    if not found:
        raise RuntimeError(f"{name} not in {url}/metrics")
    return sum(found)


# where vLLM says a prompt's tokens came from (vllm:prompt_tokens_by_source_total)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """An instance's prompt tokens so far by source: computed, hit in its local
    prefix cache, taken from the KV connector."""
    text = scrape(url)
    name = "vllm:prompt_tokens_by_source_total"
    return {s: sum(samples(text, name, {"source": s})) for s in PROMPT_SOURCES}


def read_when(
    read: Callable[[], T], done: Callable[[T], bool], timeout: float = 10.0
) -> T:
    """``read()`` once ``done`` holds for its value, or its value at the timeout:
    vLLM updates its counters and histograms just after it answers a request."""
    end = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() > end:
            return value
        time.sleep(0.05)


def counter_when(
    url: str, name: str, done: Callable[[float], bool], timeout: float = 10.0
) -> float:
    """Counter ``name`` once ``done(value)`` holds, or its value at the timeout."""
    return read_when(lambda: counter(url, name), done, timeout)


def histogram(url: str, name: str, timeout: float = 10.0) -> tuple[float, float]:
    """(sum, count) of histogram ``name`` (e.g. "vllm:time_to_first_token_seconds"),
    added over its label sets."""
    text = scrape(url, timeout)
    total = []
    for kind in ("sum", "count"):
        found = samples(text, f"{name}_{kind}")
        if not found:
            raise RuntimeError(f"{name}_{kind} not in {url}/metrics")
        total.append(sum(found))
    return total[0], total[1]
