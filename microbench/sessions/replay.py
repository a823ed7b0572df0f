"""Replay scaled trace requests against an OpenAI-compatible endpoint, on the
trace's clock: each request is sent at its timestamp (relative to the start) on a
thread of its own, streamed, and timed as the client sees it.

With ``after`` (a session's turns), a turn is sent no earlier than the end of the
turn before it, as an agent sends its next call only once it has the answer: a
turn sent earlier would find its session's prefix still being computed, which no
cache can hold, and the open-loop clock sent a third of the later turns so at 4
sessions a minute on a 2-core host. Sessions still arrive on the clock; only a
session's own order holds its turns back, and each turn says how long
(``held_s``).

Per request: the time to the first token (the first streamed chunk that carries
text), the end-to-end latency, the time per output token after the first, the
prompt and output tokens vLLM reports (``stream_options.include_usage``), and
either an error or, for the sampled requests, the generated token ids and
top-k logprobs of the first tokens for a correctness check. Every request has a
deadline; a request that misses it is an error, never a hang.

With ``prefill`` (P/D), request ``i`` is sent to P and to D at once, as upstream's
P/D proxy does: P's (one output token, not streamed) with P's
``kv_transfer_params``, D's (streamed, timed) with D's; the time to the first
token is D's, from the moment both were sent, and P's failure is the request's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from harness.pd_client import Completion
from microbench.sessions.trace import TraceRequest


@dataclass
class Outcome:
    index: int
    sent_at_s: float  # from the replay's start
    late_s: float  # how far behind its timestamp it was sent, less ``held_s``
    prompt_len: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    prefill_s: float | None = None  # P/D: P's answer, from the send
    held_s: float = 0.0  # waiting for its previous turn's end, past its timestamp
    error: str | None = None
    sampled: Completion | None = field(default=None, repr=False)


def stream_completion(
    client: httpx.Client,
    url: str,
    body: dict,
    deadline_s: float,
) -> tuple[float | None, float, dict, list[dict]]:
    """POST a streamed completion; (ttft, e2e, usage, choices' chunks)."""
    t0 = time.perf_counter()
    ttft = None
    usage: dict = {}
    chunks: list[dict] = []
    with client.stream(
        "POST", url + "/v1/completions", json=body, timeout=deadline_s
    ) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if time.perf_counter() - t0 > deadline_s:
                raise TimeoutError(f"no end after {deadline_s:.0f} s")
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data.strip() == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("error"):
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                if ttft is None and (ch.get("text") or ch.get("token_ids")):
                    ttft = time.perf_counter() - t0
                chunks.append(ch)
    return ttft, time.perf_counter() - t0, usage, chunks


def completion_of(chunks: list[dict], usage: dict, latency: float) -> Completion:
    """The streamed chunks as the non-streamed Completion the checks take."""
    token_ids: list[int] = []
    top: list[dict[str, float]] = []
    token_lp: list[float] = []
    for ch in chunks:
        token_ids.extend(ch.get("token_ids") or [])
        lp = ch.get("logprobs") or {}
        top.extend(lp.get("top_logprobs") or [])
        token_lp.extend(lp.get("token_logprobs") or [])
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        token_ids=token_ids,
        logprobs=top,
        token_logprobs=token_lp,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=details.get("cached_tokens"),
        kv_transfer_params=None,
        latency_s=latency,
    )


def prefill_call(
    client: httpx.Client,
    url: str,
    body: dict,
    deadline_s: float,
    out: Outcome,
    error: list[str],
) -> None:
    """P's half of a P/D request: its answer's time into ``out``, or the error."""
    t0 = time.perf_counter()
    try:
        r = client.post(url + "/v1/completions", json=body, timeout=deadline_s)
        if r.status_code != 200:
            error.append(f"HTTP {r.status_code}: {r.text[:300]}")
            return
        out.prefill_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the request's outcome
        error.append(f"{type(e).__name__}: {e}")


