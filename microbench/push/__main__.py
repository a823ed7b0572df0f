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
here (microbench/bandwidth.py, in a child process whose log goes beside the
instances' logs), with the targets
push <= local + 1.25 x bytes / bandwidth + 50 ms and push <= 0.3 x cold.

Write efficiency: C's push stats (GET /push/stats: bytes, entries,
write_seconds) are read around each push, giving the write's seconds, bytes
and entry layout as C saw them. After each length's repetitions, with both
instances idle, the engine writes the same layout (entry count and size)
between two fresh processes pinned like C and D (--c-cores, --d-cores),
through the push's writer (microbench/bandwidth.placed_write_bandwidth).
Reported: C's write seconds and GB/s (bytes / write seconds, medians), the
engine's GB/s with that layout (median), and their ratio (target >= 0.8).
Correctness: one more turn 2 per length with 4 tokens and top-5 logprobs on
D via push, checked against C computing it from scratch (harness.correctness;
D's cached tokens must equal the pushed tokens, unless C wrote nothing because
D's gate judged that push not worth it: then its answer alone is checked, and
"check pushed" says no).

Push or recompute, by length: with --under-load N (on with --full) every size
is measured again while N decode streams run on C and on D each
(microbench/load.py). Per condition the crossover (the shortest prefix from
which on push's TTFT is below recompute's) and the target push <= 0.2x cold at
16k tokens are printed.

The default model here is the generated one with --layers 8 (48 makes a cold
16k-token prefill take minutes on this CPU); the layer count is an option.

    python -m microbench.push [--sizes 8192,16384] [--reps 3] [--under-load 4]
                              [--full] [--layers 8] [--tp 2]
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from pathlib import Path

import httpx

from harness.correctness import compare, reference_completion
from harness.launcher import BLOCK, Cluster, InstanceSpec
from harness.model import ModelShape, ensure_model
from harness.pd_client import (
    RequestFailed,
    complete,
    model_name,
    push_stats,
    wait_for_matched_blocks,
)
from harness.prompts import PromptSource
from microbench.bandwidth import (
    WriteLayout,
    engine_write_bandwidths,
    placed_write_bandwidth_logged,
)
from microbench.common import (
    DEFAULT_RESULTS_DIR,
    code_version,
    config_of,
    finish,
    machine_info,
    median,
    model_facts,
    parser,
    stamp,
    target_line,
)
from microbench.load import DecodeLoad

REQUEST_TIMEOUT_S = 900
WRITE_EFFICIENCY_TARGET = 0.8  # C's write GB/s over the engine's with the same layout
PUSH_OF_COLD_AT_16K = 0.2


def c_push_stats(c) -> dict:
    try:
        stats = push_stats(c.bootstrap_url)
    except RequestFailed as e:
        raise RuntimeError(
            f"C serves no push stats ({e}): is the patch series applied "
            "(python build.py apply)?"
        ) from e
    if "write_seconds" not in stats:
        raise RuntimeError(
            f"C's /push/stats has no write stats ({stats!r}): is the patch "
            "series applied (python build.py apply)?"
        )
    return stats


def write_of(before: dict, after: dict) -> dict:
    """C's write between two snapshots of its push stats (one push in between)."""
    return {
        "bytes": after["bytes"] - before["bytes"],
        "entries": after["entries"] - before["entries"],
        "seconds": after["write_seconds"] - before["write_seconds"],
    }


def write_efficiency(writes: list[dict], engine: dict | None) -> dict:
    """Medians of C's writes (those that moved bytes) against the engine's bandwidth
    with the same layout."""
    moved = [w for w in writes if w["bytes"] > 0 and w["seconds"] > 0]
    if not moved:
        return {
            "write_s": None,
            "write_gb_per_s": None,
            "write_entries": None,
            "write_entry_kib": None,
            "engine_layout_gb_per_s": None,
            "write_over_engine": None,
        }
    gbps = median([w["bytes"] / w["seconds"] / 1e9 for w in moved])
    entries = median([w["entries"] for w in moved])
    out = {
        "write_s": median([w["seconds"] for w in moved]),
        "write_gb_per_s": gbps,
        "write_entries": entries,
        "write_entry_kib": median([w["bytes"] / w["entries"] / 1024 for w in moved]),
        "engine_layout_gb_per_s": engine["gb_per_s"] if engine else None,
    }
    out["write_over_engine"] = gbps / engine["gb_per_s"] if engine else None
    return out


