"""Sessions: what prefix push buys on a production trace, against offered load.

A window of whole conversations from a Mooncake-format trace (by default the
production conversation trace in ../shared/traces, at its own scale: 512 tokens a
block id, the window's median prompt about 9k tokens and its longest 29k;
microbench/sessions/trace.py holds the window and the scaling) is replayed on
its own clock on two ``kv_both`` instances (core 0 and core 1), at a series of
offered loads (--loads, sessions starting a minute; each load the same sessions,
evenly spaced, each keeping its turns' gaps, and no turn sent before the turn
before it has answered: an agent's next call follows the answer), in arms:

  sticky            each session's turns sent straight to one instance: every
                    turn after the first finds its prefix in the local cache (the
                    best a session-affine router could do)
  rr                vllm-router --policy round_robin in front: a turn lands on the
                    instance that served the previous one only by chance
  p2c               vllm-router --policy power_of_two (load-aware)
  cache_aware       vllm-router --policy cache_aware (its own prefix tree)
  <policy>+push     the same, with prefix push on both instances (MOONCAKE_PUSH_AUTO=1)
  kv_aware          vllm-router --policy kv_aware, fed by both instances' KV events
                    (through a loopback forwarder each; harness.routers)
  kv_aware+push     the same with prefix push
  pd-layerwise      P/D: a kv_producer (core 0) and a kv_consumer (core 1), every
                    turn sent to both at once (as upstream's P/D proxy does), P
                    writing each layer's KV as soon as it is computed
  pd-posthoc        the same, P writing the KV once its prefill has ended

By default sticky, rr and rr+push run, on 120 requests at 8, 16 and 24 sessions a
minute (about 35 min here; --arms picks; --full runs every routed arm, about 80 min). The kv_aware arms run with --kv-aware (or --full), where vllm-router can read
the release's KV events (not vLLM 0.18.1: harness.routers.KV_EVENTS_UNREADABLE);
the P/D arms only with --pd (one P core saturates below the routed arms' loads, so
they run at loads of their own), on a start of their own with
MOONCAKE_LAYERWISE=1 and the mode chosen per request. The arms without push run
on one start of the instances, those with push on another; every arm starts each
load on empty prefix caches (POST /reset_prefix_cache, vLLM's dev route, on both
instances before it). In the P/D arms the prefill accounting is P's, the
tokens D took from the connector are "transferred", and P's record of its
transfers (/layerwise/transfers) gives their outcomes and the share of bytes
written before P's last layer. Per arm and load: TTFT p50/p90/p99
(client, streamed), end-to-end p50/p90, TPOT p90, prefix reuse (vLLM's prompt
tokens by source: local cache hits + tokens from the connector) against the
reuse one instance with an unbounded cache would get on the same requests,
prefill tokens computed and "recomputed" (computed beyond what the unbounded
cache could not save), the requests that hit less than the unbounded cache
would have (vLLM's cached_tokens, local and from the connector), push decisions
by reason and pushes by outcome, errors, a correctness check of sampled
requests (first tokens' top-5 logprobs against a from-scratch reference), and
the KV blocks still held after the run.

The SLO is per request: a TTFT of at most three idle cold prefills of a prompt of
its length (cold prefills of the median and of the longest prompt are measured at
the start; microbench/loadcurve.py says why), kept by a load when 90% of its
requests keep it; an arm's goodput is the highest load up to which it keeps it.
Every start of the instances measures the median prompt's idle cold prefill
before its arms and after them (each row's start_cold_prefill_s and
start_cold_after_s): arms on two starts compare only as far as those agree.
The plot: TTFT p90 and TTFT p90 in cold prefills (the SLO drawn) against offered
load, a line per arm.

    python -m microbench.sessions [--requests 120] [--loads 8,16,24] [--kv-aware]
                                  [--pd] [--arms LIST] [--full] [--trace FILE]
                                  [--push-policy always]

Any Mooncake-format trace replays with --trace (and --source-block-tokens if its
blocks are not 512 tokens), a multi-turn one (AIPerf's) too; --aiperf N replays
an agentic-code trace of N sessions that AIPerf synthesizes (aiperf.py);
--id-tokens 128 replays the 4x-shrunk prompts of earlier runs. Writes
results/sessions-trace-<time>.json, .png and the scaled trace (.trace.jsonl, at
the lightest load: replayable with vLLM 0.32's ``vllm bench serve
--dataset-name timed_trace --timed-trace-chunk-hash-size 512``); prints a table
and the targets.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import httpx

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK, Cluster, InstanceSpec, free_port
from harness.metrics import PROMPT_SOURCES, prompt_tokens_by_source, read_when
from harness.model import ModelShape, ensure_model
from harness.pd_client import (
    complete,
    engine_id,
    layerwise_transfers,
    match_blocks,
    model_name,
    pd_generate,
    pd_params,
    push_decisions,
    push_stats,
)
from harness.prompts import PromptSource
from harness.routers import (
    KV_EVENTS_UNREADABLE,
    kv_aware_router,
    kv_events_args,
    vllm_router_workers,
)
from harness.vllm_series import selected
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
from microbench.loadcurve import (
    SLO_COLD_PREFILLS,
    SLO_QUANTILE,
    ColdPrefill,
    goodput,
    parse_loads,
    quantile,
    throughput,
    ttft_in_cold_prefills,
    within,
)
from microbench.sessions import aiperf, trace
from microbench.sessions.replay import replay
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_cost import (
    Decision,
)

PROJECT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = (
    PROJECT.parent / "shared" / "traces" / "mooncake-fast25-conversation.jsonl"
)
TOKEN = uuid.uuid4().hex
PUSH_REASONS = tuple(d.value for d in Decision)
ARMS = (
    "sticky",
    "rr",
    "rr+push",
    "p2c",
    "p2c+push",
    "cache_aware",
    "cache_aware+push",
    "kv_aware",
    "kv_aware+push",
    "pd-layerwise",
    "pd-posthoc",
)
# vllm-router's policy behind each routed arm (kv_aware has its own set-up)
POLICIES = {"rr": "round_robin", "p2c": "power_of_two", "cache_aware": "cache_aware"}
# the 39-session window (120 requests from 600 s) at 8-24 sessions a minute is where
# the arms' knees lie on a 2-core host (docs/results/2026-12-02-sessions-load.md);
# a smaller window never queues there, so the default keeps the window and runs three
# arms (about 11 minutes an arm), --full every routed arm
DEFAULT_ARMS = ("sticky", "rr", "rr+push")
LOADS = "8,16,24"  # sessions a minute
REQUESTS = 120
SHORT_SHOWN = 10  # requests short of the unbounded cache's reuse named in a row
HELD_S = 0.01  # a turn held longer for its previous turn's answer counts as held
PD_MODES = {"pd-layerwise": "layerwise", "pd-posthoc": "posthoc"}
TTFT_VS_LOCAL = 1.5  # turn >= 2 TTFT p50 with push, against sticky's
REUSE_OF_UNBOUNDED = 0.9
RECOMPUTE_CUT = 3.0


def snapshot(insts) -> dict:
    snap = {}
    for i in insts:
        pushing = i.spec.role == "kv_both"  # P/D's instances run no push
        push = push_stats(i.bootstrap_url) if pushing else {}
        snap[i.spec.name] = {
            "tokens": prompt_tokens_by_source(i.url),
            "decisions": push_decisions(i.bootstrap_url)
            if pushing
            else dict.fromkeys(PUSH_REASONS, 0.0),
            "push_ok": push.get("ok", 0),
            "push_failed": push.get("failed", 0),
        }
    return snap


def grown(before: dict, after: dict) -> dict:
    out = {
        "tokens": dict.fromkeys(PROMPT_SOURCES, 0.0),
        "decisions": dict.fromkeys(PUSH_REASONS, 0.0),
    }
    out["push_ok"] = out["push_failed"] = 0
    for name in before:
        for s in PROMPT_SOURCES:
            out["tokens"][s] += after[name]["tokens"][s] - before[name]["tokens"][s]
        for r in PUSH_REASONS:
            out["decisions"][r] += (
                after[name]["decisions"][r] - before[name]["decisions"][r]
            )
        for k in ("push_ok", "push_failed"):
            out[k] += after[name][k] - before[name][k]
    # each instance's share of the prefill: a router that piles sessions onto one
    # instance shows here, whatever the totals
    out["computed_by_instance"] = {
        name: after[name]["tokens"]["local_compute"]
        - before[name]["tokens"]["local_compute"]
        for name in before
    }
    return out


def turns_of(reqs: list[trace.TraceRequest]) -> list[int]:
    """Each request's turn in its session (1: the first)."""
    out: list[int] = []
    for previous in trace.previous_turns(reqs):
        out.append(1 if previous is None else out[previous] + 1)
    return out


