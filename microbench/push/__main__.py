"""microbench/push: turn 2 of a multi-turn session, with its prefix pushed from C.

Two vLLM instances: C (kv_producer, holds the session's prefix KV) and D
(kv_consumer). Per prefix length and repetition, on fresh random tokens:

  turn 1   C serves the prompt (--turn1-output tokens); C's prefix cache now
           holds its full blocks (polled on C's /match_blocks)
  turn 2   = turn 1's prompt + its output + --new-tokens new tokens, three ways:
    push   on D with kv_transfer_params {"push_from": C's bootstrap URL}: C's
           bootstrap server writes the held blocks into D (POST /push_blocks)
    local  on C (its own prefix cache)
    cold   on D with a fresh cache_salt (nothing reused)

TTFT is the latency of a max_tokens=1 request. Reported per length: blocks
matched on C / full blocks of turn 2, blocks pushed, D's external prefix-cache
hit rate (cached tokens / prompt tokens), TTFT medians, push/local and
push/cold, bytes pushed, and the transfer engine's own bandwidth measured
here (microbench/bandwidth.py) with the issue's target
push <= local + 1.25 x bytes / bandwidth + 50 ms and push <= 0.3 x cold.
Correctness: one more turn 2 per length with 4 tokens and top-5 logprobs on
D via push, checked against C computing it from scratch (harness.correctness;
D's cached tokens must equal the pushed tokens).

The default model here is the generated one with --layers 8 (48 makes a cold
16k-token prefill take minutes on this CPU); the layer count is an option.

    python -m microbench.push [--sizes 2048,8192,16384] [--reps 5] [--layers 8]
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

import httpx

from harness.correctness import compare, reference_completion
from harness.launcher import Cluster, InstanceSpec
from harness.model import ModelShape, ensure_model
from harness.pd_client import (
    RequestFailed,
    bootstrap_headers,
    complete,
    model_name,
    wait_for_matched_blocks,
)
from harness.prompts import PromptSource
from microbench.bandwidth import engine_write_bandwidth
from microbench.common import (
    DEFAULT_RESULTS_DIR,
    finish,
    machine_info,
    median,
    model_facts,
    stamp,
)

BLOCK_SIZE = 128
REQUEST_TIMEOUT_S = 900


def one_session(c, d, prompts, n: int, args, cm: str, dm: str, *, logprobs: int | None,
                max_tokens: int) -> dict:
    turn1 = prompts(n)
    out1 = complete(c.url, turn1, max_tokens=args.turn1_output, logprobs=None, model=cm,
                    timeout=REQUEST_TIMEOUT_S)
    turn2 = turn1 + out1.token_ids + prompts(args.new_tokens)
    # the last output token's KV is not computed by turn 1
    m = wait_for_matched_blocks(c.bootstrap_url, turn2,
                                (len(turn1) + len(out1.token_ids) - 1) // BLOCK_SIZE)
    push = complete(d.url, turn2, max_tokens=max_tokens, logprobs=logprobs, model=dm,
                    kv_transfer_params={"push_from": c.bootstrap_url}, timeout=REQUEST_TIMEOUT_S)
    return {"turn2": turn2, "match": m, "push": push}


def measure_size(c, d, prompts, n: int, args, cm: str, dm: str, facts: dict) -> dict:
    ttft = {"push": [], "local": [], "cold": []}
    matched, pushed, total_blocks, hit = [], [], [], []
    for rep in range(args.reps):
        s = one_session(c, d, prompts, n, args, cm, dm, logprobs=None, max_tokens=1)
        local = complete(c.url, s["turn2"], max_tokens=1, logprobs=None, model=cm,
                         timeout=REQUEST_TIMEOUT_S)
        cold = complete(d.url, s["turn2"], max_tokens=1, logprobs=None, model=dm,
                        cache_salt=f"cold-{uuid.uuid4().hex}", timeout=REQUEST_TIMEOUT_S)
        ttft["push"].append(s["push"].latency_s)
        ttft["local"].append(local.latency_s)
        ttft["cold"].append(cold.latency_s)
        matched.append(s["match"]["matched_blocks"])
        total_blocks.append(s["match"]["total_full_blocks"])
        cached = s["push"].cached_tokens or 0
        pushed.append(cached // BLOCK_SIZE)
        hit.append(cached / len(s["turn2"]))
        print(f"[push] n={n} rep {rep + 1}/{args.reps}: push {ttft['push'][-1]:.3f}s local "
              f"{ttft['local'][-1]:.3f}s cold {ttft['cold'][-1]:.3f}s; matched "
              f"{matched[-1]}/{total_blocks[-1]} blocks, D cached {cached} tokens", flush=True)
    # correctness on a fresh session: D's tokens/logprobs via push vs C from scratch
    s = one_session(c, d, prompts, n, args, cm, dm, logprobs=5, max_tokens=4)
    ref = reference_completion(c.url, s["turn2"], max_tokens=4)
    check = compare(s["push"], ref, expected_cached_tokens=s["match"]["matched_blocks"] * BLOCK_SIZE)
    pushed_bytes = median(pushed) * BLOCK_SIZE * facts["kv_bytes_per_token"]
    row = {
        "prefix_len": n,
        "turn2_len": len(s["turn2"]),
        "matched_blocks": median(matched),
        "total_full_blocks": median(total_blocks),
        "pushed_blocks": median(pushed),
        "pushed_over_matched": min(p / m for p, m in zip(pushed, matched)) if all(matched) else 0.0,
        "external_hit_rate": median(hit),
        "ttft_push_s": median(ttft["push"]),
        "ttft_local_s": median(ttft["local"]),
        "ttft_cold_s": median(ttft["cold"]),
        "pushed_bytes": pushed_bytes,
        "correct": check.ok,
        "problems": check.problems,
        "max_logprob_diff": check.max_logprob_diff,
        "samples": ttft,
    }
    row["push_over_local"] = row["ttft_push_s"] / row["ttft_local_s"]
    row["push_over_cold"] = row["ttft_push_s"] / row["ttft_cold_s"]
    return row


def summarize(rows: list[dict], bw: dict) -> dict:
    ok = [r for r in rows if not r.get("error")]
    if not ok:
        return {"lines": ["no size completed"]}
    top = max(ok, key=lambda r: r["prefix_len"])
    line_rate_s = top["pushed_bytes"] / (bw["gb_per_s"] * 1e9)
    bound = top["ttft_local_s"] + 1.25 * line_rate_s + 0.050
    out = {
        "largest_prefix": top["prefix_len"],
        "push_ttft_bound_s": bound,
        "push_within_bound": top["ttft_push_s"] <= bound,
        "push_over_cold": top["push_over_cold"],
        "push_le_0.3_cold": top["push_over_cold"] <= 0.3,
        "all_held_blocks_pushed": all(r["pushed_over_matched"] == 1.0 for r in ok),
        "all_correct": all(r["correct"] for r in ok),
    }
    out["lines"] = [
        f"engine bandwidth ({bw['protocol']}, this machine): {bw['gb_per_s']:.2f} GB/s "
        f"({bw['bytes'] / 2**20:.0f} MiB in {bw['entry_bytes'] // 1024} KiB entries, best of "
        f"{len(bw['seconds'])})",
        f"largest prefix {top['prefix_len']}: push {top['ttft_push_s']:.3f}s vs bound local "
        f"{top['ttft_local_s']:.3f}s + 1.25 x {top['pushed_bytes'] / 2**20:.0f} MiB / bw "
        f"({line_rate_s:.3f}s) + 50 ms = {bound:.3f}s -> "
        f"{'met' if out['push_within_bound'] else 'NOT met'}",
        f"push / cold = {top['push_over_cold']:.2f} (target <= 0.3) -> "
        f"{'met' if out['push_le_0.3_cold'] else 'NOT met'}",
        f"all of C's held blocks pushed: {out['all_held_blocks_pushed']}; "
        f"correctness: {'pass' if out['all_correct'] else 'FAIL'}",
    ]
    return out


TABLE = [
    ("prefix_len", "prefix", "d"), ("turn2_len", "turn2", "d"),
    ("matched_blocks", "matched", ".0f"), ("total_full_blocks", "of blocks", ".0f"),
    ("pushed_blocks", "pushed", ".0f"), ("external_hit_rate", "ext hit", ".2f"),
    ("mib", "MiB", ".0f"), ("ttft_local_s", "local s", ".3f"), ("ttft_push_s", "push s", ".3f"),
    ("ttft_cold_s", "cold s", ".3f"), ("push_over_local", "push/local", ".2f"),
    ("push_over_cold", "push/cold", ".2f"), ("correct", "correct", ""),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m microbench.push", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: generated, --layers)")
    ap.add_argument("--layers", type=int, default=8, help="layers of the generated default model")
    ap.add_argument("--sizes", default="2048,8192,16384", help="turn-1 prompt lengths")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--turn1-output", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--c-cores", default="0")
    ap.add_argument("--d-cores", default="1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default results/push-<time>.json)")
    args = ap.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]

    model_dir = args.model or ensure_model(ModelShape(num_layers=args.layers))
    facts = model_facts(Path(model_dir))
    run_id = stamp()
    out = args.out or DEFAULT_RESULTS_DIR / f"push-{run_id}.json"
    max_len = max(args.sizes) + args.turn1_output + args.new_tokens + BLOCK_SIZE
    largest = (max(args.sizes) + args.turn1_output) // BLOCK_SIZE * BLOCK_SIZE * facts["kv_bytes_per_token"]
    print(f"[push] model {facts['path']} ({facts['layers']} layers, "
          f"{facts['kv_bytes_per_token'] / 1024:.0f} KiB KV/token); sizes {args.sizes}; reps {args.reps}",
          flush=True)
    print("[push] measuring the transfer engine's bandwidth ...", flush=True)
    bw = engine_write_bandwidth(largest, 1 << 20, args.protocol)
    print(f"[push] {bw['gb_per_s']:.2f} GB/s", flush=True)

    common = dict(model=facts["path"], protocol=args.protocol, kv_cache_gib=args.kv_cache_gib,
                  max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens,
                  dtype=facts["dtype"],
                  extra_args=["--enable-prompt-tokens-details", "--block-size", str(BLOCK_SIZE)])
    specs = [InstanceSpec("c", role="kv_producer", cores=args.c_cores, **common),
             InstanceSpec("d", role="kv_consumer", cores=args.d_cores, **common)]
    prompts = PromptSource(facts["vocab_size"], seed=args.seed)
    rows = []
    with Cluster(specs, out.parent / f"push-{run_id}-logs") as cluster:
        c, d = cluster["c"], cluster["d"]
        cm, dm = model_name(c.url), model_name(d.url)
        one_session(c, d, prompts, 256, args, cm, dm, logprobs=None, max_tokens=1)  # warm-up
        for n in args.sizes:
            try:
                rows.append(measure_size(c, d, prompts, n, args, cm, dm, facts))
            except (RequestFailed, httpx.HTTPError) as e:
                print(f"[push] n={n}: FAILED: {e}", file=sys.stderr, flush=True)
                rows.append({"prefix_len": n, "error": str(e), "correct": False})
        push_stats = httpx.get(c.bootstrap_url + "/hashsync", timeout=30, headers=bootstrap_headers()).json().get("push")
    for r in rows:
        if not r.get("error"):
            r["mib"] = r["pushed_bytes"] / 2**20
    result = {"benchmark": "push", "machine": machine_info(), "model": facts,
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "engine_bandwidth": bw, "c_push_stats": push_stats, "rows": rows}
    result["summary"] = summarize(rows, bw)
    return finish("push", out, result, TABLE, lambda r: r["prefix_len"])

if __name__ == "__main__":
    raise SystemExit(main())