def one_session(
    c,
    d,
    prompts,
    n: int,
    args,
    cm: str,
    dm: str,
    *,
    logprobs: int | None,
    max_tokens: int,
) -> dict:
    turn1 = prompts(n)
    out1 = complete(
        c.url,
        turn1,
        max_tokens=args.turn1_output,
        logprobs=None,
        model=cm,
        timeout=REQUEST_TIMEOUT_S,
    )
    turn2 = turn1 + out1.token_ids + prompts(args.new_tokens)
    # the last output token's KV is not computed by turn 1
    m = wait_for_matched_blocks(
        c.bootstrap_url, turn2, (len(turn1) + len(out1.token_ids) - 1) // BLOCK
    )
    before = c_push_stats(c)
    push = complete(
        d.url,
        turn2,
        max_tokens=max_tokens,
        logprobs=logprobs,
        model=dm,
        kv_transfer_params={"push_from": c.bootstrap_url},
        timeout=REQUEST_TIMEOUT_S,
    )
    write = write_of(before, c_push_stats(c))
    return {
        "turn2": turn2,
        "match": m,
        "push": push,
        "write": write,
        # C wrote nothing: D did not ask (its gate judged the push not worth it)
        # and prefilled the turn itself
        "declined": write["bytes"] == 0,
    }