def cold_prefills(
    url: str, model: str, fresh: PromptSource, reps: dict[int, int]
) -> dict[int, list[float]]:
    """Idle cold prefills (seconds to one token) of fresh prompts: ``reps`` of
    each length."""
    return {
        length: [
            complete(
                url, fresh(length), max_tokens=1, logprobs=None, model=model
            ).latency_s
            for _ in range(n)
        ]
        for length, n in reps.items()
    }


def seconds_by_length(cold: dict[int, list[float]]) -> str:
    return "; ".join(
        f"{n} tokens {', '.join(f'{x:.2f}' for x in xs)} s" for n, xs in cold.items()
    )


def flush(insts, prompts: list[list[int]], model: str, fresh: PromptSource) -> None:
    """Empty the instances' prefix caches (vLLM's dev route; nothing is running),
    and wait until none holds a block of the replay's prompts (each instance's
    own POST /match_blocks, whose table learns of the reset with the next step's
    metadata: one short request of tokens the trace never has runs that step).
    P/D's instances (no push) are checked by their cached tokens instead."""
    for inst in insts:
        r = httpx.post(inst.url + "/reset_prefix_cache", timeout=60)
        if r.status_code != 200:
            raise RuntimeError(
                f"POST {inst.url}/reset_prefix_cache: {r.status_code} {r.text[:200]}"
            )
        complete(inst.url, fresh(32), max_tokens=1, logprobs=None, model=model)

    def held() -> int:
        return sum(
            match_blocks(i.bootstrap_url, p)["matched_blocks"]
            for i in insts
            for p in prompts
        )

    if any(i.spec.role != "kv_both" for i in insts):
        probe = prompts[0]
        for inst in insts:
            got = complete(inst.url, probe, max_tokens=1, logprobs=None, model=model)
            if got.cached_tokens:
                raise RuntimeError(
                    f"after POST /reset_prefix_cache {inst.url} still had "
                    f"{got.cached_tokens} tokens of the replay's first prompt cached"
                )
            httpx.post(inst.url + "/reset_prefix_cache", timeout=60)
        return

    left = read_when(held, lambda n: n == 0, timeout=30)
    if left:
        raise RuntimeError(
            f"after POST /reset_prefix_cache the instances still hold {left} blocks "
            "of the replay's prompts: the arms would not start on empty caches"
        )


@contextlib.contextmanager
def dispatcher(arm: str, a, b, reqs, log_dir: Path, model: str):
    """Where each request of ``arm`` goes: a function of its index."""
    if arm == "sticky":  # each session to one instance, alternately
        home: dict[tuple[int, ...], str] = {}
        for r in reqs:
            home.setdefault(trace.session_key(r), (a, b)[len(home) % 2].url)
        yield lambda i: home[trace.session_key(reqs[i])]
        return
    if arm in PD_MODES:  # D's url; P's request goes with it (replay's prefill)
        yield lambda i: b.url
        return
    policy = POLICIES.get(arm.removesuffix("+push"))
    if policy is not None:
        with vllm_router_workers([a, b], log_dir, policy) as router:
            yield lambda i: router.url
        return
    with kv_aware_router([a, b], log_dir, model) as router:
        yield lambda i: router.url


def pd_prefill(arm: str, tag: str, p, d):
    """P/D: each request's (P's url, P's and D's kv_transfer_params), P's mode
    chosen per request (both instances run with MOONCAKE_LAYERWISE=1); its
    transfer id starts with ``tag``."""
    p_engine = engine_id(p.bootstrap_url)

    def of(i: int) -> tuple[str, dict, dict]:
        tid = f"{tag}-{i}-{uuid.uuid4().hex[:12]}"
        mode = {"mooncake_mode": PD_MODES[arm]}
        return (p.url, *pd_params(p.bootstrap_url, p_engine, tid, mode))

    return of


def layerwise_of(p, arm: str, before: dict) -> dict:
    """P's layer-wise record of the arm: transfers by outcome (P's totals), and the
    share of bytes written before P's last layer (its kept timelines)."""
    got = layerwise_transfers(p.bootstrap_url)
    tot = {k: got["totals"][k] - before["totals"].get(k, 0) for k in got["totals"]}
    mine = [t for t in got["transfers"] if t["transfer_id"].startswith(arm + "-")]
    lw = [t for t in mine if t["layerwise"] and t["bytes_written"]]
    written = sum(t["bytes_written"] for t in lw)
    return {
        "completed": tot.get("transfers_completed", 0),
        "failed": tot.get("transfers_failed", 0),
        "destination_after_prefill": tot.get("destination_after_prefill", 0),
        "layerwise": len(lw),
        "share_before_prefill_end": sum(t["bytes_before_prefill_end"] for t in lw)
        / written
        if written
        else None,
    }