def replay(
    url_of: Callable[[int], str],
    model: str,
    reqs: Sequence[TraceRequest],
    prompts: Sequence[list[int]],
    *,
    sampled: set[int] = frozenset(),
    check_tokens: int = 4,
    cache_salt: str | None = None,
    deadline_s: float = 300.0,
    progress: Callable[[int, int, int], None] | None = None,
    prefill: Callable[[int], tuple[str, dict, dict]] | None = None,
    after: Sequence[int | None] | None = None,
) -> list[Outcome]:
    """Send request ``i`` (``prompts[i]``) to ``url_of(i)`` at its timestamp, and
    not before request ``after[i]`` (its previous turn) has ended, however it
    ended; wait for all (each within ``deadline_s`` of its send); the outcomes in
    trace order.
    ``sampled`` requests also ask for top-5 logprobs (the first ``check_tokens``
    are kept for the correctness check). ``prefill(i)``: P/D, ``(P's url, P's
    kv_transfer_params, D's kv_transfer_params)``; ``url_of(i)`` is then D's."""
    outcomes: list[Outcome | None] = [None] * len(reqs)
    lock = threading.Lock()
    done = [0, 0]  # finished, errors
    client = httpx.Client(limits=httpx.Limits(max_connections=len(reqs) + 4))
    ended = [threading.Event() for _ in reqs]
    depth = [0] * len(reqs)  # turns before this one in its session
    for i, previous in enumerate(after or ()):
        if previous is not None:
            if not 0 <= previous < i:
                raise ValueError(f"request {i} cannot follow request {previous}")
            depth[i] = depth[previous] + 1
    start = time.perf_counter()

    def one(i: int, r: TraceRequest) -> None:
        try:
            send(i, r)
        finally:
            ended[i].set()

    def send(i: int, r: TraceRequest) -> None:
        previous = after[i] if after is not None else None
        woke = time.perf_counter()
        # each turn ends (an error too) within its deadline of its send, so the
        # turns before this one end within theirs, one after another
        if previous is None or ended[previous].wait(depth[i] * (deadline_s + 30)):
            blocked = None
        else:
            blocked = f"its previous turn (request {previous}) did not end"
        held = time.perf_counter() - woke if previous is not None else 0.0
        body = {
            "model": model,
            "prompt": prompts[i],
            "max_tokens": r.output_length,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if i in sampled:
            body["logprobs"] = 5
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        sent = time.perf_counter() - start
        late = max(0.0, sent - r.timestamp_ms / 1e3 - held)
        out = Outcome(i, sent, late, len(prompts[i]), held_s=held)
        p_thread, p_error = None, []
        try:
            if blocked:
                raise TimeoutError(blocked)
            if prefill is not None:
                p_url, p_params, d_params = prefill(i)
                body["kv_transfer_params"] = d_params
                p_body = {
                    k: v
                    for k, v in body.items()
                    if k not in ("stream", "stream_options", "logprobs")
                }
                p_body |= {"max_tokens": 1, "kv_transfer_params": p_params}
                p_thread = threading.Thread(
                    target=prefill_call,
                    args=(client, p_url, p_body, deadline_s, out, p_error),
                    daemon=True,
                )
                p_thread.start()
            ttft, e2e, usage, chunks = stream_completion(
                client, url_of(i), body, deadline_s
            )
            if p_thread is not None:
                p_thread.join(max(1.0, deadline_s - e2e))
                if p_thread.is_alive():
                    raise TimeoutError(f"P: no answer after {deadline_s:.0f} s")
                if p_error:
                    raise RuntimeError(f"P: {p_error[0]}")
            out.ttft_s, out.e2e_s = ttft, e2e
            out.prompt_tokens = usage.get("prompt_tokens")
            out.output_tokens = usage.get("completion_tokens")
            out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens"
            )
            if ttft is None:
                out.error = "no token streamed"
            elif out.output_tokens and out.output_tokens > 1:
                out.tpot_s = (e2e - ttft) / (out.output_tokens - 1)
            if i in sampled:
                c = completion_of(chunks, usage, e2e)
                c.token_ids = c.token_ids[:check_tokens]
                c.logprobs = c.logprobs[:check_tokens]
                c.token_logprobs = c.token_logprobs[:check_tokens]
                out.sampled = c
        except Exception as e:  # noqa: BLE001 - every failure is the request's outcome
            out.error = f"{type(e).__name__}: {e}"
        with lock:
            outcomes[i] = out
            done[0] += 1
            if out.error is not None and not done[1]:
                # The first failure's text, at once: a run stopped before its
                # JSON is written still says why its requests failed.
                print(f"[sessions] request {i} failed: {out.error}", flush=True)
            done[1] += out.error is not None
            if progress:
                progress(done[0], len(reqs), done[1])

    threads = []
    try:
        for i, r in enumerate(reqs):
            wait = r.timestamp_ms / 1e3 - (time.perf_counter() - start)
            if wait > 0:
                time.sleep(wait)
            t = threading.Thread(target=one, args=(i, r), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(deadline_s + 30)
    finally:
        client.close()
    return [
        o if o is not None else Outcome(i, 0.0, 0.0, len(prompts[i]), error="no end")
        for i, o in enumerate(outcomes)
    ]