def measure_size(
    c, d, prompts, n: int, args, cm: str, dm: str, facts: dict, probe_log: Path
) -> dict:
    ttft = {"push": [], "local": [], "cold": []}
    matched, pushed, total_blocks, hit, writes = [], [], [], [], []
    for rep in range(args.reps):
        s = one_session(c, d, prompts, n, args, cm, dm, logprobs=None, max_tokens=1)
        local = complete(
            c.url,
            s["turn2"],
            max_tokens=1,
            logprobs=None,
            model=cm,
            timeout=REQUEST_TIMEOUT_S,
        )
        cold = complete(
            d.url,
            s["turn2"],
            max_tokens=1,
            logprobs=None,
            model=dm,
            cache_salt=f"cold-{uuid.uuid4().hex}",
            timeout=REQUEST_TIMEOUT_S,
        )
        ttft["push"].append(s["push"].latency_s)
        ttft["local"].append(local.latency_s)
        ttft["cold"].append(cold.latency_s)
        matched.append(s["match"]["matched_blocks"])
        total_blocks.append(s["match"]["total_full_blocks"])
        cached = s["push"].cached_tokens or 0
        pushed.append(cached // BLOCK)
        hit.append(cached / len(s["turn2"]))
        writes.append(w := s["write"])
        print(
            f"[push] n={n} rep {rep + 1}/{args.reps}: push {ttft['push'][-1]:.3f}s local "
            f"{ttft['local'][-1]:.3f}s cold {ttft['cold'][-1]:.3f}s; matched "
            f"{matched[-1]}/{total_blocks[-1]} blocks, D cached {cached} tokens; C wrote "
            f"{w['bytes'] / 2**20:.0f} MiB in {w['entries']} entries in {w['seconds']:.3f}s",
            flush=True,
        )
    engine = engine_same_layout(writes, args, probe_log)
    # correctness on a fresh session: D's tokens/logprobs via push vs C from scratch
    s = one_session(c, d, prompts, n, args, cm, dm, logprobs=5, max_tokens=4)
    ref = reference_completion(c.url, s["turn2"], max_tokens=4)
    # NOTE: a push D did not ask for (C wrote nothing) is checked for its answer
    # only: the KV was D's own
    check = compare(
        s["push"],
        ref,
        expected_cached_tokens=None
        if s["declined"]
        else s["match"]["matched_blocks"] * BLOCK,
    )
    pushed_bytes = median(pushed) * BLOCK * facts["kv_bytes_per_token"]
    row = {
        "prefix_len": n,
        "turn2_len": len(s["turn2"]),
        "matched_blocks": median(matched),
        "total_full_blocks": median(total_blocks),
        "pushed_blocks": median(pushed),
        "pushed_over_matched": min(p / m for p, m in zip(pushed, matched))
        if all(matched)
        else 0.0,
        "external_hit_rate": median(hit),
        "ttft_push_s": median(ttft["push"]),
        "ttft_local_s": median(ttft["local"]),
        "ttft_cold_s": median(ttft["cold"]),
        "pushed_bytes": pushed_bytes,
        "correct": check.ok,
        "check_pushed": not s["declined"],
        "problems": check.problems,
        "max_logprob_diff": check.max_logprob_diff,
        "samples": ttft,
        "writes": writes,
        "engine_same_layout": engine,
        **write_efficiency(writes, engine),
    }
    row["push_over_local"] = row["ttft_push_s"] / row["ttft_local_s"]
    row["push_over_cold"] = row["ttft_push_s"] / row["ttft_cold_s"]
    return row


def engine_same_layout(writes: list[dict], args, probe_log: Path) -> dict | None:
    """The engine's bandwidth with the layout of C's (median) write, placed like C and D
    (in a child process whose output is appended to ``probe_log``)."""
    moved = [w for w in writes if w["bytes"] > 0 and w["entries"] > 0]
    if not moved:
        return None
    w = sorted(moved, key=lambda w: w["bytes"])[len(moved) // 2]
    layout = WriteLayout.of_write(w["bytes"], w["entries"])
    probe = placed_write_bandwidth_logged(
        layout,
        log_path=probe_log,
        src_cpus=args.c_cores,
        dst_cpus=args.d_cores,
        protocol=args.protocol,
        reps=max(3, args.reps),
    )
    print(
        f"[push] engine alone, {layout.describe()}, writer on cores {args.c_cores}, reader on "
        f"{args.d_cores}: {probe['gb_per_s']:.2f} GB/s (median of {len(probe['seconds'])})",
        flush=True,
    )
    return probe


def efficiency_lines(ok: list[dict]) -> tuple[bool, list[str]]:
    lines, met = [], True
    for r in ok:
        if r.get("write_over_engine") is None:
            lines.append(f"prefix {r['prefix_len']}: no write measured")
            met = False
            continue
        this = r["write_over_engine"] >= WRITE_EFFICIENCY_TARGET
        met = met and this
        lines.append(
            f"prefix {r['prefix_len']}: C's write {r['write_s']:.3f}s = {r['write_gb_per_s']:.2f} "
            f"GB/s ({r['write_entries']:.0f} entries of {r['write_entry_kib']:.0f} KiB) vs engine "
            f"{r['engine_layout_gb_per_s']:.2f} GB/s with that layout -> "
            f"{r['write_over_engine']:.2f} (target >= {WRITE_EFFICIENCY_TARGET}) "
            f"{'met' if this else 'NOT met'}"
        )
    return met, lines


# An H100 serving an 8B model (Llama-3.1-8B, bf16) over 200-400 Gb/s RDMA, set
# beside this machine's ratio of prefill to transfer time per token. Estimates,
# not measurements: KV 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB a
# token; prefill at a 16k context 40-80 us a token (16 GFLOP a token of weights
# plus attention, at 25-50% of the H100's 989 dense bf16 TFLOPS); the link 25-50
# GB/s. The layer count scales both sides, so the ratio holds for any depth.
H100_8B_PREFILL_US = (40.0, 80.0)
H100_8B_KV_BYTES = 131072
H100_LINK_GB_PER_S = (25.0, 50.0)


def prefill_over_transfer(
    row: dict, bw_gb_per_s: float, kv_bytes_per_token: int
) -> dict:
    """Per token: the cold prefill here (the row's cold TTFT over its prompt) and
    the transfer of its KV at the engine's bandwidth here; their ratio, and the
    same ratio's range for an H100 with an 8B model over RDMA."""
    prefill_us = row["ttft_cold_s"] / row["turn2_len"] * 1e6
    transfer_us = kv_bytes_per_token / (bw_gb_per_s * 1e9) * 1e6
    h100 = [
        p / (H100_8B_KV_BYTES / (g * 1e9) * 1e6)
        for p, g in (
            (H100_8B_PREFILL_US[0], H100_LINK_GB_PER_S[0]),
            (H100_8B_PREFILL_US[1], H100_LINK_GB_PER_S[1]),
        )
    ]
    return {
        "prefill_us_per_token": prefill_us,
        "transfer_us_per_token": transfer_us,
        "ratio": prefill_us / transfer_us,
        "h100_8b_ratio": h100,
    }


def crossover(rows: list[dict]) -> int | None:
    """The shortest prefix from which on pushing beats recomputing: push's TTFT
    below cold's at that length and at every longer one measured (None: at no
    length, or not at the longest)."""
    ok = sorted((r for r in rows if not r.get("error")), key=lambda r: r["prefix_len"])
    best = None
    for r in reversed(ok):
        if r["ttft_push_s"] >= r["ttft_cold_s"]:
            break
        best = r["prefix_len"]
    return best


def condition_lines(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """Per condition (idle, under load): the crossover and the 16k target."""
    targets, lines = [], []
    for cond in dict.fromkeys(r.get("condition", "idle") for r in rows):
        mine = [r for r in rows if r.get("condition", "idle") == cond]
        x = crossover(mine)
        lines.append(
            f"{cond}: push beats recompute from "
            + (f"{x} tokens on" if x is not None else "no length measured")
            + " ("
            + ", ".join(
                f"{r['prefix_len']}: {r['push_over_cold']:.2f}x"
                for r in mine
                if not r.get("error")
            )
            + " of cold)"
        )
        at = [r for r in mine if r["prefix_len"] == 16384 and not r.get("error")]
        if at:
            v = at[0]["push_over_cold"]
            targets.append(
                {
                    "target": f"{cond}: push TTFT <= {PUSH_OF_COLD_AT_16K:g}x recompute's "
                    "at 16k tokens",
                    "value": f"{at[0]['ttft_push_s']:.3f} / {at[0]['ttft_cold_s']:.3f} s "
                    f"= {v:.2f}x",
                    "met": v <= PUSH_OF_COLD_AT_16K,
                    "why": "",
                }
            )
    return targets, lines


def summarize(rows: list[dict], bw: dict, kv_bytes_per_token: int) -> dict:
    loaded = [r for r in rows if r.get("condition", "idle") != "idle"]
    targets, cond_lines = condition_lines(rows)
    rows = [r for r in rows if r.get("condition", "idle") == "idle"]
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
    out["write_efficiency_met"], eff_lines = efficiency_lines(ok)
    ratio = prefill_over_transfer(top, bw["gb_per_s"], kv_bytes_per_token)
    out["prefill_over_transfer"] = ratio
    eff_lines.append(
        f"per token at {top['prefix_len']}: prefill {ratio['prefill_us_per_token']:.0f} us "
        f"here, KV transfer {ratio['transfer_us_per_token']:.1f} us at the engine's "
        f"bandwidth: ratio {ratio['ratio']:.0f}x (an H100 with an 8B model over 200-400 "
        f"Gb/s RDMA: about {ratio['h100_8b_ratio'][0]:.0f}-"
        f"{ratio['h100_8b_ratio'][1]:.0f}x, estimated; push gains less there)"
    )
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
        *eff_lines,
        *cond_lines,
        *(target_line(t) for t in targets),
    ]
    out["targets"] = targets
    out["under_load_rows"] = len(loaded)
    return out


TABLE = [
    ("condition", "condition", ""),
    ("prefix_len", "prefix", "d"),
    ("turn2_len", "turn2", "d"),
    ("matched_blocks", "matched", ".0f"),
    ("total_full_blocks", "of blocks", ".0f"),
    ("pushed_blocks", "pushed", ".0f"),
    ("external_hit_rate", "ext hit", ".2f"),
    ("mib", "MiB", ".0f"),
    ("ttft_local_s", "local s", ".3f"),
    ("ttft_push_s", "push s", ".3f"),
    ("ttft_cold_s", "cold s", ".3f"),
    ("push_over_local", "push/local", ".2f"),
    ("push_over_cold", "push/cold", ".2f"),
    ("write_s", "write s", ".3f"),
    ("write_gb_per_s", "write GB/s", ".2f"),
    ("write_entries", "entries", ".0f"),
    ("engine_layout_gb_per_s", "engine GB/s", ".2f"),
    ("write_over_engine", "write/engine", ".2f"),
    ("correct", "correct", ""),
    ("check_pushed", "check pushed", ""),
]


def main(argv: list[str] | None = None) -> int:
    ap = parser("push", __doc__)
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model dir (default: generated, --layers)",
    )
    ap.add_argument(
        "--layers", type=int, default=8, help="layers of the generated default model"
    )
    ap.add_argument(
        "--full",
        action="store_true",
        help="the long sweep: sizes 2048 to 32768, 5 reps, idle and under load",
    )
    ap.add_argument(
        "--sizes",
        default=None,
        help="turn-1 prompt lengths (default 8192,16384: the sizes the bound is "
        "checked at; --full adds 2048)",
    )
    ap.add_argument("--reps", type=int, default=None, help="default 3 (--full: 5)")
    ap.add_argument(
        "--under-load",
        type=int,
        default=None,
        metavar="STREAMS",
        help="measure every size again with this many decode streams running on C "
        "and on D each (microbench/load.py; --full: 4)",
    )
    ap.add_argument("--turn1-output", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--protocol", default="tcp")
    ap.add_kv_cache_gib()
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--c-cores", default="0")
    ap.add_argument("--d-cores", default="1")
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks of C and of D (each rank its own core: with 2, "
        "C's and D's ranks share cores 0 and 1; C's write figures are rank 0's)",
    )
    ap.add_seed()
    ap.add_out(help="JSON path (default results/push-<time>.json)")
    args = ap.parse_args(argv)
    args.sizes = [
        int(s)
        for s in (
            args.sizes or ("2048,4096,8192,16384,32768" if args.full else "8192,16384")
        ).split(",")
    ]
    args.reps = args.reps or (5 if args.full else 3)
    code = code_version()  # the code this process runs: edits made later do not
    if args.under_load is None and args.full:
        args.under_load = 4

    model_dir = args.model or ensure_model(ModelShape(num_layers=args.layers))
    facts = model_facts(Path(model_dir))
    run_id = stamp()
    out = args.out or DEFAULT_RESULTS_DIR / f"push-{run_id}.json"
    max_len = max(args.sizes) + args.turn1_output + args.new_tokens + BLOCK
    largest = (
        (max(args.sizes) + args.turn1_output)
        // BLOCK
        * BLOCK
        * facts["kv_bytes_per_token"]
    )
    print(
        f"[push] model {facts['path']} ({facts['layers']} layers, "
        f"{facts['kv_bytes_per_token'] / 1024:.0f} KiB KV/token); sizes {args.sizes}; reps {args.reps}",
        flush=True,
    )
    log_dir = out.parent / f"push-{run_id}-logs"
    probe_log = log_dir / "engine-probe.log"
    [bw] = engine_write_bandwidths(
        [(largest, 1 << 20)], args.protocol, log_path=probe_log
    )
    print(
        f"[push] the transfer engine's bandwidth: {bw['gb_per_s']:.2f} GB/s (engine log: "
        f"{probe_log})",
        flush=True,
    )

    common = dict(
        model=facts["path"],
        protocol=args.protocol,
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=max_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=facts["dtype"],
        extra_args=["--enable-prompt-tokens-details"]
        + (["--tensor-parallel-size", str(args.tp)] if args.tp > 1 else []),
    )
    # TP > 1: one core per rank, as the CPU backend binds them (the engine's probe
    # stays on --c-cores and --d-cores)
    ranks = "|".join(map(str, range(args.tp)))
    c_cores, d_cores = (ranks, ranks) if args.tp > 1 else (args.c_cores, args.d_cores)
    specs = [
        InstanceSpec("c", role="kv_producer", cores=c_cores, **common),
        InstanceSpec("d", role="kv_consumer", cores=d_cores, **common),
    ]
    prompts = PromptSource(facts["vocab_size"], seed=args.seed)
    rows = []
    print(
        f"[push] starting C (cores {c_cores}) and D (cores {d_cores}); logs in "
        f"{log_dir}",
        flush=True,
    )
    with Cluster(specs, log_dir) as cluster:
        c, d = cluster["c"], cluster["d"]
        cm, dm = model_name(c.url), model_name(d.url)
        one_session(
            c, d, prompts, 256, args, cm, dm, logprobs=None, max_tokens=1
        )  # warm-up
        conditions = [("idle", None)] + (
            [(f"{args.under_load} decode streams on C and D", args.under_load)]
            if args.under_load
            else []
        )
        for cond, streams in conditions:
            with contextlib.ExitStack() as loaded:
                for inst, m in ((c, cm), (d, dm)) if streams else ():
                    loaded.enter_context(
                        DecodeLoad(inst.url, m, streams, facts["vocab_size"])
                    )
                for n in args.sizes:
                    print(f"[push] {cond}, prefix {n}", flush=True)
                    try:
                        row = measure_size(
                            c, d, prompts, n, args, cm, dm, facts, probe_log
                        )
                    except (RequestFailed, httpx.HTTPError) as e:
                        print(f"[push] n={n}: FAILED: {e}", file=sys.stderr, flush=True)
                        row = {"prefix_len": n, "error": str(e), "correct": False}
                    rows.append(row | {"condition": cond})
        c_stats = c_push_stats(c)
    for r in rows:
        if not r.get("error"):
            r["mib"] = r["pushed_bytes"] / 2**20
    result = {
        "benchmark": "push",
        "machine": machine_info(),
        "code": code,
        "model": facts,
        "config": config_of(args),
        "engine_bandwidth": bw,
        "c_push_stats": c_stats,
        "rows": rows,
    }
    result["summary"] = summarize(rows, bw, facts["kv_bytes_per_token"])
    return finish("push", out, result, TABLE, lambda r: r["prefix_len"])


if __name__ == "__main__":
    raise SystemExit(main())
