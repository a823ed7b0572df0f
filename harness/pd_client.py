"""A small client for the disaggregated prefill -> decode flow over MooncakeConnector.

The flow is upstream's (examples/online_serving/disaggregated_serving/
mooncake_connector): the prefill instance P gets the prompt with
``{"do_remote_decode": true, "transfer_id": X}`` and ``max_tokens=1``; the
decode instance D gets it with ``{"do_remote_prefill": true,
"remote_bootstrap_addr": P's bootstrap server, "remote_engine_id": P's engine,
"transfer_id": X}``; both are sent at once. D pulls the KV from P through the
bootstrap server, ZMQ and the transfer engine, then decodes.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

DEFAULT_TIMEOUT_S = 600.0
# One client for every call of the harness: httpx.get()/post() build a client, TLS
# context included, per call (~45 ms on a 2-core machine, more than most calls to a
# local instance take). Kept connections expire after 2 s idle, before the servers'
# own idle close (uvicorn's 5 s), so a close lost while a link was cut is never
# taken for a live connection.
CLIENT = httpx.Client(limits=httpx.Limits(keepalive_expiry=2.0))


class RequestFailed(RuntimeError):
    pass


def bootstrap_headers(
    method: str = "GET", path: str = "", body: bytes = b""
) -> dict[str, str]:
    """Headers for our endpoints on a bootstrap server, with the token the instances
    were started with (MOONCAKE_BOOTSTRAP_TOKEN; set by the launcher for clusters off
    loopback or given a token): the GET routes (/hashsync, /push/stats,
    /layerwise/transfers) take the read key derived from it as a bearer token; the
    POST routes (/match_blocks, /push_blocks) a signature of the request (``method``,
    ``path``, ``body``; connector/common/auth.py), never the token itself."""
    token = os.environ.get("MOONCAKE_BOOTSTRAP_TOKEN")
    if not token:
        return {}
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
        read_key,
        sign,
    )

    if method.upper() == "GET":
        return {"authorization": f"Bearer {read_key(token)}"}
    return {"authorization": sign(token, method, path, body)}


def post_bootstrap(
    bootstrap_url: str, path: str, raw: bytes, timeout: float = 30.0
) -> httpx.Response:
    """POST ``raw`` (JSON, or a test's malformed body) to one of our routes on a
    bootstrap server, signed as D signs when the instances have a token
    (bootstrap_headers); the answer as it came."""
    return CLIENT.post(
        bootstrap_url + path,
        content=raw,
        timeout=timeout,
        headers={
            "content-type": "application/json",
            **bootstrap_headers("POST", path, raw),
        },
    )


def _post(url: str, body: dict, timeout: float, headers: dict | None = None) -> dict:
    try:
        r = CLIENT.post(url, json=body, timeout=timeout, headers=headers)
    except httpx.HTTPError as e:
        raise RequestFailed(f"POST {url} failed: {e!r}") from e
    if r.status_code != 200:
        raise RequestFailed(f"POST {url} returned {r.status_code}: {r.text[:500]}")
    return r.json()


def model_name(base_url: str, timeout: float = 30.0) -> str:
    r = CLIENT.get(base_url + "/v1/models", timeout=timeout)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def engine_id(bootstrap_url: str, timeout: float = 30.0) -> str:
    """The engine id of the prefill instance, from its Mooncake bootstrap server."""
    r = CLIENT.get(bootstrap_url + "/query", timeout=timeout)
    r.raise_for_status()
    entries = r.json()
    if not entries:
        raise RequestFailed(f"{bootstrap_url}/query: no worker registered yet")
    return next(iter(entries.values()))["engine_id"]


@dataclass
class Completion:
    """What one /v1/completions call returned, reduced to what the checks use."""

    token_ids: list[int]
    logprobs: list[dict[str, float]]  # per generated token: top-k token -> logprob
    token_logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int | None
    kv_transfer_params: dict | None
    latency_s: float
    raw: dict = field(repr=False, default_factory=dict)


def complete(
    base_url: str,
    prompt: list[int] | str,
    *,
    max_tokens: int = 8,
    logprobs: int | None = 5,
    kv_transfer_params: dict | None = None,
    cache_salt: str | None = None,
    model: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    temperature: float = 0.0,
) -> Completion:
    body: dict[str, Any] = {
        "model": model or model_name(base_url),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    t0 = time.perf_counter()
    out = _post(base_url + "/v1/completions", body, timeout)
    latency = time.perf_counter() - t0
    choice = out["choices"][0]
    lp = choice.get("logprobs") or {}
    usage = out.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        token_ids=list(choice.get("token_ids") or []),
        logprobs=list(lp.get("top_logprobs") or []),
        token_logprobs=list(lp.get("token_logprobs") or []),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=details.get("cached_tokens"),
        kv_transfer_params=out.get("kv_transfer_params"),
        latency_s=latency,
        raw=out,
    )


def tokenize_chat(
    base_url: str,
    messages: list[dict],
    *,
    model: str,
    add_generation_prompt: bool = True,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[int]:
    """The token ids the server makes of ``messages`` with its chat template, as
    its /v1/chat/completions would prefill them (POST /tokenize)."""
    out = _post(
        base_url + "/tokenize",
        {
            "model": model,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        },
        timeout,
    )
    return [int(t) for t in out["tokens"]]


@dataclass
class PDResult:
    prefill: Completion
    decode: Completion
    transfer_id: str
    total_s: float
    # time.monotonic() when both requests were sent: the clock of the
    # connector's timelines (/layerwise/transfers) on the same host
    started_monotonic: float = 0.0


def pd_params(
    p_bootstrap_url: str,
    p_engine_id: str,
    transfer_id: str,
    extra_prefill_params: dict | None = None,
    extra_decode_params: dict | None = None,
) -> tuple[dict, dict]:
    """P's and D's kv_transfer_params for one P/D request, as upstream's proxy
    sends them."""
    return (
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
            **(extra_prefill_params or {}),
        },
        {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": p_bootstrap_url,
            "remote_engine_id": p_engine_id,
            "transfer_id": transfer_id,
            **(extra_decode_params or {}),
        },
    )


def pd_generate(
    p_url: str,
    p_bootstrap_url: str,
    d_url: str,
    prompt: list[int] | str,
    *,
    max_tokens: int = 8,
    logprobs: int | None = 5,
    transfer_id: str | None = None,
    extra_decode_params: dict | None = None,
    extra_prefill_params: dict | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    temperature: float = 0.0,
) -> PDResult:
    """Prefill on P and decode on D, both requests sent at once (as upstream's proxy).

    ``extra_prefill_params`` go into P's kv_transfer_params, e.g.
    ``{"mooncake_mode": "posthoc"}`` to choose how P sends this request's KV."""
    p_params, d_params = pd_params(
        p_bootstrap_url,
        engine_id(p_bootstrap_url),
        transfer_id or f"xfer-{uuid.uuid4().hex}",
        extra_prefill_params,
        extra_decode_params,
    )
    transfer_id = p_params["transfer_id"]
    p_model, d_model = model_name(p_url), model_name(d_url)
    t0, started = time.perf_counter(), time.monotonic()
    with cf.ThreadPoolExecutor(2) as pool:
        fp = pool.submit(
            complete,
            p_url,
            prompt,
            max_tokens=1,
            logprobs=None,
            kv_transfer_params=p_params,
            model=p_model,
            timeout=timeout,
            temperature=temperature,
        )
        fd = pool.submit(
            complete,
            d_url,
            prompt,
            max_tokens=max_tokens,
            logprobs=logprobs,
            kv_transfer_params=d_params,
            model=d_model,
            timeout=timeout,
            temperature=temperature,
        )
        prefill, decode = fp.result(), fd.result()
    return PDResult(prefill, decode, transfer_id, time.perf_counter() - t0, started)


def forwarded_match_claiming_every_block(
    bootstrap_url: str, raw: bytes, authorization: str | None, block: int
) -> dict:
    """A test's push source: D's /match_blocks body forwarded to C as D sent it
    (D's authorization is valid at C too); C's answer, claiming every full block
    of the prompt (``block`` tokens each)."""
    r = CLIENT.post(
        bootstrap_url + "/match_blocks",
        content=raw,
        timeout=30,
        headers={
            "content-type": "application/json",
            **({"authorization": authorization} if authorization else {}),
        },
    )
    if r.status_code != 200:
        raise RequestFailed(f"C refused the forwarded /match_blocks: {r.text[:500]}")
    out = r.json()
    full = out["total_full_blocks"]
    return {**out, "matched_blocks": full, "matched_tokens": full * block}


def match_blocks(
    bootstrap_url: str,
    token_ids: list[int],
    cache_salt: str | None = None,
    timeout: float = 30.0,
) -> dict:
    """An instance's POST /match_blocks: how many leading full blocks of the prompt it holds."""
    url = bootstrap_url + "/match_blocks"
    body = json.dumps({"token_ids": token_ids, "cache_salt": cache_salt}).encode()
    try:
        r = post_bootstrap(bootstrap_url, "/match_blocks", body, timeout)
    except httpx.HTTPError as e:
        raise RequestFailed(f"POST {url} failed: {e!r}") from e
    if r.status_code != 200:
        raise RequestFailed(f"POST {url} returned {r.status_code}: {r.text[:500]}")
    return r.json()


def wait_for_matched_blocks(
    bootstrap_url: str,
    token_ids: list[int],
    at_least: int,
    cache_salt: str | None = None,
    timeout: float = 30.0,
) -> dict:
    """Poll /match_blocks until at least ``at_least`` blocks match or ``timeout`` passes;
    return the last answer. Blocks become matchable once the step that computed them
    has ended, a moment after the request's response."""
    deadline = time.monotonic() + timeout
    while True:
        m = match_blocks(bootstrap_url, token_ids, cache_salt)
        if m["matched_blocks"] >= at_least or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def layerwise_transfers(bootstrap_url: str, timeout: float = 30.0) -> dict:
    """P's layer-wise totals and timelines (GET /layerwise/transfers on its
    bootstrap server: ``totals``, ``transfers``), with the cluster's token; an
    answer other than 2xx raises httpx.HTTPStatusError."""
    r = CLIENT.get(
        bootstrap_url + "/layerwise/transfers",
        timeout=timeout,
        headers=bootstrap_headers(),
    )
    r.raise_for_status()
    return r.json()


def layerwise_transfer(bootstrap_url: str, transfer_id: str) -> dict:
    """P's timeline of one transfer (layerwise_transfers); AssertionError unless
    P reports it exactly once."""
    got = layerwise_transfers(bootstrap_url)["transfers"]
    mine = [t for t in got if t["transfer_id"] == transfer_id]
    assert len(mine) == 1, f"P reports {len(mine)} transfers {transfer_id!r}: {got}"
    return mine[0]


def push_stats(bootstrap_url: str, timeout: float = 30.0) -> dict:
    """A push source's counters (GET /push/stats on its bootstrap server: pushes,
    ok, failed, bytes, write seconds, ...), with the cluster's token."""
    url = bootstrap_url + "/push/stats"
    r = CLIENT.get(url, timeout=timeout, headers=bootstrap_headers())
    if r.status_code != 200:
        raise RequestFailed(f"GET {url} returned {r.status_code}: {r.text[:500]}")
    return r.json()


PUSH_DECISIONS = "vllm_mooncake_ext_push_decisions_total"


def push_decisions(bootstrap_url: str, timeout: float = 30.0) -> dict[str, float]:
    """A push destination's decisions by reason (its bootstrap server's GET
    /metrics, with the cluster's token): each reason vLLM's connector counts
    (decode_cost.Decision) must appear exactly once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_cost import (
        Decision,
    )

    url = bootstrap_url + "/metrics"
    r = CLIENT.get(url, timeout=timeout, headers=bootstrap_headers())
    if r.status_code != 200:
        raise RequestFailed(f"GET {url} returned {r.status_code}: {r.text[:300]}")
    found = {}
    for d in Decision:
        values = re.findall(
            rf'^{PUSH_DECISIONS}{{reason="{d.value}"}} (\S+)$', r.text, re.M
        )
        if len(values) != 1:
            raise RequestFailed(
                f"GET {url}: {len(values)} samples of {PUSH_DECISIONS} for reason "
                f"{d.value!r} (one expected): is the patch series applied?"
            )
        found[d.value] = float(values[0])
    return found
