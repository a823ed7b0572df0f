"""Layer-wise push behind the dispatchers deployments run: how much overlaps.

One layer-wise P and D (MOONCAKE_LAYERWISE=1, P on core 0, D on core 1) behind
vLLM's own router (vllm-router in PD mode, --kv-connector mooncake) and behind
upstream's example Mooncake proxy (harness/routers.py), the same prompts through
each, one at a time. Per dispatcher: the time to the first token as the client
sees it (max_tokens=1 through the dispatcher: P's prefill, the transfer and D's
first token), the tail (that time minus P's own end-to-end latency of the
request, from P's vllm:e2e_request_latency_seconds: what the client waits for
after P is done), the share of each transfer's layer-wise bytes written before P's
prefill ended and how many transfers P counted as "destination after prefill"
(both from P's /layerwise/transfers). Every answer is checked against a
from-scratch reference (logprobs) and D's connector must have loaded the whole
prompt (vLLM's external prefix-cache hits on D).

    python -m microbench.routers [--requests 12] [--prompt-len 1024]

Writes results/routers-<time>.json and .png, prints a table.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from harness.correctness import compare, reference_completion
from harness.launcher import BLOCK, Cluster, InstanceSpec
from harness.metrics import counter, counter_when, histogram, read_when
from harness.model import ModelShape, ensure_model
from harness.pd_client import complete, layerwise_transfers, model_name
from harness.prompts import PromptSource
from harness.routers import upstream_proxy, vllm_router
from microbench.common import (
    DEFAULT_RESULTS_DIR,
    code_version,
    config_of,
    figure,
    finish,
    machine_info,
    model_facts,
    parser,
    provenance,
    save_figure,
    stamp,
)

DISPATCHERS = {"vllm-router": vllm_router, "upstream-proxy": upstream_proxy}
D_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
P_E2E = "vllm:e2e_request_latency_seconds"
LAYERWISE_ENV = {"MOONCAKE_LAYERWISE": "1", "MOONCAKE_LAYERWISE_MIN_TOKENS": "256"}


def p_transfers(p) -> list[dict]:
    return layerwise_transfers(p.bootstrap_url)["transfers"]


def spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    return {
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))],
    }


def run_dispatcher(name, start, p, d, prompts, warm_up, log_dir, model) -> dict:
    """The prompts through one dispatcher, after ``warm_up``; its row."""
    print(f"[routers] {name}: {len(prompts)} requests", flush=True)
    before = {t["transfer_id"] for t in p_transfers(p)}
    ttft, tail, problems, loaded_ok, loaded_all = [], [], [], 0, []
    with start(p, d, log_dir) as disp:
        complete(disp.url, warm_up, max_tokens=1, logprobs=None, model=model)
        before |= {t["transfer_id"] for t in p_transfers(p)}  # the warm-up's
        answers = []
        for ids in prompts:
            hits, (p_sum, p_count) = (
                counter(d.url, D_EXTERNAL_HITS),
                histogram(p.url, P_E2E),
            )
            got = complete(disp.url, ids, max_tokens=1, logprobs=5, model=model)
            need = hits + len(ids) - 1
            loaded = (
                counter_when(d.url, D_EXTERNAL_HITS, lambda v, n=need: v >= n) - hits
            )
            loaded_ok += len(ids) - 1 <= loaded <= len(ids)
            loaded_all.append(loaded)
            ttft.append(got.latency_s)
            p_after = read_when(
                lambda: histogram(p.url, P_E2E), lambda h, c=p_count: h[1] != c
            )
            if p_after[1] - p_count == 1:  # P's own latency of this one request
                tail.append(got.latency_s - (p_after[0] - p_sum))
            answers.append(got)
    for ids, got in zip(prompts, answers):
        check = compare(
            got,
            reference_completion(p.url, ids, max_tokens=1),
            expected_cached_tokens=None,
        )
        problems += check.problems
    new = [t for t in p_transfers(p) if t["transfer_id"] not in before]
    shares = [
        t["bytes_before_prefill_end"] / t["bytes_written"]
        for t in new
        if t["bytes_written"]
    ]
    lag = [
        t["first_write_start"] - t["prefill_end"]
        for t in new
        if t["first_write_start"] is not None and t["prefill_end"] is not None
    ]
    row = {
        "dispatcher": name,
        "requests": len(prompts),
        "transfers": len(new),
        "completed": sum(t["outcome"] == "completed" for t in new),
        "after_prefill": sum(t["destination_after_prefill"] for t in new),
        "kv_loaded_by_d": loaded_ok,
        "tokens_loaded_by_d": loaded_all,
        "ttft_s": spread(ttft),
        "tail_s": spread(tail),
        "share_before_prefill_end": spread(shares),
        "first_write_after_prefill_end_s": spread(lag),
        "ttft_all_s": ttft,
        "tail_all_s": tail,
        "shares_all": shares,
        "correct": not problems and loaded_ok == len(prompts),
        "problems": problems[:5],
        "log": str(disp.log_path),
    }
    print(
        f"[routers] {name}: TTFT median {row['ttft_s']['median'] * 1e3:.0f} ms, "
        f"{row['share_before_prefill_end'].get('median', 0):.0%} of the bytes before "
        f"prefill end, {row['after_prefill']}/{len(new)} after prefill",
        flush=True,
    )
    return row


TABLE = [
    ("dispatcher", "dispatcher", ""),
    ("requests", "req", "d"),
    ("after_prefill", "dest after prefill", "d"),
    ("share_med", "bytes before end (median)", ".1%"),
    ("share_min", "(min)", ".1%"),
    ("ttft_med", "TTFT ms (median)", ".0f"),
    ("ttft_p90", "(p90)", ".0f"),
    ("ttft_min", "(min)", ".0f"),
    ("ttft_max", "(max)", ".0f"),
    ("tail_med", "tail ms (median)", ".0f"),
    ("tail_min", "(min)", ".0f"),
    ("tail_max", "(max)", ".0f"),
    ("correct", "correct", ""),
]


def display(rows: list[dict]) -> list[dict]:
    return [
        {
            **r,
            "share_med": r["share_before_prefill_end"].get("median"),
            "share_min": r["share_before_prefill_end"].get("min"),
            "ttft_med": r["ttft_s"]["median"] * 1e3,
            "ttft_p90": r["ttft_s"]["p90"] * 1e3,
            "ttft_min": r["ttft_s"]["min"] * 1e3,
            "ttft_max": r["ttft_s"]["max"] * 1e3,
            **{
                f"tail_{k}": r["tail_s"][key] * 1e3
                for k, key in (("med", "median"), ("min", "min"), ("max", "max"))
                if r["tail_s"]
            },
        }
        for r in rows
    ]


def plot(rows: list[dict], path: Path, title: str, origin: str) -> Path | None:
    if (made := figure(1, 3, (13, 4))) is None:
        return None
    fig, (a, t, b) = made
    names = [r["dispatcher"] for r in rows]
    a.boxplot([[x * 1e3 for x in r["ttft_all_s"]] for r in rows], tick_labels=names)
    a.set_ylabel("time to first token, client (ms)")
    t.boxplot([[x * 1e3 for x in r["tail_all_s"]] for r in rows], tick_labels=names)
    t.set_ylabel("tail: TTFT minus P's own latency (ms)")
    b.boxplot([[x * 100 for x in r["shares_all"]] for r in rows], tick_labels=names)
    b.set_ylabel("layer-wise bytes written before P's prefill ended (%)")
    b.set_ylim(-5, 105)
    return save_figure(fig, path, title, origin)


def main(argv: list[str] | None = None) -> int:
    ap = parser("routers", __doc__)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=ModelShape().num_layers)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_seed()
    ap.add_out()
    args = ap.parse_args(argv)
    facts = model_facts(Path(ensure_model(ModelShape(num_layers=args.layers))))
    code = code_version()  # the code this process runs: edits made later do not
    run_id = stamp()
    out = args.out or DEFAULT_RESULTS_DIR / f"routers-{run_id}.json"
    log_dir = out.parent / f"routers-{run_id}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    common = dict(
        model=facts["path"],
        max_model_len=args.prompt_len + 2 * BLOCK,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=facts["dtype"],
        env=LAYERWISE_ENV,
    )
    specs = [
        InstanceSpec("prefill", role="kv_producer", cores="0", **common),
        InstanceSpec("decode", role="kv_consumer", cores="1", **common),
    ]
    source = PromptSource(facts["vocab_size"], seed=args.seed)
    print(
        f"[routers] starting P (core 0) and D (core 1); logs in {log_dir}", flush=True
    )
    rows = []
    with Cluster(specs, log_dir) as cluster:
        p, d = cluster["prefill"], cluster["decode"]
        model = model_name(p.url)
        for name, start in DISPATCHERS.items():
            prompts = [source(args.prompt_len) for _ in range(args.requests)]
            warm_up = source(300)  # shares no block with the measured prompts
            rows.append(
                run_dispatcher(name, start, p, d, prompts, warm_up, log_dir, model)
            )
    lines = [
        f"{r['dispatcher']}: {r['after_prefill']}/{r['transfers']} transfers counted "
        f"'destination after prefill'; bytes before P's prefill ended: median "
        f"{r['share_before_prefill_end'].get('median', 0):.1%} (min "
        f"{r['share_before_prefill_end'].get('min', 0):.1%}, max "
        f"{r['share_before_prefill_end'].get('max', 0):.1%}); TTFT median "
        f"{r['ttft_s']['median'] * 1e3:.0f} ms (min {r['ttft_s']['min'] * 1e3:.0f}, "
        f"p90 {r['ttft_s']['p90'] * 1e3:.0f}, max {r['ttft_s']['max'] * 1e3:.0f}); tail "
        f"median {r['tail_s'].get('median', float('nan')) * 1e3:.0f} ms (min "
        f"{r['tail_s'].get('min', float('nan')) * 1e3:.0f}, max "
        f"{r['tail_s'].get('max', float('nan')) * 1e3:.0f})"
        for r in rows
    ]
    result = {
        "benchmark": "routers",
        "machine": machine_info(),
        "code": code,
        "model": facts,
        "config": config_of(args),
        "rows": rows,
        "summary": {"lines": lines},
    }
    png = plot(
        rows,
        out.with_suffix(".png"),
        f"layer-wise behind dispatchers: {args.requests} x {args.prompt_len} tokens, "
        f"{facts['layers']} layers, one at a time",
        provenance(result["machine"], code, run_id),
    )
    return finish(
        "routers", out, result, TABLE, lambda r: r["dispatcher"], png, display
    )


if __name__ == "__main__":
    raise SystemExit(main())