def run_arm(
    name,
    url_of,
    reqs,
    prompts,
    insts,
    model,
    sampled,
    deadline_s,
    pd=None,
    arm=None,
    after=None,
):
    """One replay; its row (token counts and push figures from the instances,
    latencies from the client). ``pd``: (P, D) for the P/D arms; the prefill
    accounting is then P's, and D's tokens from the connector are "transferred".
    ``name`` labels the replay (the arm and its load); ``arm`` is the arm (default:
    ``name``)."""
    arm = arm or name
    # transfer ids: the arm and the replay's load, no spaces (P keeps every timeline)
    tag = "-".join(name.replace("/", "").split())
    span = reqs[-1].timestamp_ms / 1e3
    print(f"[sessions] {name}: {len(reqs)} requests over {span:.0f} s", flush=True)
    before = snapshot(insts)
    lw_before = layerwise_transfers(pd[0].bootstrap_url) if pd else None
    t0 = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int, errors: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] > 15:
            last[0] = now
            print(
                f"[sessions] {name}: {done}/{total} answered, {errors} errors, "
                f"{now - t0:.0f} s (the replay lasts about {span:.0f} s)",
                flush=True,
            )

    outcomes = replay(
        url_of,
        model,
        reqs,
        prompts,
        sampled=sampled,
        deadline_s=deadline_s,
        progress=progress,
        prefill=pd_prefill(arm, tag, *pd) if pd else None,
        after=after,
    )
    wall = time.monotonic() - t0
    errors = [o.error for o in outcomes if o.error]
    answered = sum(o.prompt_len for o in outcomes if not o.error)

    def counted(snap: dict) -> float:  # computed + cache hits + connector >= prompts
        return sum(
            sum(v["tokens"].values()) - sum(before[k]["tokens"].values())
            for k, v in snap.items()
        )

    # vLLM counts a request's tokens (and our worker its decisions) just after
    # the request ends
    read_when(lambda: snapshot(insts), lambda s: counted(s) >= answered, 15)
    time.sleep(1)  # and the workers have the decisions of the last steps
    after = snapshot(insts)
    diff = grown(before, after)
    pd_row = {}
    if pd:
        p, d = pd
        diff = grown(
            {p.spec.name: before[p.spec.name]}, {p.spec.name: after[p.spec.name]}
        )
        dn = d.spec.name
        after_p = after_p_answer(map(vars, outcomes))
        pd_row = {
            "transferred_tokens": after[dn]["tokens"]["external_kv_transfer"]
            - before[dn]["tokens"]["external_kv_transfer"],
            "d_local_hit_tokens": after[dn]["tokens"]["local_cache_hit"]
            - before[dn]["tokens"]["local_cache_hit"],
            "d_computed_tokens": after[dn]["tokens"]["local_compute"]
            - before[dn]["tokens"]["local_compute"],
            "transfers": layerwise_of(p, tag, lw_before),
            "prefill_p50_s": quantile([o.prefill_s for o in outcomes], 0.5),
            "after_p_answer_p50_s": quantile(after_p, 0.5),
            "after_p_answer_p90_s": quantile(after_p, 0.9),
        }
    checks = []
    for i in sorted(sampled):
        o = outcomes[i]
        if o.sampled is None:
            checks.append(
                {"index": i, "ok": False, "problems": [o.error or "no sample"]}
            )
            continue
        ref = reference_completion(
            insts[0].url, prompts[i], max_tokens=max(1, len(o.sampled.token_ids))
        )
        checks.append(
            {
                "index": i,
                **compare(o.sampled, ref, expected_cached_tokens=None).as_dict(),
            }
        )
    held = wait_no_blocks_in_use(*(i.url for i in insts), timeout=120)
    turns = turns_of(reqs)
    ok = [(o, t) for o, t in zip(outcomes, turns) if not o.error]
    later = [o.ttft_s for o, t in ok if t >= 2]
    return {
        "arm": name,
        "requests": len(reqs),
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": wall,
        "ttft_p50_s": quantile([o.ttft_s for o, _ in ok], 0.5),
        "ttft_p90_s": quantile([o.ttft_s for o, _ in ok], 0.9),
        "ttft_p99_s": quantile([o.ttft_s for o, _ in ok], 0.99),
        "ttft_turn1_p50_s": quantile([o.ttft_s for o, t in ok if t == 1], 0.5),
        "ttft_later_p50_s": quantile(later, 0.5),
        "ttft_later_p90_s": quantile(later, 0.9),
        "e2e_p50_s": quantile([o.e2e_s for o, _ in ok], 0.5),
        "e2e_p90_s": quantile([o.e2e_s for o, _ in ok], 0.9),
        "tpot_p90_s": quantile([o.tpot_s for o, _ in ok], 0.9),
        "send_late_max_s": max(o.late_s for o in outcomes),
        # later turns whose previous turn had not answered at their timestamp
        "turns_held": sum(o.held_s > HELD_S for o in outcomes),
        "held_p50_s": quantile([o.held_s for o in outcomes if o.held_s > HELD_S], 0.5),
        "tokens": diff["tokens"],
        "computed_by_instance": diff["computed_by_instance"],
        "decisions": diff["decisions"],
        "pushes_ok": diff["push_ok"],
        "pushes_failed": diff["push_failed"],
        "checks": checks,
        "correct": all(c["ok"] for c in checks) and not errors,
        "blocks_held_after": list(held),
        "pd": pd_row or None,
        "outcomes": [
            {k: v for k, v in vars(o).items() if k != "sampled"} | {"turn": t}
            for o, t in zip(outcomes, turns)
        ],
    }


def add_reuse(row: dict, unbounded: dict) -> None:
    t = row["tokens"]
    prompt = unbounded["prompt_tokens"]
    reused = t["local_cache_hit"] + t["external_kv_transfer"]
    row["reuse"] = reused / prompt if prompt else 0.0
    row["reuse_of_unbounded"] = (
        reused / unbounded["hit_tokens"] if unbounded["hit_tokens"] else None
    )
    row["computed_tokens"] = t["local_compute"]
    # computed beyond what no cache could have saved (the unbounded cache's misses)
    row["recomputed_tokens"] = max(
        0.0, t["local_compute"] - (prompt - unbounded["hit_tokens"])
    )
    # where: the answered requests that vLLM says hit (local and from the
    # connector) less than the unbounded cache would have, in trace order
    per_request = unbounded.get("per_request") or ()
    short = [
        (o["index"], o.get("turn"), want - (o.get("cached_tokens") or 0))
        for o, want in zip(row.get("outcomes", ()), per_request)
        if not o.get("error") and (o.get("cached_tokens") or 0) < want
    ]
    row["short_of_unbounded"] = {
        "requests": len(short),
        "tokens": sum(x[2] for x in short),
        "largest": [
            {"index": i, "turn": turn, "tokens": n}
            for i, turn, n in sorted(short, key=lambda x: -x[2])[:SHORT_SHOWN]
        ],
    }


