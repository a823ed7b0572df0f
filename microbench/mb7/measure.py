"""One mb7 measurement on a running P/D pair, and the floor's transfer term.

Per transfer arm (layerwise, posthoc), on a fresh prompt of kv_tokens + 1 tokens:

  1. P -> D: P prefills with {"do_remote_decode", "mooncake_mode": arm}; D
     decodes one token from P's KV (both requests sent at once). The tail is
     taken on the engines' clock (where_the_tail_goes): D's first
     token (D's scheduler) - P's last layer (P's worker), both
     time.monotonic() on one host; the client's figure, D's response - P's
     response, is kept as client_tail_s (it moves with P's HTTP response).
  2. Local hit on D: the same prompt again on D alone. D's prefix cache now
     holds all but the last token (the KV just received, block-aligned since
     the prompt is kv_tokens + 1 long), so this is D's TTFT when the KV is
     already there: the floor's first term. Taken as D's engine measured it
     (vllm:time_to_first_token_seconds, from the request's arrival in the
     engine to its first token, read as the histogram's change around this
     one request): the client's latency of this request also holds the HTTP
     intake of the prompt, which the tail does not pay (D's request was
     already admitted, waiting for KV), and came out above the layer-wise
     tail. The engine's figure leaves out the response's way back too, which
     the tail does pay: the floor is a little strict, never generous.
  3. Reference on P: the same prompt on P, answered from P's own prefix cache
     (the KV P computed, never transferred). D's token and top-5 logprobs of
     step 1 must equal it (harness.correctness), and D's cached tokens must
     be kv_tokens.

floor = local-hit TTFT + one layer's bytes / the engine's bandwidth (one
layer's write measured with the same entry layout as a layer-wise write).
The local hit is measured from a client, so it includes an HTTP round trip
that the tail does not (D's request was already waiting): the floor is a
little generous, never tight.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from harness.correctness import compare
from harness.launcher import BLOCK
from harness.metrics import histogram
from harness.pd_client import (
    RequestFailed,
    complete,
    layerwise_transfers,
    pd_generate,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.decode_timeline import (
    TIMELINE_PARAM,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

from .plan import LAYERWISE, PREFILL_ONLY, Step

TTFT = "vllm:time_to_first_token_seconds"


@dataclass
class Sample:
    load: int
    kv_tokens: int
    rep: int
    arm: str
    error: str | None = None
    p_latency_s: float | None = None  # P's response (prefill-only: P alone)
    total_s: float | None = None  # P -> D: D's response after both were sent
    # D's first token - P's last layer, engines' clock (where_the_tail_goes below)
    tail_s: float | None = None
    client_tail_s: float | None = None  # total - P's response, at the client
    # D's pull timeline from D's response (kv_transfer_params, decode_timeline.py)
    d_timeline: dict | None = None
    local_hit_s: float | None = (
        None  # D's engine TTFT for the same prompt, prefix cached
    )
    local_hit_client_s: float | None = None  # the same request's latency at the client
    local_hit_cached: int | None = None
    transfer_id: str | None = None
    started_monotonic: float | None = None  # both requests sent (time.monotonic())
    # P's per-layer hook, its engine thread's own CPU time during this request
    # (layer-wise arm; /layerwise/transfers totals before and after)
    layer_hook_cpu_s: float | None = None
    layer_issue_cpu_s: float | None = None  # P's issuer thread, the same way
    # P's forward thread's CPU time across P's request (every arm): P's compute
    # cost on a clock no other process can advance (the paired P slowdown)
    p_forward_cpu_s: float | None = None
    correct: bool | None = None
    cached_tokens: int | None = None
    max_logprob_diff: float | None = None
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def transfer_timelines(p_bootstrap_url: str) -> dict[str, dict]:
    """transfer id -> P's timeline of it (time.monotonic() of P's worker, the same
    clock as this process's on one host; connector/layerwise/prefill_sender.py TransferStats)."""
    got = layerwise_transfers(p_bootstrap_url)
    return {t["transfer_id"]: t for t in got["transfers"]}


