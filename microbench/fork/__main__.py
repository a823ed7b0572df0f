"""Fork bursts: sub-agents forked from one long context, with and without push.

One context (--context tokens, at least 16k by default) is computed on instance
``a`` (its holder); then --fork N requests that share it and differ after it
(--suffix new tokens each) are sent at once through vllm-router (round_robin)
over --instances ``kv_both`` instances, ``a`` included. Two arms, each on a
start of its own:

  recompute  no push: every other instance that gets a fork computes the
             context, some more than once (concurrent forks on one instance
             each compute the blocks the other has not finished)
  push       MOONCAKE_PUSH_AUTO=1: a destination takes the context from its
             holder; forks on one destination coalesce onto one push

Per arm and burst: TTFT p50/p90/max (client, streamed), prompt tokens computed
per instance and how many contexts that makes outside the holder, the bytes the
holder wrote to each destination against the context's KV (its GET
/push/stats), pushes and coalesced requests, errors, sampled forks checked
against a from-scratch reference (first tokens' top-5 logprobs), KV blocks held
after. Each burst (--bursts) uses a new context. Instance i runs on core i % 2:
with three instances, a and c share core 0 (said in the result).

Targets: push's TTFT p90 <= 0.3x recompute's, bytes per destination <= 1.1x the
context's KV, 0 errors, 0 wrong answers, 0 blocks held after.

    python -m microbench.fork [--fork 8] [--context 16384] [--instances 3]
                              [--bursts 2] [--layers 8]
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK, Cluster, InstanceSpec
from harness.metrics import prompt_tokens_by_source
from harness.model import ModelShape, ensure_model
from harness.pd_client import (
    complete,
    model_name,
    push_decisions,
    push_stats,
    wait_for_matched_blocks,
)
from harness.prompts import PromptSource
from harness.routers import vllm_router_workers
from microbench.common import (
    DEFAULT_RESULTS_DIR,
    clean_run_target,
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
    target_line,
)
from microbench.fork.accounting import BYTES_PER_DESTINATION_MAX, burst_accounting
from microbench.loadcurve import quantile
from microbench.sessions.replay import replay
from microbench.sessions.trace import TraceRequest

TOKEN = uuid.uuid4().hex
ARMS = {"recompute": {}, "push": {"MOONCAKE_PUSH_AUTO": "1"}}
TTFT_P90_OF_RECOMPUTE = 0.3
FEED_S = 3.0  # the holder's new blocks reach the other instances' holder indexes


def burst(
    insts, router_url: str, model: str, context: list[int], args, fresh, pushing: bool
) -> dict:
    """Seed the context on its holder, send the forks at once, account for them."""
    a = insts[0]
    t0 = time.monotonic()
    complete(a.url, context, max_tokens=1, logprobs=None, model=model)
    seed_s = time.monotonic() - t0
    full = len(context) // BLOCK
    if pushing:  # the holder's mirror has it, and the peers' indexes had time to learn
        wait_for_matched_blocks(a.bootstrap_url, context, full, timeout=60)
        time.sleep(FEED_S)
    forks = [context + fresh(args.suffix) for _ in range(args.fork)]
    reqs = [TraceRequest(0.0, len(p), args.output, ()) for p in forks]
    sampled = set(range(0, args.fork, max(1, args.fork // args.samples)))
    before_tokens = {i.spec.name: prompt_tokens_by_source(i.url) for i in insts}
    before_push = push_stats(a.bootstrap_url) if pushing else {}
    before_dec = [push_decisions(i.bootstrap_url) for i in insts] if pushing else []
    outcomes = replay(
        lambda i: router_url,
        model,
        reqs,
        forks,
        sampled=sampled,
        deadline_s=args.deadline_s,
    )
    time.sleep(1.0)  # vLLM counts a request's tokens just after it ends
    after_tokens = {i.spec.name: prompt_tokens_by_source(i.url) for i in insts}
    after_push = push_stats(a.bootstrap_url) if pushing else {}
    decisions: dict[str, float] = {}
    for inst, before in zip(insts, before_dec):
        for k, v in push_decisions(inst.bootstrap_url).items():
            decisions[k] = decisions.get(k, 0) + v - before.get(k, 0)
    acct = burst_accounting(
        before_tokens,
        after_tokens,
        before_push.get("bytes_by_destination", {}),
        after_push.get("bytes_by_destination", {}),
        holder=a.spec.name,
        context_tokens=full * BLOCK,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )
    checks = []
    for i in sorted(sampled):
        o = outcomes[i]
        if o.sampled is None:
            checks.append({"index": i, "ok": False, "problems": [o.error or "none"]})
            continue
        ref = reference_completion(
            a.url, forks[i], max_tokens=max(1, len(o.sampled.token_ids))
        )
        checks.append(
            {
                "index": i,
                **compare(o.sampled, ref, expected_cached_tokens=None).as_dict(),
            }
        )
    ttfts = [o.ttft_s for o in outcomes if not o.error]
    errors = [o.error for o in outcomes if o.error]
    return {
        "seed_s": seed_s,
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p90_s": quantile(ttfts, 0.9),
        "ttft_max_s": max((t for t in ttfts if t is not None), default=None),
        "errors": len(errors),
        "error_samples": errors[:3],
        "pushes": after_push.get("pushes", 0) - before_push.get("pushes", 0),
        "pushes_ok": after_push.get("ok", 0) - before_push.get("ok", 0),
        "decisions": decisions,
        "checks": checks,
        "outcomes": [
            {k: v for k, v in vars(o).items() if k != "sampled"} for o in outcomes
        ],
        **acct,
    }


def run_arm(arm: str, args, facts: dict, log_dir: Path, contexts) -> dict:
    names = [chr(ord("a") + i) for i in range(args.instances)]
    specs = [
        InstanceSpec(
            name,
            model=facts["path"],
            role="kv_both",
            cores=str(i % 2),
            kv_cache_gib=args.kv_cache_gib,
            max_model_len=args.context + args.suffix + args.output + BLOCK,
            dtype=facts["dtype"],
            env=ARMS[arm],
            extra_args=["--enable-prompt-tokens-details"],
        )
        for i, name in enumerate(names)
    ]
    print(
        f"[fork] {arm}: starting {args.instances} instances (core i % 2); logs in "
        f"{log_dir}",
        flush=True,
    )
    bursts = []
    with Cluster(specs, log_dir, token=TOKEN) as cluster:
        insts = [cluster[n] for n in names]
        model = model_name(insts[0].url)
        warm = PromptSource(facts["vocab_size"], seed=20_000)
        for inst in insts:  # compiled paths warm, on tokens no burst has
            complete(inst.url, warm(300), max_tokens=2, logprobs=None, model=model)
        fresh = PromptSource(facts["vocab_size"], seed=30_000 + args.seed)
        with vllm_router_workers(insts, log_dir, "round_robin") as router:
            for k, context in enumerate(contexts):
                got = burst(
                    insts, router.url, model, context, args, fresh, arm == "push"
                )
                print(
                    f"[fork] {arm} burst {k + 1}/{len(contexts)}: TTFT p50 "
                    f"{got['ttft_p50_s']:.2f} s, p90 {got['ttft_p90_s']:.2f} s, "
                    f"{got['contexts_computed_away']:.1f} contexts computed away from "
                    f"the holder, {got['pushes']} pushes, {got['errors']} errors",
                    flush=True,
                )
                bursts.append(got)
        held = wait_no_blocks_in_use(*(i.url for i in insts), timeout=120)
    ttft = [o["ttft_s"] for b in bursts for o in b["outcomes"] if not o["error"]]
    ratios = [r for b in bursts for r in b["bytes_ratio_by_destination"].values()]
    return {
        "arm": arm,
        "bursts": bursts,
        "requests": sum(len(b["outcomes"]) for b in bursts),
        "errors": sum(b["errors"] for b in bursts),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p90_s": quantile(ttft, 0.9),
        "ttft_max_s": max(ttft, default=None),
        "contexts_computed_away": sum(b["contexts_computed_away"] for b in bursts)
        / len(bursts),
        "computed_tokens": sum(b["computed_tokens"] for b in bursts) / len(bursts),
        "pushes": sum(b["pushes"] for b in bursts),
        "coalesced": sum(b["decisions"].get("coalesced", 0) for b in bursts),
        "destinations_per_burst": [len(b["bytes_by_destination"]) for b in bursts],
        "bytes_ratio_max": max(ratios, default=None),
        "blocks_held_after": list(held),
        "checks": [c for b in bursts for c in b["checks"]],
        "correct": all(c["ok"] for b in bursts for c in b["checks"])
        and not any(b["errors"] for b in bursts),
    }


def targets(rows: dict[str, dict]) -> list[dict]:
    out = []

    def add(name, value, met, why=""):
        out.append({"target": name, "value": value, "met": bool(met), "why": why})

    rec, push = rows.get("recompute"), rows.get("push")
    if rec and push and rec["ttft_p90_s"] and push["ttft_p90_s"]:
        ratio = push["ttft_p90_s"] / rec["ttft_p90_s"]
        add(
            f"push TTFT p90 <= {TTFT_P90_OF_RECOMPUTE:g}x recompute's",
            f"{push['ttft_p90_s']:.2f} / {rec['ttft_p90_s']:.2f} s = {ratio:.2f}x",
            ratio <= TTFT_P90_OF_RECOMPUTE,
            f"contexts computed away from the holder per burst: "
            f"{rec['contexts_computed_away']:.1f} without push, "
            f"{push['contexts_computed_away']:.1f} with",
        )
    if push:
        r = push["bytes_ratio_max"]
        add(
            f"push: bytes to each destination <= {BYTES_PER_DESTINATION_MAX:g}x the "
            "context's KV",
            "-" if r is None else f"at most {r:.2f}x",
            r is not None and r <= BYTES_PER_DESTINATION_MAX,
            f"{push['pushes']:.0f} pushes in {len(push['bursts'])} bursts, to "
            f"{'/'.join(map(str, push['destinations_per_burst']))} destinations a "
            f"burst; {push['coalesced']:.0f} forks coalesced onto another's push",
        )
    return out + [clean_run_target(name, r) for name, r in rows.items()]


TABLE = [
    ("arm", "arm", ""),
    ("requests", "forks", "d"),
    ("errors", "err", "d"),
    ("ttft_p50_s", "TTFT p50 s", ".2f"),
    ("ttft_p90_s", "p90 s", ".2f"),
    ("ttft_max_s", "max s", ".2f"),
    ("contexts_computed_away", "contexts computed away", ".1f"),
    ("computed_tokens", "computed tok/burst", ".0f"),
    ("pushes", "pushes", ".0f"),
    ("coalesced", "coalesced", ".0f"),
    ("bytes_ratio_max", "bytes/dest (x ctx KV)", ".2f"),
]


def plot(rows: list[dict], path: Path, title: str, origin: str) -> Path | None:
    if (made := figure(1, 2, (10, 4))) is None:
        return None
    fig, (a, b) = made
    names = [r["arm"] for r in rows]
    a.boxplot(
        [
            [o["ttft_s"] for bu in r["bursts"] for o in bu["outcomes"] if o["ttft_s"]]
            or [0]
            for r in rows
        ],
        tick_labels=names,
    )
    a.set_ylabel("TTFT of the forks (s)")
    b.bar(names, [r["contexts_computed_away"] for r in rows], color="tab:red")
    b.set_ylabel("contexts computed off the holder, a burst")
    return save_figure(fig, path, title, origin, fontsize=8, wrap=110)


def main(argv: list[str] | None = None) -> int:
    ap = parser("fork", __doc__)
    ap.add_argument("--fork", type=int, default=8, help="forks per burst")
    ap.add_argument("--context", type=int, default=16384, help="shared tokens")
    ap.add_argument("--suffix", type=int, default=256, help="each fork's own tokens")
    ap.add_argument("--output", type=int, default=16, help="tokens each fork decodes")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--bursts", type=int, default=2, help="bursts per arm")
    ap.add_argument("--samples", type=int, default=2, help="forks checked per burst")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_kv_cache_gib()
    ap.add_argument("--deadline-s", type=float, default=600.0)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_seed()
    ap.add_out()
    args = ap.parse_args(argv)
    if args.instances < 2 or args.fork < 1 or args.context < BLOCK:
        ap.error("need --instances >= 2, --fork >= 1 and --context >= one block")
    arms = [a for a in args.arms.split(",") if a]
    if set(arms) - set(ARMS):
        ap.error(f"--arms: no arm {sorted(set(arms) - set(ARMS))} (arms: {list(ARMS)})")
    code = code_version()
    run_id = stamp()
    out = args.out or DEFAULT_RESULTS_DIR / f"fork-{run_id}.json"
    log_dir = out.parent / f"fork-{run_id}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    facts = model_facts(Path(ensure_model(ModelShape(num_layers=args.layers))))
    args.kv_bytes_per_token = facts["kv_bytes_per_token"]
    source = PromptSource(facts["vocab_size"], seed=40_000 + args.seed)
    contexts = [source(args.context) for _ in range(args.bursts)]  # same for both arms
    rows = {arm: run_arm(arm, args, facts, log_dir, contexts) for arm in arms}
    met = targets(rows)
    shared = " (instances a and c share core 0)" if args.instances > 2 else ""
    lines = [
        f"{args.bursts} bursts of {args.fork} forks of a {args.context}-token context "
        f"(+{args.suffix} own tokens, {args.output} decoded) on {args.instances} "
        f"kv_both instances behind vllm-router round_robin{shared}; "
        f"{facts['layers']} layers, context KV {args.context * args.kv_bytes_per_token / 2**20:.0f} MiB"
    ] + [target_line(t) for t in met]
    ordered = [rows[a] for a in arms]
    result = {
        "benchmark": "fork",
        "machine": machine_info(),
        "code": code,
        "model": facts,
        "config": config_of(args),
        "rows": ordered,
        "targets": met,
        "summary": {"lines": lines},
    }
    png = plot(
        ordered,
        out.with_suffix(".png"),
        lines[0],
        provenance(result["machine"], code, run_id),
    )
    return finish("fork", out, result, TABLE, lambda r: r["arm"], png)


if __name__ == "__main__":
    raise SystemExit(main())