def where_the_time_goes(row: dict) -> str:
    """Turn >= 2 TTFT split by whether the request's prefix came cached (a local
    hit or a push: vLLM's cached tokens for the request) or was prefilled."""
    later = [o for o in row["outcomes"] if o["turn"] >= 2 and o["ttft_s"] is not None]
    hit = [o["ttft_s"] for o in later if (o["cached_tokens"] or 0) > 0]
    miss = [o["ttft_s"] for o in later if not o["cached_tokens"]]
    p = lambda xs: "-" if not xs else f"{quantile(xs, 0.5) * 1e3:.0f} ms"  # noqa: E731
    split = row.get("computed_by_instance") or {}
    total = sum(split.values())
    shares = (
        ", ".join(f"{k} {v / total:.0%}" for k, v in split.items()) if total else ""
    )
    return (
        f"turns >= 2 with a cached prefix: {len(hit)}, TTFT p50 {p(hit)}; without: "
        f"{len(miss)}, p50 {p(miss)}; decisions {int(row['decisions']['pushed'])} "
        f"pushed, {int(row['decisions']['not_worth_it'])} not worth it, "
        f"{int(row['decisions'].get('slow_match', 0))} source's match too slow"
        + (f"; prefill computed by {shares}" if shares else "")
    )


def ttft_difference(x: dict, y: dict, q: float = 0.9, n: int = 2000, seed: int = 0):
    """x's TTFT quantile ``q`` minus y's, with a 95% bootstrap interval (requests
    resampled within each arm)."""
    rng = random.Random(seed)
    xs = [o["ttft_s"] for o in x["outcomes"] if o["ttft_s"] is not None]
    ys = [o["ttft_s"] for o in y["outcomes"] if o["ttft_s"] is not None]
    diffs = sorted(
        quantile(rng.choices(xs, k=len(xs)), q)
        - quantile(rng.choices(ys, k=len(ys)), q)
        for _ in range(n)
    )
    return (
        quantile(xs, q) - quantile(ys, q),
        diffs[int(0.025 * n)],
        diffs[int(0.975 * n) - 1],
    )