def where_the_tail_goes(sample: dict, t: dict | None) -> dict:
    """The tail on the engines' clock, and where it goes, from P's timeline of the
    transfer (``t``, P's /layerwise/transfers) and D's (``d_timeline``, D's
    response): all time.monotonic() of processes on one host (CLOCK_MONOTONIC
    is one clock host-wide, namespaces included), so no clock is aligned.

    ``tail_s`` = D's first token (D's scheduler: the request finished, one
    token) - P's last layer computed (P's worker). Unlike the client's figure
    (``client_tail_s`` = D's response - P's response) it does not move with
    P's HTTP response or the client's scheduling. Split (ms): P's last layer ->
    last write done -> P answered D (transfer ended) -> D's scheduler saw the
    pull end (request runnable) -> D scheduled it -> D's first token -> D's
    response at the client; and share of bytes written before P's last layer.
    """
    if not t or not t.get("bytes_written") or sample.get("started_monotonic") is None:
        return {}
    ms = lambda a, b: None if a is None or b is None else 1e3 * (b - a)  # noqa: E731
    d = sample.get("d_timeline") or {}
    p_resp = d_resp = None
    if sample.get("p_latency_s") is not None:
        p_resp = sample["started_monotonic"] + sample["p_latency_s"]
    if sample.get("total_s") is not None:
        d_resp = sample["started_monotonic"] + sample["total_s"]
    tail_ms = ms(t.get("prefill_end"), d.get("finished"))
    return {
        "tail_s": None if tail_ms is None else tail_ms / 1e3,
        "share_before_prefill_end": t["bytes_before_prefill_end"] / t["bytes_written"],
        "prefill_end_to_last_write_ms": ms(
            t.get("prefill_end"), t.get("last_write_end")
        ),
        "last_write_to_end_ms": ms(t.get("last_write_end"), t.get("ended_at")),
        "end_to_d_runnable_ms": ms(t.get("ended_at"), d.get("kv_arrived")),
        "d_runnable_to_scheduled_ms": ms(d.get("kv_arrived"), d.get("scheduled")),
        "d_scheduled_to_first_token_ms": ms(d.get("scheduled"), d.get("finished")),
        "d_first_token_to_client_ms": ms(d.get("finished"), d_resp),
        # what D adds once the transfer ended; compared with a local hit's TTFT
        "end_to_d_first_token_ms": ms(t.get("ended_at"), d.get("finished")),
        # the client's view, as before the engine-clock tail
        "p_response_to_end_ms": ms(p_resp, t.get("ended_at")),
        "end_to_d_response_ms": ms(t.get("ended_at"), d_resp),
    }


def p_cpu_clocks(p_bootstrap_url: str) -> tuple[float | None, float, float | None]:
    """P's forward thread's CPU seconds so far (None before its first step or off
    Linux), those it spent in the layer-wise per-layer hook, and the issuer
    thread's (the per-transfer work of each layer, off the forward thread)."""
    totals = layerwise_transfers(p_bootstrap_url)["totals"]
    return (
        totals.get("forward_thread_cpu_s"),
        totals["layer_hook_cpu_s"],
        totals.get("layer_issue_cpu_s"),
    )


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def kv_bytes(kv_tokens: int, kv_bytes_per_token: int) -> int:
    """Bytes one transfer moves: whole blocks covering the KV tokens, all layers."""
    return math.ceil(kv_tokens / BLOCK) * BLOCK * kv_bytes_per_token


