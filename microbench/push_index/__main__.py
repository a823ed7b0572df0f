"""push_index: what D's prefix push index costs its scheduler per lookup.

``HolderIndex.best()`` (connector/push/decode_index.py) runs on D's scheduler
for a request with ``push_from: "auto"``: per distinct hash configuration among
the sources, it hashes the prompt one block at a time and looks each block up in
the sets (64-bit ``hash()`` values) of the sources of that configuration still
holding the prompt, and stops at the first block none of them holds. A prompt
nobody holds costs one block's hashing per configuration; a held run of ``r``
blocks costs ``r`` blocks' hashing, plus one if the prompt has more full blocks.
This bench fills real indexes (bench.py: block-pool keys of random prompts,
through FeedPage and ``apply()`` in pages of at most 65,536 events) of 100,000
and 1,000,000 blocks over 1 source, 3 sources sharing one hash configuration and
3 sources with one each (vLLM's default: NONE_HASH is random per process), and
per index reports:

  fill        keys/s through apply() (and through FeedPage's JSON validation)
  memory      bytes per indexed block: sys.getsizeof (each set plus each int in
              it); tracemalloc's retained bytes of a further fill as a cross-check
              (the smallest size; --full: every size)
  lookups     per prompt (1,024 and 8,192 tokens, block size 16), a hit of the
              whole prompt on one source and a miss at block 0: best() median,
              p10, p90; the hashing of exactly the blocks best() hashes; the walk
              (best()'s loop, held_runs, with those hashes made; ns per set
              lookup); and, as a reference best() does not run, the hashing of
              every full block once per configuration (what stopping early saves)

    python -m microbench.push_index [--quick | --full] [--seed 0]
        -> docs/results/<date>-push-index.{json,md,png} (--full: -push-index-full)
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from microbench.common import (
    PROJECT_ROOT,
    figure,
    format_table,
    machine_info,
    parser,
    save_figure,
    write_json,
)

TAG = "push-index"
RESULTS_DIR = PROJECT_ROOT / "docs" / "results"
MEASURED = ("connector/push/decode_index.py", "connector/hashsync/hashing.py")
QUICK = {
    "sizes": (100_000, 1_000_000),
    "layouts": ((1, 1), (3, 1), (3, 3)),
    "prompts": (1_024, 8_192),
    "calls": 200,
    "warmup": 20,
    "fill_repeats": 2,
    "traced_sizes": (100_000,),
}
FULL = {
    **QUICK,
    "prompts": (1_024, 8_192, 32_768),
    "calls": 1_000,
    "warmup": 100,
    "fill_repeats": 5,
    "traced_sizes": None,
}

INDEX_TABLE = [
    ("size", "blocks", ","),
    ("layout", "sources / configs", ""),
    ("pages", "pages", "d"),
    ("apply_kps", "apply() keys/s", ",.0f"),
    ("validate_kps", "FeedPage keys/s", ",.0f"),
    ("so_bpb", "B/block (getsizeof)", ".1f"),
    ("so_mib", "MiB (getsizeof)", ".1f"),
    ("tm_bpb", "B/block (tracemalloc)", ".1f"),
    ("correct", "correct", ""),
]
LOOKUP_TABLE = [
    ("size", "blocks", ","),
    ("layout", "sources / configs", ""),
    ("prompt_tokens", "prompt", ","),
    ("case", "case", ""),
    ("answer_blocks", "answer", ""),
    ("best_med", "best() us med", ",.1f"),
    ("best_p10", "p10", ",.1f"),
    ("best_p90", "p90", ",.1f"),
    ("blocks_hashed", "blocks hashed", "d"),
    ("hash_med", "hashing us", ",.1f"),
    ("walk_med", "walk us", ",.2f"),
    ("diff_med", "best-hashing us", ",.2f"),
    ("lookups", "set lookups", "d"),
    ("walk_ns", "walk ns/lookup", ".1f"),
    ("hash_us_block", "hashing us/block", ".2f"),
    ("whole_blocks", "whole-prompt blocks", "d"),
    ("whole_med", "whole-prompt hashing us", ",.1f"),
    ("correct", "correct", ""),
]


def index_display(rows: list[dict]) -> list[dict]:
    return [
        {
            **r,
            "apply_kps": r["apply_keys_per_s"]["median"],
            "validate_kps": r["validate_keys_per_s"]["median"],
            "so_bpb": r["getsizeof_bytes_per_block"],
            "so_mib": r["getsizeof_bytes"] / 2**20,
            "tm_bpb": r["tracemalloc_bytes_per_block"],
        }
        for r in rows
    ]


def lookup_display(rows: list[dict]) -> list[dict]:
    return [
        {
            **r,
            "answer_blocks": "none"
            if r["answer"] is None
            else f"{r['answer']['blocks']} on {r['answer']['origin'].split('//')[-1].split(':')[0]}",
            "best_med": r["best_s"]["median"] * 1e6,
            "best_p10": r["best_s"]["p10"] * 1e6,
            "best_p90": r["best_s"]["p90"] * 1e6,
            "hash_med": r["hash_s"]["median"] * 1e6,
            "walk_med": r["walk_s"]["median"] * 1e6,
            "diff_med": r["best_minus_hash_s"]["median"] * 1e6,
            "whole_blocks": r["whole_prompt_blocks"],
            "whole_med": r["whole_prompt_hash_s"]["median"] * 1e6,
            # a miss makes one lookup per source: its time is the walk's fixed cost
            "walk_ns": r["walk_ns_per_lookup"] if r["case"] == "hit" else None,
            "hash_us_block": r["hash_us_per_block"],
        }
        for r in rows
    ]


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    lines = [
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "|".join(" --- " for _ in columns) + "|",
    ]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt) if fmt else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def marginal_walk_ns(rows: list[dict]) -> dict[tuple[int, str], float]:
    """Per (size, layout): the walk's cost of one more set lookup, from its hits of
    the shortest and the longest prompt (the walk's fixed cost cancels)."""
    out = {}
    for key in dict.fromkeys((r["size"], r["layout"]) for r in rows):
        hits = sorted(
            (r for r in rows if (r["size"], r["layout"]) == key and r["case"] == "hit"),
            key=lambda r: r["lookups"],
        )
        if len(hits) >= 2 and hits[-1]["lookups"] > hits[0]["lookups"]:
            out[key] = (
                (hits[-1]["walk_s"]["median"] - hits[0]["walk_s"]["median"])
                * 1e9
                / (hits[-1]["lookups"] - hits[0]["lookups"])
            )
    return out


def summary_lines(result: dict) -> list[str]:
    """The headline numbers: per size, the costliest lookup and the walk's share."""
    lines = []
    marginal = marginal_walk_ns(result["lookups"])
    for size in dict.fromkeys(r["size"] for r in result["lookups"]):
        rows = [r for r in result["lookups"] if r["size"] == size]
        worst = max(rows, key=lambda r: r["best_s"]["median"])
        walk = [ns for (sz, _), ns in marginal.items() if sz == size] or [float("nan")]
        share = max(r["walk_s"]["median"] / r["best_s"]["median"] for r in rows)
        lines.append(
            f"{size:,} blocks: the costliest lookup is {worst['prompt_tokens']:,} tokens "
            f"{worst['case']} over {worst['layout']}: best() median "
            f"{worst['best_s']['median'] * 1e3:.2f} ms (p10 "
            f"{worst['best_s']['p10'] * 1e3:.2f}, p90 {worst['best_s']['p90'] * 1e3:.2f}); "
            f"the walk is at most {share:.1%} of a best() call, "
            f"{min(walk):.0f}-{max(walk):.0f} ns per further set lookup (the hits' "
            f"walks of the longest less the shortest prompt, per layout)"
        )
        misses = [r for r in rows if r["case"] == "miss"]
        if misses:
            miss = max(misses, key=lambda r: r["whole_prompt_hash_s"]["median"])
            lines.append(
                f"{size:,} blocks: a miss at block 0 of {miss['prompt_tokens']:,} "
                f"tokens over {miss['layout']} costs best() "
                f"{miss['best_s']['median'] * 1e6:,.1f} us median, hashing "
                f"{miss['blocks_hashed']} block(s); hashing every full block once per "
                f"configuration ({miss['whole_prompt_blocks']:,} blocks, not done "
                f"by best()) would cost {miss['whole_prompt_hash_s']['median'] * 1e6:,.1f} us"
            )
    for r in result["indexes"]:
        if r["size"] == max(x["size"] for x in result["indexes"]):
            lines.append(
                f"{r['size']:,} blocks over {r['layout']}: "
                f"{r['getsizeof_bytes'] / 2**20:.1f} MiB "
                f"({r['getsizeof_bytes_per_block']:.1f} B/block, getsizeof), filled at "
                f"{r['apply_keys_per_s']['median']:,.0f} keys/s through apply() "
                f"(median of {len(r['apply_s'])} fills)"
            )
    return lines


def git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name":
                    return val.strip()
    except OSError:
        pass
    return None


def machine(date: str) -> dict:
    import vllm

    status = git("status", "--porcelain")
    return {
        **machine_info(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "vllm": vllm.__version__,
        "date": date,
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(status),
        # the measured code as it was in the tree (it may differ from the commit)
        "measured_sha256": {
            p: hashlib.sha256((PROJECT_ROOT / p).read_bytes()).hexdigest()[:16]
            for p in MEASURED
            if (PROJECT_ROOT / p).exists()
        },
        "measured_uncommitted": [
            p for p in MEASURED if any(line[3:] == p for line in status.splitlines())
        ],
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "loadavg_start": None,
        "loadavg_end": None,
    }


def plot(result: dict, path: Path, title: str, origin: str) -> Path | None:
    if (made := figure(1, 3, (16, 5), tag=TAG)) is None:
        return None
    fig, (a, b, c) = made
    rows = result["lookups"]
    labels = [
        f"{r['size'] // 1000:,}k {r['sources']}s/{r['configs']}c "
        f"{r['prompt_tokens']} {r['case']}"
        for r in rows
    ]
    x = range(len(rows))
    med = [r["best_s"]["median"] * 1e6 for r in rows]
    a.errorbar(
        x,
        med,
        yerr=[
            [m - r["best_s"]["p10"] * 1e6 for m, r in zip(med, rows)],
            [r["best_s"]["p90"] * 1e6 - m for m, r in zip(med, rows)],
        ],
        fmt="o",
        capsize=2,
        label="best() (median, p10-p90)",
    )
    a.plot(
        x,
        [r["hash_s"]["median"] * 1e6 for r in rows],
        "x",
        label="hashing of the blocks best() hashes",
    )
    a.plot(
        x,
        [r["walk_s"]["median"] * 1e6 for r in rows],
        "s",
        ms=4,
        label="walk (best()'s loop, hashes made)",
    )
    a.plot(
        x,
        [r["whole_prompt_hash_s"]["median"] * 1e6 for r in rows],
        "+",
        label="whole-prompt hashing (reference, not in best())",
    )
    a.set_xticks(list(x), labels, rotation=90, fontsize=6)
    a.set_yscale("log")
    a.set_ylabel("one lookup (us)")
    a.grid(True, alpha=0.3, which="both")
    a.legend(fontsize=7)
    for layout in dict.fromkeys(r["layout"] for r in rows):
        for tokens in dict.fromkeys(r["prompt_tokens"] for r in rows):
            sel = [
                r
                for r in rows
                if r["layout"] == layout
                and r["prompt_tokens"] == tokens
                and r["case"] == "hit"
            ]
            b.plot(
                [r["size"] for r in sel],
                [r["walk_ns_per_lookup"] for r in sel],
                marker="o",
                label=f"{layout}, {tokens:,} tok hit",
            )
    b.set_xscale("log")
    b.set_xlabel("indexed blocks")
    b.set_ylabel("walk: ns per set lookup (median)")
    b.set_ylim(bottom=0)
    b.grid(True, alpha=0.3)
    b.legend(fontsize=7)
    idx = result["indexes"]
    c2 = c.twinx()
    for layout in dict.fromkeys(r["layout"] for r in idx):
        sel = [r for r in idx if r["layout"] == layout]
        sizes = [r["size"] for r in sel]
        (line,) = c.plot(
            sizes,
            [r["getsizeof_bytes_per_block"] for r in sel],
            marker="o",
            label=f"{layout}: B/block (getsizeof)",
        )
        traced = [r for r in sel if r["tracemalloc_bytes_per_block"] is not None]
        c.plot(
            [r["size"] for r in traced],
            [r["tracemalloc_bytes_per_block"] for r in traced],
            marker="x",
            linestyle="",
            color=line.get_color(),
            label=f"{layout}: B/block (tracemalloc)",
        )
        c2.plot(
            sizes,
            [r["apply_keys_per_s"]["median"] / 1e3 for r in sel],
            marker="s",
            linestyle="--",
            color=line.get_color(),
            label=f"{layout}: fill k keys/s",
        )
    c.set_xscale("log")
    c.set_xlabel("indexed blocks")
    c.set_ylabel("bytes per indexed block")
    c.set_ylim(bottom=0)
    c2.set_ylabel("fill: thousand keys/s through apply() (dashed)")
    c2.set_ylim(bottom=0)
    c.grid(True, alpha=0.3)
    c.legend(fontsize=6, loc="lower left")
    return save_figure(fig, path, title, origin)


def markdown(result: dict, json_name: str, png_name: str | None) -> str:
    m = result["machine"]
    plan = result["config"]
    la = m.get("loadavg_start"), m.get("loadavg_end")
    lines = [
        f"# Push index lookups on D's scheduler ({m['date']})",
        "",
        f"- Machine: {m.get('cpu_model')}, {m['cores']} cores, {m.get('mem_gib')} GiB; "
        f"Python {m['python']}, vLLM {m['vllm']}.",
        f"- Code: commit {m['commit']}{' with uncommitted changes' if m['dirty'] else ''}"
        + (
            f" (measured files changed since it: {', '.join(m['measured_uncommitted'])}; "
            f"their sha256 prefixes are in the JSON)"
            if m["measured_uncommitted"]
            else ""
        )
        + ".",
        f"- Command: `{result['command']}` ({result['seconds']:.0f} s)"
        + (
            f", LD_PRELOAD of {', '.join(Path(x).name for x in preload.split(':'))}."
            if (preload := m.get("ld_preload"))
            else "."
        ),
        f"- Load average (1 min) at the start {la[0]}, at the end {la[1]}."
        + (f" {result['note']}" if result.get("note") else ""),
        f"- Data: [{json_name}]({json_name})"
        + (f", plot [{png_name}]({png_name})" if png_name else "")
        + ".",
        "",
        "## Method",
        "",
        f"- Keys: block-pool keys (`to_pool_key(hash_prompt_blocks(...), 0)`, "
        f"{plan['hash_algo']}, block size {plan['block_size']}) of random prompts; "
        "one random NONE_HASH per hash configuration. Sources sharing a "
        "configuration hold disjoint keys. Source 0 also holds every block of the hit "
        "prompt.",
        f"- Fill: FeedPage JSON pages of at most {plan['page_events']:,} events, "
        "`FeedPage.model_validate_json` then `HolderIndex.apply`; each timed, "
        f"JSON encoding not. Median over {plan.get('fill_repeats', 1)} fills of a "
        "fresh index. `apply()` takes the index's lock once per slice of "
        + (f"{plan['apply_slice']:,}" if plan.get("apply_slice") else "`APPLY_SLICE`")
        + " keys; the rate is over whole `apply()` calls (the longest single "
        "hold of the lock is not measured).",
        "- Memory: `sys.getsizeof` of each source's set (its hash table) plus of each "
        "int in it, over the indexed blocks. Cross-check where the table has it: "
        "tracemalloc's bytes retained by a further fill of a fresh index, pages "
        "dropped. Both count the sizes Python asks for, not the allocator's rounding "
        "(pymalloc gives a 36-byte int 40).",
        f"- Lookups: {plan['calls']} timed iterations after {plan['warmup']}, each "
        "timing `best(tokens, None, None, 0)`, then the hashing best() does, then "
        "the walk, then the whole-prompt hashing. The garbage collector's heap is "
        "frozen first, as vLLM's engine core does after start-up, and the "
        "collector stays on.",
        "- `best()` hashes the prompt one block at a time per distinct hash "
        "configuration among the sources and stops at the first block no source of "
        "that configuration still holds. `hashing` hashes exactly those blocks: "
        "per configuration, up to the longest run a source of it holds, plus one "
        "block when the prompt has more full blocks (one block on a miss at block "
        "0), drawn one at a time from `iter_prompt_block_hashes`, each made "
        "`hash(to_pool_key(h, 0))`. `blocks hashed` is their sum over "
        "configurations; each row checks it against the blocks best() itself "
        "draws (one untimed call with its `iter_prompt_block_hashes` wrapped to "
        "count).",
        "- `walk` is best()'s loop (`held_runs`) over the same sets with those hashes "
        "made: block by block, the sources of a configuration still holding the "
        "prompt, until none does; the longest run wins (its answer is checked "
        "against best()'s). `set lookups` are that loop's: per block hashed, one "
        "per source of the configuration still holding the prompt. "
        "`best-hashing` is the median of the paired differences: the walk plus "
        "what best() does around it (its lock while it groups the sources, the "
        "generator's steps).",
        "- `whole-prompt hashing` is a reference, not a part of best(): what "
        "hashing every full block of the prompt once per configuration (the same "
        "way) costs. Against `hashing` it shows what stopping early saves.",
        "- A hit: source 0 holds every block of the prompt, so its configuration "
        "hashes the whole prompt and each other configuration one block. A miss "
        "misses at block 0 on every source: one block hashed per configuration, "
        "one set lookup per source.",
        "",
        "## Indexes",
        "",
        markdown_table(index_display(result["indexes"]), INDEX_TABLE),
        "",
        "## Lookups",
        "",
        "Times in microseconds. `answer` is what best() returned: blocks held on "
        "which source, or none.",
        "",
        markdown_table(lookup_display(result["lookups"]), LOOKUP_TABLE),
        "",
        "## Summary",
        "",
        *[f"- {line}" for line in result["summary"]["lines"]],
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser("push_index", __doc__)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help="the default: 200 lookups per row, 2 timed fills per index",
    )
    mode.add_argument(
        "--full",
        action="store_true",
        help="1,000 lookups per row, 32,768-token prompts too, 5 timed fills, "
        "tracemalloc at every size",
    )
    ap.add_seed()
    ap.add_argument("--hash-algo", default="sha256")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--note", default="", help="a sentence for the results page")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    date = datetime.date.today().isoformat()

    def progress(message: str) -> None:
        print(f"[{TAG} {time.monotonic() - t_start:6.1f}s] {message}", flush=True)

    progress("importing vLLM and the connector")
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_index import (
        APPLY_SLICE,
    )

    from .bench import BLOCK_SIZE, Layout, Plan, run

    preset = FULL if args.full else QUICK
    plan = Plan(
        sizes=preset["sizes"],
        layouts=[Layout(*lay) for lay in preset["layouts"]],
        prompts=preset["prompts"],
        calls=preset["calls"],
        warmup=preset["warmup"],
        fill_repeats=preset["fill_repeats"],
        traced_sizes=preset["traced_sizes"],
        hash_algo=args.hash_algo,
        seed=args.seed,
    )
    # as vLLM's EngineCore does after start-up (freeze_gc_heap): the objects made so
    # far leave the collector's generations, as they do in D's scheduler
    gc.collect()
    gc.freeze()
    m = machine(date)
    m["loadavg_start"] = round(os.getloadavg()[0], 2)
    progress(
        f"{len(plan.sizes) * len(plan.layouts)} indexes x {len(plan.prompts) * 2} "
        f"lookup rows, {plan.calls} calls each (commit {m['commit']}"
        f"{', dirty' if m['dirty'] else ''})"
    )
    measured = run(plan, progress)
    m["loadavg_end"] = round(os.getloadavg()[0], 2)
    name = f"{date}-{TAG}" + ("-full" if args.full else "")
    out = args.out_dir / f"{name}.json"
    argv_shown = sys.argv[1:] if argv is None else argv
    result = {
        "benchmark": TAG,
        "machine": m,
        "command": shlex.join(["python", "-m", "microbench.push_index", *argv_shown]),
        "note": args.note,
        "config": {
            "mode": "full" if args.full else "quick",
            "sizes": list(plan.sizes),
            "layouts": [[lay.sources, lay.configs] for lay in plan.layouts],
            "prompts": list(plan.prompts),
            "calls": plan.calls,
            "warmup": plan.warmup,
            "fill_repeats": plan.fill_repeats,
            "traced_sizes": None
            if plan.traced_sizes is None
            else list(plan.traced_sizes),
            "hash_algo": plan.hash_algo,
            "block_size": BLOCK_SIZE,
            "page_events": plan.page_events,
            "apply_slice": APPLY_SLICE,
            "seed": plan.seed,
        },
        **measured,
        "walk_marginal_ns_per_lookup": [
            {"size": size, "layout": layout, "ns": ns}
            for (size, layout), ns in marginal_walk_ns(measured["lookups"]).items()
        ],
        "seconds": time.monotonic() - t_start,
    }
    result["summary"] = {"lines": summary_lines(result)}
    return report(result, out)


def report(result: dict, out: Path) -> int:
    """Write the JSON, the page and the plot next to it; print the tables."""
    m = result["machine"]
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(
        result,
        out.with_suffix(".png"),
        f"HolderIndex.best(), vLLM {m['vllm']}; load avg "
        f"{m.get('loadavg_start')} -> {m.get('loadavg_end')}",
        f"{m['cores']}-core {m.get('cpu_model')}; commit {m['commit']}"
        f"{' with changes' if m['dirty'] else ''}; {m['date']}",
    )
    write_json(out, result)
    md = out.with_suffix(".md")
    md.write_text(markdown(result, out.name, png.name if png else None))
    print()
    print(format_table(index_display(result["indexes"]), INDEX_TABLE))
    print()
    print(format_table(lookup_display(result["lookups"]), LOOKUP_TABLE))
    print()
    for line in result["summary"]["lines"]:
        print(line)
    print(f"\n[{TAG}] wrote {out}, {md}" + (f" and {png}" if png else ""))
    bad = [r for r in result["indexes"] + result["lookups"] if not r["correct"]]
    if bad:
        print(
            f"[{TAG}] WRONG: {len(bad)} rows (see 'correct' in the JSON)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