def workload(raw, load: float, args, builder: trace.PromptBuilder) -> dict:
    """The window's sessions at ``load`` sessions a minute: the requests on their
    clock, their prompts, the sampled ones (turns >= 2) and the unbounded cache's
    reuse."""
    reqs = trace.scale(
        trace.space_sessions(
            raw,
            interval_ms=60e3 / load,
            gap_scale=args.gap_scale,
            max_gap_ms=1e3 * args.max_gap_s,
        ),
        block_tokens=args.id_tokens,
        source_block_tokens=args.source_block_tokens,
        output_divisor=args.output_divisor,
        max_output=args.max_output,
    )
    later = [i for i, t in enumerate(turns_of(reqs)) if t >= 2]
    step = max(1, len(later) // max(1, args.samples))
    return {
        "reqs": reqs,
        "prompts": [builder.prompt(r) for r in reqs],
        "sampled": set(later[::step][: args.samples]),
        "unbounded": trace.unbounded_reuse(reqs, args.id_tokens),
        "after": trace.previous_turns(reqs),
    }


def curve_targets(
    by_load: dict[float, dict[str, dict]], slo: float = SLO_COLD_PREFILLS
) -> tuple[list[dict], dict[str, float]]:
    """The load series' targets, and each arm's goodput (sessions a minute): the
    SLO is kept where a row's ``ttft_p90_cold`` is at most ``slo``."""
    out = []

    def add(name, value, met, why=""):
        out.append({"target": name, "value": value, "met": bool(met), "why": why})

    arms = [a for a in ARMS if any(a in rows for rows in by_load.values())]
    gp = {
        a: goodput(
            [
                (x, r[a]["ttft_p90_cold"], r[a]["errors"])
                for x, r in by_load.items()
                if a in r
            ],
            slo,
        )
        for a in arms
    }
    pushing = [a for a in arms if a.endswith("+push")]
    best = max(pushing, key=lambda a: gp[a], default=None)
    heaviest = max(by_load, default=0.0)

    def shown(a: str) -> str:
        # kept at the heaviest load run: the goodput is at least that, not known
        return f">={gp[a]:g}" if gp[a] == heaviest else f"{gp[a]:g}"

    def unknown(a: str, b: str) -> str:
        return (
            " (both kept the SLO at every load run: their knee lies beyond it, "
            "not measured)"
            if gp[a] == gp[b] == heaviest
            else ""
        )

    if best and "rr" in gp:
        add(
            f"goodput of the best push arm ({best}) >= 1.5x round robin's",
            f"{shown(best)} / {shown('rr')} sessions/min" + unknown(best, "rr"),
            gp[best] > 0 and gp[best] >= 1.5 * gp["rr"],
        )
    if best and "sticky" in gp:
        add(
            f"goodput of the best push arm ({best}) >= session-sticky's",
            f"{shown(best)} / {shown('sticky')} sessions/min",
            gp[best] > 0 and gp[best] >= gp["sticky"],
        )
        x = gp["sticky"]
        if x in by_load and best in by_load[x]:
            a, b = by_load[x][best]["ttft_p90_s"], by_load[x]["sticky"]["ttft_p90_s"]
            add(
                f"at sticky's goodput ({x:g}/min) the best push arm's TTFT p90 <= "
                "sticky's",
                f"{a:.2f} / {b:.2f} s" if a and b else "-",
                a is not None and b is not None and a <= b,
            )
    for arm in pushing:
        base = arm.removesuffix("+push")
        worse = []
        for x, rows in by_load.items():
            if arm in rows and base in rows:
                d, lo, hi = ttft_difference(rows[arm], rows[base])
                if lo > 0:
                    worse.append(f"{x:g}/min: {d:+.2f} s ({lo:+.2f} to {hi:+.2f})")
        if any(arm in r and base in r for r in by_load.values()):
            add(
                f"{arm} TTFT p90 <= {base}'s at every load, beyond the run's noise",
                "; ".join(worse) or "no load worse",
                not worse,
                "a load counts as worse when the 95% bootstrap interval of the p90 "
                "difference lies wholly above 0",
            )
    if best:
        reuse = [
            (x, rows[best]["reuse_of_unbounded"])
            for x, rows in by_load.items()
            if best in rows
        ]
        add(
            f"{best}: reuse >= 95% of the unbounded cache's at every load",
            ", ".join(f"{x:g}/min {r:.1%}" for x, r in reuse if r is not None),
            all(r is not None and r >= 0.95 for _, r in reuse),
        )
    return out, gp


def plot_curve(
    rows: list[dict],
    slo: float,
    path: Path,
    title: str,
    origin: str,
    x: tuple[str, str] = ("load_per_min", "offered load (sessions a minute)"),
) -> Path | None:
    """TTFT p90 against offered load (``x``: the rows' key and its axis label), a
    line per arm; beside it the p90 of TTFT in cold prefills of each request's
    own prompt, the SLO drawn, and the prefill tokens each arm computed."""
    if (made := figure(1, 3, (16, 4.5))) is None:
        return None
    fig, (a, c, b) = made
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        xs = [r[x[0]] for r in mine]
        style = "-" if arm.endswith("+push") else "--"
        a.plot(
            xs,
            [r["ttft_p90_s"] for r in mine],
            style,
            marker="o",
            label=arm,
        )
        c.plot(xs, [r["ttft_p90_cold"] for r in mine], style, marker="o", label=arm)
        b.plot(xs, [r["computed_tokens"] for r in mine], style, marker="o", label=arm)
    c.axhline(slo, color="black", linewidth=1, label=f"SLO ({slo:g})")
    a.set_xlabel(x[1])
    a.set_ylabel("TTFT p90 (s)")
    a.set_ylim(bottom=0)
    c.set_xlabel(x[1])
    c.set_ylabel("TTFT p90, in idle cold prefills of its prompt")
    c.set_ylim(bottom=0)
    c.legend(fontsize=8)
    b.set_xlabel(x[1])
    b.set_ylabel("prefill tokens computed")
    loads = sorted({r[x[0]] for r in rows})
    from matplotlib.ticker import NullLocator

    for ax in (a, c, b):
        ax.set_xscale("log")
        ax.set_xticks(loads, [f"{x:g}" for x in loads])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    return save_figure(fig, path, title, origin, fontsize=8, wrap=140)


def targets(rows: dict[str, dict]) -> list[dict]:
    rr, push, sticky = rows.get("rr"), rows.get("rr+push"), rows.get("sticky")
    out = []

    def add(name, value, met, why=""):
        out.append({"target": name, "value": value, "met": bool(met), "why": why})

    if push:
        add(
            f"rr+push reuse >= {REUSE_OF_UNBOUNDED:.0%} of the unbounded cache's",
            f"{push['reuse_of_unbounded']:.1%}"
            if push["reuse_of_unbounded"] is not None
            else "-",
            (push["reuse_of_unbounded"] or 0) >= REUSE_OF_UNBOUNDED,
            "turns pushed: {:.0f}, not pushed: {}".format(
                push["decisions"]["pushed"],
                {
                    k: int(v)
                    for k, v in push["decisions"].items()
                    if v and k != "pushed"
                },
            ),
        )
    if push and rr:
        a, b = rr["recomputed_tokens"], push["recomputed_tokens"]
        add(
            f"rr+push recomputes >= {RECOMPUTE_CUT:g}x fewer prefill tokens than rr",
            f"{a:.0f} / {b:.0f} tokens",
            b * RECOMPUTE_CUT <= a,
        )
    if push and sticky:
        a, b = push["ttft_later_p50_s"], sticky["ttft_later_p50_s"]
        add(
            f"rr+push turn >= 2 TTFT p50 <= {TTFT_VS_LOCAL:g}x sticky's (local hits)",
            f"{a * 1e3:.0f} / {b * 1e3:.0f} ms" if a and b else "-",
            a is not None and b is not None and a <= TTFT_VS_LOCAL * b,
            where_the_time_goes(push),
        )
    aware, aware_push = rows.get("kv_aware"), rows.get("kv_aware+push")
    if aware and aware_push:
        d, lo, hi = ttft_difference(aware_push, aware)
        add(
            "kv_aware+push TTFT p90 not worse than kv_aware's beyond the run's noise",
            f"{aware_push['ttft_p90_s'] * 1e3:.0f} / {aware['ttft_p90_s'] * 1e3:.0f} ms "
            f"(difference {d * 1e3:+.0f} ms, 95% interval {lo * 1e3:+.0f} to "
            f"{hi * 1e3:+.0f} ms)",
            lo <= 0,
            "noise: the difference's 95% interval from 2,000 bootstrap resamples of "
            "each arm's requests; met when it includes 0 or lies below",
        )
    lw, post = rows.get("pd-layerwise"), rows.get("pd-posthoc")
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f} ms"  # noqa: E731
    if lw and post and lw["ttft_p50_s"] and post["ttft_p50_s"]:
        d, lo, hi = ttft_difference(lw, post, 0.5)
        t = lw["pd"]["transfers"]
        share = t["share_before_prefill_end"]
        add(
            "P/D layer-wise TTFT p50 below post-hoc's",
            f"{lw['ttft_p50_s'] * 1e3:.0f} / {post['ttft_p50_s'] * 1e3:.0f} ms "
            f"(difference {d * 1e3:+.0f} ms, 95% interval {lo * 1e3:+.0f} to "
            f"{hi * 1e3:+.0f} ms)",
            hi < 0,
            "met when the whole interval lies below 0; layer-wise wrote "
            + ("-" if share is None else f"{share:.0%}")
            + f" of its bytes before P's last layer, {t['layerwise']} of "
            f"{lw['requests']} transfers layer-wise, "
            f"{t['destination_after_prefill']} reached P after its prefill; P's "
            f"answer p50 {ms(lw['pd']['prefill_p50_s'])} layer-wise, "
            f"{ms(post['pd']['prefill_p50_s'])} post-hoc",
        )
        # The part of TTFT the transfer mode decides: D's first token after P
        # answered. Under load the rest is P's queue and prefill, whose spread
        # between runs can hide a difference here.
        lw_after, post_after = (
            {"outcomes": [{"ttft_s": x} for x in after_p_answer(r["outcomes"])]}
            for r in (lw, post)
        )
        if lw_after["outcomes"] and post_after["outcomes"]:
            d, lo, hi = ttft_difference(lw_after, post_after, 0.5)
            add(
                "P/D: D's first token after P's answer, layer-wise p50 below post-hoc's",
                f"{d * 1e3:+.0f} ms (95% interval {lo * 1e3:+.0f} to {hi * 1e3:+.0f} "
                f"ms); p90 {ms(lw['pd'].get('after_p_answer_p90_s'))} layer-wise, "
                f"{ms(post['pd'].get('after_p_answer_p90_s'))} post-hoc",
                hi < 0,
                "the part of TTFT the transfer mode decides; the rest is P's queue "
                "and its prefill",
            )
    return out + [clean_run_target(name, r) for name, r in rows.items()]


def after_p_answer(outcomes: Iterable[dict]) -> list[float]:
    """P/D: each answered request's first token from D after P's own answer
    (seconds, both on the client's clock): the part of its TTFT the KV transfer
    decides."""
    return [
        o["ttft_s"] - o["prefill_s"]
        for o in outcomes
        if o.get("ttft_s") is not None and o.get("prefill_s") is not None
    ]


