"""mb7: critical-path overhead of moving a prompt's KV from prefill to decode.

Two vLLM instances (P: kv_producer, D: kv_consumer) with MooncakeConnector over
the Mooncake transfer engine. For each prompt length and each mode:

  prefill-only  P alone computes the prompt (max_tokens=1, no transfer)
  total         P prefills and D returns its first token from P's KV
  overhead      total - prefill-only: what the transfer adds to the critical path
  bytes         KV bytes moved for the prompt (all layers, K and V)
  correctness   D's cached tokens == prompt length - 1 (vLLM recomputes the last
                token) and D's logprobs equal a run that computed the prompt
                itself (harness.correctness)

Modes: "posthoc" is upstream's transfer after the whole prefill. Writes JSON and
prints a table.

    python -m microbench.mb7 [--model DIR] [--sizes 512,1024,2048,4096] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from harness.correctness import compare, reference_completion
from harness.launcher import Cluster, InstanceSpec
from harness.model import ModelShape, ensure_model
from harness.pd_client import complete, model_name, pd_generate
from microbench.common import (
    DEFAULT_RESULTS_DIR,
    PromptSource,
    format_table,
    machine_info,
    median,
    stamp,
    write_json,
)

MODES = {
    # mode -> environment of both instances
    "posthoc": {},
}
BLOCK_SIZE = 128


def model_facts(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    elem = 4 if dtype == "float32" else 2
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    return {
        "path": str(model_dir),
        "layers": layers,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "vocab_size": cfg["vocab_size"],
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * elem,
    }


def kv_bytes(prompt_len: int, facts: dict) -> int:
    """Bytes the connector moves: whole blocks covering the prompt, all layers."""
    return math.ceil(prompt_len / BLOCK_SIZE) * BLOCK_SIZE * facts["kv_bytes_per_token"]


def run_mode(mode: str, args, facts: dict, log_dir: Path) -> list[dict]:
    common = dict(model=facts["path"], protocol=args.protocol, kv_cache_gib=args.kv_cache_gib,
                  max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                  dtype=facts["dtype"], env=dict(MODES[mode]),
                  extra_args=["--enable-prompt-tokens-details", "--block-size", str(BLOCK_SIZE)])
    specs = [InstanceSpec("prefill", role="kv_producer", cores=args.p_cores, **common),
             InstanceSpec("decode", role="kv_consumer", cores=args.d_cores, **common)]
    prompts = PromptSource(facts["vocab_size"], seed=args.seed)
    rows = []
    with Cluster(specs, log_dir / mode) as cluster:
        p, d = cluster["prefill"], cluster["decode"]
        pm = model_name(p.url)
        # Warm-up: first requests pay one-time costs (bootstrap query, handshakes).
        pd_generate(p.url, p.bootstrap_url, d.url, prompts(64), max_tokens=1, logprobs=None)
        complete(p.url, prompts(64), max_tokens=1, logprobs=None, model=pm)
        for n in args.sizes:
            t_prefill, t_total = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                complete(p.url, prompts(n), max_tokens=1, logprobs=None, model=pm)
                t_prefill.append(time.perf_counter() - t0)
                r = pd_generate(p.url, p.bootstrap_url, d.url, prompts(n), max_tokens=1, logprobs=None)
                t_total.append(r.total_s)
            # Correctness on a fresh prompt: D's tokens/logprobs against a local run.
            prompt = prompts(n)
            r = pd_generate(p.url, p.bootstrap_url, d.url, prompt, max_tokens=4, logprobs=5)
            ref = reference_completion(p.url, prompt, max_tokens=4)
            check = compare(r.decode, ref, expected_cached_tokens=n - 1)
            row = {
                "mode": mode,
                "load": 0,
                "prompt_len": n,
                "prefill_only_s": median(t_prefill),
                "total_s": median(t_total),
                "bytes": kv_bytes(n, facts),
                "correct": check.ok,
                "cached_tokens": check.cached_tokens,
                "max_logprob_diff": check.max_logprob_diff,
                "problems": check.problems,
                "samples": {"prefill_only_s": t_prefill, "total_s": t_total},
            }
            row["overhead_s"] = row["total_s"] - row["prefill_only_s"]
            row["overhead_over_prefill"] = row["overhead_s"] / row["prefill_only_s"]
            rows.append(row)
            print(f"[mb7] {mode} n={n}: prefill {row['prefill_only_s']:.3f}s total "
                  f"{row['total_s']:.3f}s overhead {row['overhead_s'] * 1e3:.0f}ms "
                  f"correct={check.ok}", flush=True)
    return rows


TABLE = [
    ("mode", "mode", ""), ("load", "load", "d"), ("prompt_len", "tokens", "d"),
    ("mib", "KV MiB", ".1f"), ("prefill_only_s", "prefill s", ".3f"), ("total_s", "total s", ".3f"),
    ("overhead_ms", "overhead ms", ".0f"), ("overhead_pct", "ovh/prefill %", ".1f"),
    ("correct", "correct", ""),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m microbench.mb7", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: generated default model)")
    ap.add_argument("--sizes", default="512,1024,2048,4096", help="prompt lengths, comma separated")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma separated of {list(MODES)}")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--protocol", default="tcp", help="Mooncake protocol (tcp here; rdma on RDMA hosts)")
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--p-cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND of P (CPU only)")
    ap.add_argument("--d-cores", default="1", help="VLLM_CPU_OMP_THREADS_BIND of D (CPU only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default results/mb7-<time>.json)")
    args = ap.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; known: {list(MODES)}")

    model_dir = args.model or ensure_model(ModelShape())
    facts = model_facts(Path(model_dir))
    run_id = stamp()
    out = args.out or DEFAULT_RESULTS_DIR / f"mb7-{run_id}.json"
    log_dir = out.parent / f"mb7-{run_id}-logs"
    print(f"[mb7] model {facts['path']} ({facts['layers']} layers, "
          f"{facts['kv_bytes_per_token'] / 1024:.0f} KiB KV/token); sizes {args.sizes}; modes {modes}",
          flush=True)
    rows = []
    for mode in modes:
        rows += run_mode(mode, args, facts, log_dir)
    for r in rows:
        r["mib"] = r["bytes"] / 2**20
        r["overhead_ms"] = r["overhead_s"] * 1e3
        r["overhead_pct"] = 100 * r["overhead_over_prefill"]
    result = {
        "benchmark": "mb7",
        "machine": machine_info(),
        "model": facts,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }
    write_json(out, result)
    print()
    print(format_table(rows, TABLE))
    print(f"\n[mb7] wrote {out}")
    bad = [r for r in rows if not r["correct"]]
    if bad:
        print(f"[mb7] CORRECTNESS FAILED for {[(r['mode'], r['prompt_len']) for r in bad]}: "
              f"{bad[0]['problems']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