def measure(
    step: Step, p, d, p_model: str, d_model: str, prompts, timeout: float
) -> Sample:
    """Run one step; a failed request is recorded in the sample, never raised."""
    s = Sample(step.load, step.kv_tokens, step.rep, step.arm)
    prompt = prompts(step.kv_tokens + 1)
    try:
        fwd0, hook0, iss0 = p_cpu_clocks(p.bootstrap_url)
        if step.arm == PREFILL_ONLY:
            s.p_latency_s = complete(
                p.url,
                prompt,
                max_tokens=1,
                logprobs=None,
                model=p_model,
                timeout=timeout,
            ).latency_s
            s.p_forward_cpu_s = _delta(fwd0, p_cpu_clocks(p.bootstrap_url)[0])
            return s
        r = pd_generate(
            p.url,
            p.bootstrap_url,
            d.url,
            prompt,
            max_tokens=1,
            logprobs=5,
            extra_prefill_params={"mooncake_mode": step.arm},
            timeout=timeout,
        )
        fwd1, hook1, iss1 = p_cpu_clocks(p.bootstrap_url)
        s.p_forward_cpu_s = _delta(fwd0, fwd1)
        if step.arm == LAYERWISE:
            s.layer_hook_cpu_s = hook1 - hook0
            s.layer_issue_cpu_s = _delta(iss0, iss1)
        s.transfer_id, s.started_monotonic = r.transfer_id, r.started_monotonic
        s.p_latency_s, s.total_s = r.prefill.latency_s, r.total_s
        s.client_tail_s = r.total_s - r.prefill.latency_s
        s.d_timeline = (r.decode.kv_transfer_params or {}).get(TIMELINE_PARAM)
        ttft0 = histogram(d.url, TTFT)
        hit = complete(
            d.url, prompt, max_tokens=1, logprobs=5, model=d_model, timeout=timeout
        )
        ttft1 = histogram(d.url, TTFT)
        s.local_hit_cached, s.local_hit_client_s = hit.cached_tokens, hit.latency_s
        if hit.cached_tokens != step.kv_tokens:
            s.problems.append(
                f"local hit on D cached {hit.cached_tokens} tokens, not "
                f"{step.kv_tokens}: not used for the floor"
            )
        elif ttft1[1] - ttft0[1] == 1:
            s.local_hit_s = ttft1[0] - ttft0[0]
        # else another request (decode load) got its first token meanwhile: no sample
        ref = complete(
            p.url, prompt, max_tokens=1, logprobs=5, model=p_model, timeout=timeout
        )
        # the prompt is kv_tokens + 1 long: D takes all but its last token from P
        # (0.18.1) or all of it (0.32.0)
        check = compare(
            r.decode,
            ref,
            expected_cached_tokens=cached_tokens_of_whole_prompt(step.kv_tokens + 1),
        )
        s.correct, s.cached_tokens = check.ok, check.cached_tokens
        s.max_logprob_diff = check.max_logprob_diff
        s.problems += check.problems
    except (RequestFailed, httpx.HTTPError, RuntimeError) as e:
        s.error, s.correct = f"{type(e).__name__}: {e}"[:1000], False
    return s


def one_layer_writes(
    sizes: list[int],
    kv_bytes_per_token: int,
    layers: int,
    protocol: str,
    log_path: Path,
    reps: int = 7,
) -> dict[int, dict]:
    """Per KV token count: the engine's time to write one layer's KV, laid out as
    the layer-wise sender lays it out: one entry per KV tensor (K and V) covering
    the request's run of blocks (D allocates a fresh request's blocks
    contiguously). Median over reps. The engines run in a child process whose
    output (the engine's own log lines) goes to ``log_path``."""
    from microbench.bandwidth import engine_write_bandwidths

    layer_bytes = {n: kv_bytes(n, kv_bytes_per_token) // layers for n in sizes}
    probes = engine_write_bandwidths(
        [(b, b // 2) for b in layer_bytes.values()],
        protocol,
        reps=reps,
        log_path=log_path,
    )
    out = {}
    for (n, b), probe in zip(layer_bytes.items(), probes):
        secs = probe["seconds"]
        out[n] = {
            "kv_tokens": n,
            "layer_bytes": b,
            "entries": 2,
            "seconds": secs,
            "median_s": statistics.median(secs),
            "gb_per_s": b / statistics.median(secs) / 1e9,
        }
    return out