TABLE = [
    ("arm", "arm", ""),
    ("load_per_min", "sessions/min", "g"),
    ("slo", "SLO", ""),
    ("errors", "err", "d"),
    ("ttft_p50_ms", "TTFT p50", ".0f"),
    ("ttft_p90_ms", "p90", ".0f"),
    ("ttft_p90_cold", "p90 cold x", ".2f"),
    ("ttft_p99_ms", "p99", ".0f"),
    ("ttft_later_p50_ms", "turn>=2 p50", ".0f"),
    ("requests_per_s", "req/s", ".3f"),
    ("in_flight_mean", "in flight", ".1f"),
    ("turns_held", "held", "d"),
    ("e2e_p50_ms", "e2e p50", ".0f"),
    ("e2e_p90_ms", "e2e p90", ".0f"),
    ("tpot_p90_ms", "TPOT p90", ".1f"),
    ("reuse_pct", "reuse %", ".1f"),
    ("of_unbounded_pct", "of unbounded %", ".1f"),
    ("computed_tokens", "computed tok", ".0f"),
    ("recomputed_tokens", "recomputed", ".0f"),
    ("short", "short of unbounded", ""),
    ("pushed", "pushed", ".0f"),
    ("transfers", "P->D transfers", ""),
    ("checked", "correct", ""),
]


def transfers_cell(pd: dict | None) -> str:
    if not pd:
        return "-"
    t = pd["transfers"]
    share = t["share_before_prefill_end"]
    early = "" if share is None else f", {share:.0%} before P's end"
    return f"{t['completed']:.0f} ok, {t['failed']:.0f} failed{early}"


def short_cell(short: dict | None) -> str:
    if not short:
        return "-"
    return f"{short['requests']} req, {short['tokens']:,} tok"


def display(rows: list[dict], slo: float | None = None) -> list[dict]:
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return [
        {
            "arm": r["arm"],
            "load_per_min": r.get("load_per_min"),
            "slo": "-"
            if slo is None
            else "kept"
            if within(r.get("ttft_p90_cold"), slo, r["errors"])
            else "missed",
            "errors": r["errors"],
            "ttft_p50_ms": ms(r["ttft_p50_s"]),
            "ttft_p90_ms": ms(r["ttft_p90_s"]),
            "ttft_p90_cold": r.get("ttft_p90_cold"),
            "ttft_p99_ms": ms(r["ttft_p99_s"]),
            "ttft_later_p50_ms": ms(r["ttft_later_p50_s"]),
            "requests_per_s": r.get("requests_per_s"),
            "in_flight_mean": r.get("in_flight_mean"),
            "turns_held": r.get("turns_held", 0),
            "e2e_p50_ms": ms(r["e2e_p50_s"]),
            "e2e_p90_ms": ms(r["e2e_p90_s"]),
            "tpot_p90_ms": ms(r["tpot_p90_s"]),
            "reuse_pct": 100 * r["reuse"],
            "of_unbounded_pct": None
            if r["reuse_of_unbounded"] is None
            else 100 * r["reuse_of_unbounded"],
            "computed_tokens": r["computed_tokens"],
            "recomputed_tokens": r["recomputed_tokens"],
            "short": short_cell(r.get("short_of_unbounded")),
            "pushed": r["decisions"]["pushed"],
            "transfers": transfers_cell(r.get("pd")),
            "checked": f"{sum(c['ok'] for c in r['checks'])}/{len(r['checks'])}",
        }
        for r in rows
    ]


def plot(rows: list[dict], path: Path, title: str, origin: str) -> Path | None:
    if (made := figure(1, 3, (13, 4))) is None:
        return None
    fig, (a, b, c) = made
    names = [r["arm"] for r in rows]
    ttft = lambda r, pick: [  # noqa: E731
        o["ttft_s"] * 1e3 for o in r["outcomes"] if o["ttft_s"] is not None and pick(o)
    ]
    a.boxplot(
        [ttft(r, lambda o: o["turn"] == 1) or [0] for r in rows], tick_labels=names
    )
    a.set_ylabel("TTFT, first turns (ms)")
    b.boxplot(
        [ttft(r, lambda o: o["turn"] >= 2) or [0] for r in rows], tick_labels=names
    )
    b.set_ylabel("TTFT, turns >= 2 (ms)")
    bottom = [0.0] * len(rows)
    for src, color in zip(PROMPT_SOURCES, ("tab:red", "tab:green", "tab:blue")):
        vals = [r["tokens"][src] for r in rows]
        c.bar(names, vals, bottom=bottom, label=src, color=color)
        bottom = [x + y for x, y in zip(bottom, vals)]
    c.set_ylabel("prompt tokens by source (P/D: P's)")
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelrotation=30)
    c.set_ylim(0, 1.35 * max(bottom + [1.0]))
    c.legend(fontsize=8, loc="upper right")
    return save_figure(fig, path, title, origin, wrap=140)


def main(argv: list[str] | None = None) -> int:
    ap = parser("sessions", __doc__)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument(
        "--aiperf",
        type=int,
        default=None,
        metavar="SESSIONS",
        help="replay an agentic-code trace of this many sessions that "
        "`aiperf synthesize` writes (microbench/sessions/aiperf.py; AIPerf is "
        "installed into .venv-aiperf on first use) instead of --trace; the window "
        "starts at its beginning unless --start-s is given",
    )
    ap.add_argument(
        "--source-block-tokens", type=int, default=trace.SOURCE_BLOCK_TOKENS
    )
    ap.add_argument(
        "--start-s",
        type=float,
        default=None,
        help="the window's first session starts at or after this time of the trace "
        "(default 600: 39 sessions of 119 requests, prompts of 8.6k tokens median and up "
        "to 29k; 0 with --aiperf)",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"default {REQUESTS}",
    )
    ap.add_argument("--min-turns", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument(
        "--max-input",
        type=int,
        default=32768,
        help="leave out sessions with a turn longer than this (tokens, scaled)",
    )
    ap.add_argument(
        "--id-tokens",
        type=int,
        default=trace.SOURCE_BLOCK_TOKENS,
        help="tokens per block id of the trace in the replay (default: the trace's "
        f"own; {BLOCK} shrinks its prompts 4x)",
    )
    ap.add_argument(
        "--loads",
        default=None,
        help="offered loads, sessions a minute, comma-separated: every arm runs at "
        f"each (default {LOADS})",
    )
    ap.add_argument(
        "--slo-cold-prefills",
        type=float,
        default=SLO_COLD_PREFILLS,
        help="the SLO: each request's TTFT at most this many idle cold prefills of "
        "its own prompt, for 90%% of a load's requests (microbench/loadcurve.py "
        "says why)",
    )
    ap.add_argument(
        "--session-interval-s",
        type=float,
        default=None,
        help="one load only: a session starts every this many seconds",
    )
    ap.add_argument(
        "--gap-scale",
        type=float,
        default=0.05,
        help="the trace's gaps between a session's turns are multiplied by this",
    )
    ap.add_argument(
        "--max-gap-s",
        type=float,
        default=15.0,
        help="and held to at most this many seconds",
    )
    ap.add_argument("--output-divisor", type=float, default=10.0)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers of the generated model (default 1: on a 2-core AVX2 host the "
        "8-layer model prefills a 16k-token prompt in about 110 s; the layer count "
        "scales prefill and KV bytes alike, so their ratio is a deep model's)",
    )
    ap.add_kv_cache_gib()
    ap.add_argument(
        "--samples", type=int, default=2, help="requests checked per arm and load"
    )
    ap.add_argument("--deadline-s", type=float, default=300.0)
    ap.add_argument(
        "--kv-aware",
        action="store_true",
        help="add the arms behind vllm-router's kv_aware policy (about 5 min more; "
        "on with --full)",
    )
    ap.add_argument(
        "--pd",
        action="store_true",
        help="add the P/D arms, layer-wise against post-hoc (about 5 min more a "
        "load; not with --full: P's one core saturates at 2-8 sessions a minute)",
    )
    ap.add_argument(
        "--arms",
        default=None,
        help=f"run only these of the selected arms (comma-separated: {', '.join(ARMS)})",
    )
    ap.add_argument(
        "--push-policy",
        choices=("measured", "always"),
        default=None,
        help="MOONCAKE_PUSH_POLICY of the push arms (default: the connector's, "
        "measured; always pushes every held prefix above the minimum, the most "
        "reuse D's gate would allow)",
    )
    ap.add_argument(
        "--long-prefill-tokens",
        type=int,
        default=0,
        help="vLLM's --long-prefill-token-threshold on every instance (default 0: "
        "vLLM's own): a prompt's prefill takes at most this many of a step's token "
        "budget (2048 on the CPU backend), so a request that waited for its pushed "
        "blocks or its source's match is not held back until the prefills that "
        "started meanwhile end",
    )
    ap.add_argument("--full", action="store_true")
    ap.add_seed()
    ap.add_out()
    args = ap.parse_args(argv)
    code = code_version()  # the code this process runs: edits made later do not
    n = args.requests or REQUESTS
    run_id = stamp()
    out = args.out or DEFAULT_RESULTS_DIR / f"sessions-trace-{run_id}.json"
    if args.aiperf is not None:
        args.trace = aiperf.synthesize(
            out.parent / f"sessions-trace-{run_id}-aiperf", args.aiperf, args.seed
        )
    if args.start_s is None:
        args.start_s = 0.0 if args.aiperf is not None else 600.0
    if not args.trace.exists():
        print(
            f"[sessions] no trace at {args.trace}: pass --trace FILE", file=sys.stderr
        )
        return 2
    raw = trace.window(
        trace.load(args.trace, args.source_block_tokens),
        start_ms=1e3 * args.start_s,
        max_requests=n,
        min_turns=args.min_turns,
        max_turns=args.max_turns,
        max_input=args.max_input * args.source_block_tokens // args.id_tokens,
    )
    if len(raw) < 2:
        print(
            f"[sessions] the window holds {len(raw)} request(s): try another --start-s",
            file=sys.stderr,
        )
        return 2
    if args.session_interval_s is not None and args.loads is None:
        loads = [60 / args.session_interval_s]
    else:
        loads = parse_loads(args.loads or LOADS)
    facts = model_facts(Path(ensure_model(ModelShape(num_layers=args.layers))))
    builder = trace.PromptBuilder(args.id_tokens, facts["vocab_size"], seed=args.seed)
    work = {load: workload(raw, load, args, builder) for load in loads}
    reqs = work[loads[0]]["reqs"]  # the same requests at every load, spaced apart
    log_dir = out.parent / f"sessions-trace-{run_id}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    scaled_path = trace.write(out.with_suffix(".trace.jsonl"), reqs)
    shape = trace.describe(reqs)
    unbounded = work[loads[0]]["unbounded"]
    print(
        f"[sessions] {shape['requests']} requests of {shape['sessions']} sessions from "
        f"{args.trace.name} (from {args.start_s:.0f} s), {args.source_block_tokens} -> "
        f"{args.id_tokens} tokens a block, at {', '.join(f'{x:g}' for x in loads)} "
        f"sessions a minute, turns' gaps x{args.gap_scale:g} up to {args.max_gap_s:g} s, "
        f"input median {shape['input_median']} (max {shape['input_max']}), output "
        f"median {shape['output_median']}; unbounded-cache reuse "
        f"{unbounded['fraction']:.1%}",
        flush=True,
    )
    max_len = max(r.input_length + r.output_length for r in reqs) + BLOCK
    common = dict(
        model=facts["path"],
        role="kv_both",
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=max(2048, max_len),
        dtype=facts["dtype"],
    )
    common_args = ["--enable-prompt-tokens-details"]
    if args.long_prefill_tokens:
        common_args += ["--long-prefill-token-threshold", str(args.long_prefill_tokens)]
    warm = PromptSource(facts["vocab_size"], seed=10_000 + args.seed)
    version = selected().version
    asked = args.kv_aware or args.full
    kv_aware = asked and version not in KV_EVENTS_UNREADABLE
    if asked and not kv_aware:
        print(
            f"[sessions] no kv_aware arms on vLLM {version}: "
            f"{KV_EVENTS_UNREADABLE[version]}",
            flush=True,
        )
    # not with --full: P/D's one P core saturates below the routed arms' loads (2-8
    # sessions a minute on a 2-core host), so its series runs apart with --pd --loads
    pd = args.pd
    both = (("a", "kv_both"), ("b", "kv_both"))
    plans = [
        ({}, [a for a in ARMS if a in POLICIES or a == "sticky"], both),
        (
            {"MOONCAKE_PUSH_AUTO": "1"}
            | ({"MOONCAKE_PUSH_POLICY": args.push_policy} if args.push_policy else {}),
            [a + "+push" for a in POLICIES],
            both,
        ),
        (
            {"MOONCAKE_LAYERWISE": "1"},  # the mode is chosen per request
            list(PD_MODES) if pd else [],
            (("p", "kv_producer"), ("d", "kv_consumer")),
        ),
    ]
    plans[0][1].extend(["kv_aware"] if kv_aware else [])
    plans[1][1].extend(["kv_aware+push"] if kv_aware else [])
    chosen = set(
        args.arms.split(",")
        if args.arms
        else ARMS
        if args.full
        else DEFAULT_ARMS + ("kv_aware", "kv_aware+push") + tuple(PD_MODES)
    )
    if chosen - set(ARMS):
        print(
            f"[sessions] --arms: no arm {sorted(chosen - set(ARMS))} "
            f"(arms: {', '.join(ARMS)})",
            file=sys.stderr,
        )
        return 2
    plans = [(e, [a for a in arms if a in chosen], r) for e, arms, r in plans]
    plans = [p for p in plans if p[1]]
    by_load: dict[float, dict[str, dict]] = {load: {} for load in loads}
    flush_note = (
        "; ".join(f"{', '.join(arms)} on one start" for _, arms, _ in plans)
        + " of the instances; each arm's caches were emptied before each load (a "
        "fresh start, or POST /reset_prefix_cache on both instances)"
    )
    cold: dict[int, list[float]] = {}  # prompt tokens -> idle cold prefills (s)
    for env, arms, roles in plans:
        specs = [
            InstanceSpec(
                name,
                cores=core,
                env={**env, "VLLM_SERVER_DEV_MODE": "1"},
                extra_args=common_args
                + (
                    kv_events_args(free_port())
                    if kv_aware and role == "kv_both"
                    else []
                ),
                **{**common, "role": role},
            )
            for (name, role), core in zip(roles, ("0", "1"))
        ]
        (n0, _), (n1, _) = roles
        print(
            f"[sessions] starting {n0} (core 0) and {n1} (core 1) for "
            f"{', '.join(arms)}; logs in {log_dir}",
            flush=True,
        )
        with Cluster(specs, log_dir, token=TOKEN) as cluster:
            a, b = cluster[n0], cluster[n1]
            model = model_name(a.url)
            for inst in (a, b):  # compiled paths warm, on tokens the trace never has
                complete(inst.url, warm(300), max_tokens=2, logprobs=None, model=model)
            # every start: the SLO's unit on the first (idle, nothing cached, at two
            # lengths), and on each the host's speed then, after the same long
            # warm-up (on the 2-core AVX2 host idle prefills of 7,554 tokens took
            # 2.25-3.21 s within minutes: arms on two starts compare only so)
            here = cold_prefills(
                a.url,
                model,
                warm,
                {shape["input_median"]: 3} | ({} if cold else {shape["input_max"]: 1}),
            )
            for length, xs in here.items():
                cold.setdefault(length, xs)
            print(
                f"[sessions] idle cold prefills: {seconds_by_length(here)}", flush=True
            )
            for arm in arms:
                if arm in PD_MODES:  # P/D's first transfer of the mode, off the clock
                    pd_generate(
                        a.url,
                        a.bootstrap_url,
                        b.url,
                        warm(300),
                        max_tokens=2,
                        logprobs=None,
                        extra_prefill_params={"mooncake_mode": PD_MODES[arm]},
                    )
                for load in loads:
                    w = work[load]
                    flush((a, b), w["prompts"], model, warm)
                    with dispatcher(arm, a, b, w["reqs"], log_dir, model) as url_of:
                        row = run_arm(
                            arm if len(loads) == 1 else f"{arm} at {load:g}/min",
                            url_of,
                            w["reqs"],
                            w["prompts"],
                            [a, b],
                            model,
                            w["sampled"],
                            args.deadline_s,
                            pd=(a, b) if arm in PD_MODES else None,
                            arm=arm,
                            after=w["after"],
                        )
                    row["arm"], row["load_per_min"] = arm, load
                    add_reuse(row, w["unbounded"])
                    row.update(throughput(row["outcomes"]))
                    by_load[load][arm] = row
            # and after its arms: whether serving them left the instance slower
            after = cold_prefills(a.url, model, warm, {shape["input_median"]: 3})
            print(
                "[sessions] idle cold prefills after the load: "
                + seconds_by_length(after),
                flush=True,
            )
            for rows in by_load.values():
                for arm in arms:
                    if arm in rows:
                        rows[arm]["start_cold_prefill_s"] = here[shape["input_median"]]
                        rows[arm]["start_cold_after_s"] = after[shape["input_median"]]
    cold_s = statistics.median(cold[shape["input_median"]])
    starts = {
        arm: (row["start_cold_prefill_s"], row["start_cold_after_s"])
        for rows in by_load.values()
        for arm, row in rows.items()
    }
    slo = args.slo_cold_prefills
    cold_model = ColdPrefill.fit([(n, statistics.median(xs)) for n, xs in cold.items()])
    for rows in by_load.values():
        for row in rows.values():
            row["ttft_p90_cold"] = ttft_in_cold_prefills(row["outcomes"], cold_model)
    order = {a: k for k, a in enumerate(ARMS)}
    ordered = [
        by_load[load][arm]
        for arm in sorted({a for r in by_load.values() for a in r}, key=order.get)
        for load in loads
        if arm in by_load[load]
    ]
    met = []
    for load in loads:
        prefix = "" if len(loads) == 1 else f"at {load:g} sessions/min: "
        met += [t | {"target": prefix + t["target"]} for t in targets(by_load[load])]
    curve, gp = curve_targets(by_load, slo)
    met = curve + met
    lines = [
        f"SLO: 90% of a load's requests answered within {slo:g} idle cold "
        f"prefills of their own prompt (measured: {shape['input_median']} tokens "
        f"{cold_s:.2f} s, {shape['input_max']} tokens "
        f"{statistics.median(cold[shape['input_max']]):.2f} s; fitted "
        f"n x ({cold_model.a * 1e6:.1f} us + n x {cold_model.b * 1e9:.2f} ns)); "
        "goodput (sessions/min, the highest load up to which every load keeps "
        "it): " + ", ".join(f"{a} {g:g}" for a, g in gp.items()),
        f"caches: {flush_note}",
        "idle cold prefills of the median prompt on each start (median, before "
        "and after its arms): "
        + ", ".join(
            f"{arm} {statistics.median(b):.2f} / {statistics.median(e):.2f} s"
            for arm, (b, e) in starts.items()
        ),
    ]
    not_run = ([] if pd else ["P/D layer-wise against post-hoc (--pd)"]) + (
        [] if kv_aware else ["vllm-router's kv_aware arms (--kv-aware)"]
    )
    lines += ([f"not run here: {'; '.join(not_run)}"] if not_run else []) + [
        target_line(t) for t in met
    ]
    result = {
        "benchmark": "sessions",
        "machine": machine_info(),
        "code": code,
        "model": facts,
        "config": config_of(args)
        | {"requests": n, "block_tokens": BLOCK, "loads_per_min": loads},
        "trace": {"path": str(args.trace), "scaled": str(scaled_path), **shape},
        "unbounded": {k: v for k, v in unbounded.items() if k != "per_request"},
        "slo": {
            "cold_prefills": slo,
            "quantile": SLO_QUANTILE,
            "cold_prefill_s": {str(n): xs for n, xs in cold.items()},
            "cold_model": {
                "a_s_per_token": cold_model.a,
                "b_s_per_token2": cold_model.b,
            },
            "median_prompt_tokens": shape["input_median"],
        },
        "goodput_per_min": gp,
        "rows": ordered,
        "targets": met,
        "summary": {"lines": lines},
    }
    title = (
        f"{shape['requests']} requests, {shape['sessions']} sessions of "
        f"{args.trace.name} (input median {shape['input_median']}), "
        f"{facts['layers']} layers, two kv_both instances"
        + (" (P/D: a kv_producer and a kv_consumer)" if pd else "")
    )
    origin = provenance(result["machine"], code, run_id)
    png = (
        plot_curve(ordered, slo, out.with_suffix(".png"), title, origin)
        if len(loads) > 1
        else plot(ordered, out.with_suffix(".png"), title, origin)
    )
    return finish(
        "sessions",
        out,
        result,
        TABLE,
        lambda r: f"{r['arm']} at {r['load_per_min']:g}/min",
        png,
        lambda rows: display(rows, slo),
    )


if __name__ == "__main__":
    raise SystemExit(main())
