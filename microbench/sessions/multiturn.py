"""vLLM's own multi-turn benchmark as the sessions' driver, through vllm-router.

``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` (in vLLM's source
tree, so in the tree build.py applies into) generates conversations from local
text and plays them closed-loop: each client sends a conversation's next user
turn, with the whole history and the answers the server gave, when the previous
answer has ended. It is what upstream measures multi-turn KV reuse with. Here it
drives two ``kv_both`` instances (core 0, core 1) behind ``vllm-router --policy
round_robin``, without and with prefix push (``MOONCAKE_PUSH_AUTO=1``), each arm
on instances started for it (empty prefix caches).

The conversations are shaped like agentic work: a shared system prompt
(``--system-tokens``), a first turn of 1-2k tokens, 128-512 new tokens a turn,
16-64 output tokens, several conversations at once (``--clients``). The text is
words of the generated model's vocabulary (its word-level tokenizer: one word,
one token), drawn from a seeded generator; a chat template that joins the
messages' contents serves /v1/chat/completions.

Per arm: the benchmark's own per-request figures (TTFT, TPOT, latency; kept by
a wrapper of its ``process_statistics``, so its printed summary is unchanged),
vLLM's prompt tokens by source on both instances (prefill computed, local cache
hits, tokens from the connector), push decisions, requests that did not end,
KV blocks held after the run, and the reuse one instance with an unbounded cache
would get on the same requests. For that baseline the wrapper also keeps each
request as sent and the answer it got (a conversation's answers are the
server's, known only after the run); the server's own /tokenize turns them into
the token ids its chat template gives, and prefix reuse is counted in full
blocks, requests in the order sent. The benchmark's requests carry no logprobs,
so the answers are checked after each arm instead: the longest prompts
(``--samples``), sent again to each instance, are served from the KV the arm
left in its cache (its own blocks and pushed ones) and compared with the same
prompt computed from scratch (first tokens' top-5 logprobs).

Load is the benchmark's own knob: the conversations at once (``--clients``;
closed-loop, each client sends its next turn when the last one answered). With
several counts, each arm runs at each on instances started for it, and the
report reads each (arm, clients) like a point of microbench.sessions' load
series: TTFT p50/p90/p99, requests and tokens a second, requests in flight per
instance, and TTFT p90 in idle cold prefills of each request's own prompt
(measured at the first start, microbench/loadcurve.py). An arm's goodput is the
most clients up to which it keeps that SLO.

The benchmark needs pandas, which vLLM's virtualenvs do not have: it runs with
the Python of ``.venv-aiperf`` (aiperf.py; made on first use).

    python -m microbench.sessions.multiturn [--conversations 32] [--clients 4,8,16]
                                            [--max-messages 8] [--seed N]
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import time
from pathlib import Path

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK, Cluster, InstanceSpec
from harness.model import SPECIAL_TOKENS, ModelShape, ensure_model
from harness.pd_client import complete, model_name, tokenize_chat
from harness.prompts import PromptSource
from harness.routers import vllm_router_workers
from harness.vllm_series import selected
from microbench.common import (
    DEFAULT_RESULTS_DIR,
    code_version,
    config_of,
    finish,
    machine_info,
    model_facts,
    parser,
    provenance,
    stamp,
)
from microbench.loadcurve import (
    SLO_COLD_PREFILLS,
    ColdPrefill,
    goodput,
    parse_loads,
    quantile,
    throughput,
    ttft_in_cold_prefills,
)
from microbench.sessions import aiperf
from microbench.sessions.__main__ import (
    RECOMPUTE_CUT,
    REUSE_OF_UNBOUNDED,
    TOKEN,
    add_reuse,
    cold_prefills,
    grown,
    plot_curve,
    seconds_by_length,
    snapshot,
    target_line,
    ttft_difference,
)
from microbench.sessions.trace import unbounded_reuse_of_prompts

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
TIMEOUT_S = 1800
# Runs in the tools' virtualenv: vLLM's benchmark, its statistics kept as JSON.
# Also kept: each request as sent (its messages, the answer it got), one JSON
# line each, appended by the client process that sent it (the benchmark's
# clients are processes of their own; one write per line, O_APPEND).
RUNNER = """\
import asyncio, json, os, sys, time
sys.path.insert(0, sys.argv[1])
out = sys.argv[2]
sys.argv = ["benchmark_serving_multi_turn.py"] + sys.argv[3:]
import benchmark_serving_multi_turn as bench
real = bench.process_statistics
def keep(client_metrics, *args, **kwargs):
    with open(out, "w") as f:
        json.dump([m._asdict() for m in client_metrics], f)
    return real(client_metrics, *args, **kwargs)
bench.process_statistics = keep
open(out + ".sent", "w").close()
real_send = bench.send_request
async def send(session, messages, *args, **kwargs):
    asked = {"started": time.time(), "messages": [dict(m) for m in messages]}
    response = await real_send(session, messages, *args, **kwargs)
    line = asked | {"answer": response.content if response.valid else None}
    fd = os.open(out + ".sent", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (json.dumps(line) + "\\n").encode())
    finally:
        os.close(fd)
    return response
bench.send_request = send
real_gen = bench.generate_conversations
def planned(*args, **kwargs):
    convs = real_gen(*args, **kwargs)
    with open(out + ".planned", "w") as f:
        json.dump(
            {str(c): sum(m["role"] == "user" for m in ms) for c, ms in convs.items()}, f
        )
    return convs
bench.generate_conversations = planned
asyncio.run(bench.main())
"""
ARMS = ("rr", "rr+push")
# the load series, conversations at once: on a 2-core host both arms keep the
# SLO at 8 and lose it at 16 (about 9 minutes in all, 116 requests a point)
CLIENTS = "4,8,16"
CONVERSATIONS = 32  # twice the most clients: every count is held for most of a run
# idle cold prefills at the first start, the SLO's unit, at lengths that bracket
# the prompts (a first turn of about 1-2k tokens, a last of under 3k here)
COLD_LENGTHS = {1024: 2, 4096: 2}
INSTANCES = 2


def write_text(path: Path, vocab_size: int, words: int, seed: int) -> Path:
    """``words`` words of the model's vocabulary (w0, w1, ...), seeded."""
    rng = random.Random(seed)
    n = vocab_size - len(SPECIAL_TOKENS)
    lines = (
        " ".join(f"w{rng.randrange(n)}" for _ in range(16)) for _ in range(words // 16)
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def conversations_config(
    text: Path,
    conversations: int,
    messages: tuple[int, int],
    system_tokens: int,
    first_tokens: tuple[int, int],
    turn_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
) -> dict:
    """The benchmark's ``generate_conversations`` input (its JSON format)."""

    def uniform(lo: int, hi: int) -> dict:
        return {"distribution": "uniform", "min": lo, "max": hi}

    return {
        "filetype": "generate_conversations",
        "num_conversations": conversations,
        "text_files": [str(text)],
        "print_stats": False,
        "prompt_input": {
            "num_turns": uniform(*messages),
            "common_prefix_num_tokens": {
                "distribution": "constant",
                "value": system_tokens,
            },
            "prefix_num_tokens": uniform(*first_tokens),
            "num_tokens": uniform(*turn_tokens),
        },
        "prompt_output": {"num_tokens": uniform(*output_tokens)},
    }


def parse_clients(text: str) -> list[int]:
    """``--clients``: conversations at once, comma-separated whole numbers, in
    increasing order."""
    counts = parse_loads(text)
    if any(c != int(c) for c in counts):
        raise ValueError(f"--clients {text!r}: give whole numbers of conversations")
    return [int(c) for c in counts]


def outcomes_of(metrics: list[dict]) -> list[dict]:
    """The benchmark's per-request figures as microbench.loadcurve reads a
    request: sent at, TTFT, end to end, prompt and output tokens."""
    return [
        {
            "sent_at_s": m["start_time_ms"] / 1e3,
            "ttft_s": m["ttft_ms"] / 1e3,
            "e2e_s": m["latency_ms"] / 1e3,
            "prompt_len": m["input_num_tokens"],
            "prompt_tokens": m["input_num_tokens"],
            "output_tokens": m["output_num_tokens"],
            "error": None,
        }
        for m in metrics
    ]


def summarize(metrics: list[dict]) -> dict:
    ms = lambda k, q: quantile([m[k] for m in metrics], q)  # noqa: E731
    later = [m for m in metrics if m["input_num_turns"] > 1]
    return {
        "requests": len(metrics),
        "conversations": len({m["conversation_id"] for m in metrics}),
        "ttft_p50_ms": ms("ttft_ms", 0.5),
        "ttft_p90_ms": ms("ttft_ms", 0.9),
        "ttft_p99_ms": ms("ttft_ms", 0.99),
        "ttft_later_p50_ms": quantile([m["ttft_ms"] for m in later], 0.5),
        "ttft_later_p90_ms": quantile([m["ttft_ms"] for m in later], 0.9),
        "latency_p50_ms": ms("latency_ms", 0.5),
        "latency_p90_ms": ms("latency_ms", 0.9),
        "tpot_p90_ms": ms("tpot_ms", 0.9),
        "input_tokens_median": ms("input_num_tokens", 0.5),
        "input_tokens_max": max((m["input_num_tokens"] for m in metrics), default=0),
    }


def run_benchmark(
    python: Path,
    tree: Path,
    config: Path,
    model_dir: str,
    served: str,
    url: str,
    clients: int,
    seed: int,
    out: Path,
    log: Path,
) -> tuple[list[dict], int]:
    """vLLM's multi-turn benchmark against ``url``: its per-request figures, and
    the user turns its conversations held (the requests it had to send)."""
    runner = out.with_suffix(".runner.py")
    runner.write_text(RUNNER)
    cmd = [
        str(python),
        str(runner),
        str(tree / "benchmarks" / "multi_turn"),
        str(out),
        "--input-file",
        str(config),
        "--model",
        model_dir,
        "--served-model-name",
        served,
        "--url",
        url,
        "--num-clients",
        str(clients),
        "--max-active-conversations",
        str(clients),
        "--seed",
        str(seed),
        "--request-timeout-sec",
        "300",
        "--no-early-stop",  # else it stops all clients when the first one is done
    ]
    print(f"[multiturn] {' '.join(cmd[2:])} (log: {log})", flush=True)
    with open(log, "w") as f:
        got = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, check=False
        )
    if got.returncode != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(
            f"vLLM's multi-turn benchmark failed (exit {got.returncode}); log {log}:"
            f"\n{tail}"
        )
    plan = json.loads(Path(str(out) + ".planned").read_text())
    sent = [
        json.loads(line)
        for line in Path(str(out) + ".sent").read_text().splitlines()
        if line
    ]
    metrics = json.loads(out.read_text())
    if len(sent) < len(metrics):  # every answered request was sent
        raise RuntimeError(
            f"the benchmark answered {len(metrics)} requests but only {len(sent)} "
            f"were kept as sent ({out}.sent)"
        )
    return metrics, sum(plan.values()), sent


def served_tokens(url: str, model: str, sent: list[dict]) -> list[tuple]:
    """Each request as the server prefilled it and what it left cached (prompt and
    answer), in the order sent, by the server's own chat template (/tokenize)."""
    out = []
    for s in sorted(sent, key=lambda s: s["started"]):
        prompt = tokenize_chat(url, s["messages"], model=model)
        cached = prompt
        if s["answer"] is not None:
            answered = s["messages"] + [{"role": "assistant", "content": s["answer"]}]
            cached = tokenize_chat(
                url, answered, model=model, add_generation_prompt=False
            )
        out.append((prompt, cached))
    return out


def check_cached_answers(insts, prompts: list[list[int]], samples: int) -> list[dict]:
    """After an arm: the ``samples`` longest prompts (last turns, the most reused),
    sent again to each instance, which serves them from the KV the arm left in its
    cache (local blocks and pushed ones), against the same prompt computed from
    scratch there: first tokens' top-5 logprobs (harness.correctness). The
    benchmark's own requests carry no logprobs."""
    out = []
    for prompt in sorted(prompts, key=len, reverse=True)[:samples]:
        for inst in insts:
            got = complete(inst.url, prompt, max_tokens=2, logprobs=5)
            ref = reference_completion(inst.url, prompt, max_tokens=2)
            out.append(
                {"instance": inst.spec.name, "prompt_tokens": len(prompt)}
                | compare(got, ref, expected_cached_tokens=None).as_dict()
            )
    return out


def row_of(
    arm: str,
    metrics: list[dict],
    expected: int,
    diff: dict,
    held,
    unbounded: dict | None = None,
    clients: int | None = None,
) -> dict:
    t = diff["tokens"]
    total = sum(t.values())
    row = {
        "arm": arm,
        "clients": clients,
        **summarize(metrics),
        "expected_requests": expected,
        "not_ended": max(0, expected - len(metrics)),
        # no answer check here (see the module's doc): a request that did not end
        # is what fails the run
        "correct": len(metrics) >= expected,
        "tokens": t,
        "computed_tokens": t["local_compute"],
        "reuse": (t["local_cache_hit"] + t["external_kv_transfer"]) / total
        if total
        else 0.0,
        "decisions": diff["decisions"],
        "pushes_ok": diff["push_ok"],
        "pushes_failed": diff["push_failed"],
        "blocks_held_after": list(held),
        "metrics": metrics,
    }
    if unbounded is not None:
        # against one instance with an unbounded cache on the same requests
        # (answers as this arm's server gave them); vLLM's prompt tokens and the
        # tokenized requests' are the same count, kept both to show it
        add_reuse(row, unbounded)
        row["reuse"] = (t["local_cache_hit"] + t["external_kv_transfer"]) / total
        row["unbounded"] = {k: v for k, v in unbounded.items() if k != "per_request"}
        row["prompt_tokens_counted"] = total
    return row


def add_load_point(row: dict, cold: ColdPrefill) -> None:
    """Read ``row`` as a point of a load series: throughput and requests in
    flight per instance (microbench.loadcurve.throughput over the benchmark's
    own send times and latencies), TTFT p90 in seconds and in idle cold
    prefills of each request's own prompt."""
    outcomes = outcomes_of(row["metrics"])
    served = throughput(outcomes)
    row |= {
        "requests_per_s": served["requests_per_s"],
        "prompt_tokens_per_s": served["prompt_tokens_per_s"],
        "output_tokens_per_s": served["output_tokens_per_s"],
        "in_flight_per_instance": served["in_flight_mean"] / INSTANCES,
        "ttft_p90_s": None if row["ttft_p90_ms"] is None else row["ttft_p90_ms"] / 1e3,
        "ttft_p90_cold": ttft_in_cold_prefills(outcomes, cold),
    }


def series_targets(
    by_clients: dict[int, dict[str, dict]], slo: float
) -> tuple[list[dict], dict[str, int]]:
    """The targets of each client count (:func:`targets`, named by the count),
    rr+push's TTFT p90 against rr's at each, and each arm's goodput: the most
    clients up to which every count kept the SLO (the p90 of TTFT in idle cold
    prefills at most ``slo``, no request left unanswered)."""
    out = []
    for clients, rows in sorted(by_clients.items()):
        for t in targets(rows):
            out.append(t | {"target": f"at {clients} clients: {t['target']}"})
        rr, push = rows.get("rr"), rows.get("rr+push")
        if rr and push:
            d, lo, hi = ttft_difference(
                {"outcomes": outcomes_of(push["metrics"])},
                {"outcomes": outcomes_of(rr["metrics"])},
                0.9,
            )
            out.append(
                {
                    "target": f"at {clients} clients: rr+push TTFT p90 not above "
                    "rr's beyond the run's noise",
                    "value": f"{push['ttft_p90_ms']:.0f} / {rr['ttft_p90_ms']:.0f} ms "
                    f"(difference {d * 1e3:+.0f} ms, 95% interval {lo * 1e3:+.0f} to "
                    f"{hi * 1e3:+.0f} ms)",
                    "met": bool(lo <= 0),
                    "why": "noise: 2,000 bootstrap resamples of each arm's requests",
                }
            )
    gp = {
        arm: int(
            goodput(
                [
                    (c, rows[arm].get("ttft_p90_cold"), rows[arm]["not_ended"])
                    for c, rows in by_clients.items()
                    if arm in rows
                ],
                slo,
            )
        )
        for arm in ARMS
        if any(arm in rows for rows in by_clients.values())
    }
    if "rr" in gp and "rr+push" in gp and len(by_clients) > 1:
        out.append(
            {
                "target": "rr+push's goodput >= rr's (the most clients keeping TTFT "
                f"p90 within {slo:g} idle cold prefills)",
                "value": f"{gp['rr+push']} / {gp['rr']} clients (of "
                f"{', '.join(map(str, sorted(by_clients)))})",
                "met": gp["rr+push"] >= gp["rr"],
                "why": "",
            }
        )
    return out, gp


def targets(rows: dict[str, dict]) -> list[dict]:
    out = []

    def add(name, value, met, why=""):
        out.append({"target": name, "value": value, "met": bool(met), "why": why})

    rr, push = rows.get("rr"), rows.get("rr+push")
    if push and push.get("reuse_of_unbounded") is not None:
        add(
            f"rr+push reuse >= {REUSE_OF_UNBOUNDED:.0%} of the unbounded cache's",
            f"{push['reuse_of_unbounded']:.1%}",
            push["reuse_of_unbounded"] >= REUSE_OF_UNBOUNDED,
            "turns pushed: {:.0f}, not pushed: {}".format(
                push["decisions"]["pushed"],
                {
                    k: int(v)
                    for k, v in push["decisions"].items()
                    if v and k != "pushed"
                },
            ),
        )
    if rr and push and "recomputed_tokens" in push and "recomputed_tokens" in rr:
        a, b = rr["recomputed_tokens"], push["recomputed_tokens"]
        add(
            f"rr+push recomputes >= {RECOMPUTE_CUT:g}x fewer prefill tokens than rr",
            f"{b:.0f} / {a:.0f} tokens (computed beyond the unbounded cache's misses; "
            f"all computed: {push['computed_tokens']:.0f} / {rr['computed_tokens']:.0f})",
            b * RECOMPUTE_CUT <= a,
        )
    if rr and push:
        as_outcomes = lambda r: {  # noqa: E731
            "outcomes": [
                {"ttft_s": m["ttft_ms"] / 1e3}
                for m in r["metrics"]
                if m["input_num_turns"] > 1
            ]
        }
        d, lo, hi = ttft_difference(as_outcomes(push), as_outcomes(rr), 0.5)
        add(
            "rr+push turn >= 2 TTFT p50 not above rr's beyond the run's noise",
            f"{push['ttft_later_p50_ms']:.0f} / {rr['ttft_later_p50_ms']:.0f} ms "
            f"(difference {d * 1e3:+.0f} ms, 95% interval {lo * 1e3:+.0f} to "
            f"{hi * 1e3:+.0f} ms)",
            lo <= 0,
            "noise: 2,000 bootstrap resamples of each arm's turns >= 2",
        )
    for name, r in rows.items():
        if "checked" in r:
            c = r["checked"]
            wrong = [x for x in c if not x["ok"]]
            add(
                f"{name}: sampled answers from the arm's cached KV match from-scratch",
                f"{len(c) - len(wrong)} of {len(c)} match (largest logprob difference "
                f"{max((x['max_logprob_diff'] for x in c), default=0):.2g}; cached "
                f"tokens {[x['cached_tokens'] for x in c]})",
                c and not wrong,
                "; ".join(p for x in wrong for p in x["problems"])[:500],
            )
        add(
            f"{name}: every request ended, 0 blocks held",
            f"{r['requests']} of {r['expected_requests']} ended, blocks held "
            f"{r['blocks_held_after']}",
            not r["not_ended"] and not any(r["blocks_held_after"]),
        )
    return out


TABLE = [
    ("arm", "arm", ""),
    ("clients", "clients", "d"),
    ("requests", "requests", "d"),
    ("not_ended", "not ended", "d"),
    ("ttft_p50_ms", "TTFT p50", ".0f"),
    ("ttft_p90_ms", "p90", ".0f"),
    ("ttft_p99_ms", "p99", ".0f"),
    ("ttft_p90_cold", "p90 in cold", ".2f"),
    ("requests_per_s", "req/s", ".2f"),
    ("in_flight_per_instance", "in flight/inst", ".1f"),
    ("ttft_later_p50_ms", "turn>=2 p50", ".0f"),
    ("ttft_later_p90_ms", "turn>=2 p90", ".0f"),
    ("latency_p50_ms", "e2e p50", ".0f"),
    ("tpot_p90_ms", "TPOT p90", ".1f"),
    ("reuse_pct", "reuse %", ".1f"),
    ("of_unbounded_pct", "of unbounded %", ".1f"),
    ("computed_tokens", "computed tok", ".0f"),
    ("recomputed_tokens", "recomputed", ".0f"),
    ("pushed", "pushed", ".0f"),
]


def display(rows: list[dict]) -> list[dict]:
    return [
        {
            **{k: r[k] for k, _, _ in TABLE if k in r},
            "reuse_pct": 100 * r["reuse"],
            "of_unbounded_pct": None
            if r.get("reuse_of_unbounded") is None
            else 100 * r["reuse_of_unbounded"],
            "pushed": r["decisions"]["pushed"],
        }
        for r in rows
    ]


def run_arm(
    arm: str,
    env: dict,
    clients: int,
    args,
    facts: dict,
    work: Path,
    run: dict,
    warm: PromptSource,
) -> tuple[dict, dict[int, list[float]]]:
    """One arm at one client count, on two instances started for it (empty
    prefix caches): its row, and idle cold prefills measured on a before the
    benchmark (the SLO's unit)."""
    here = work / f"{arm}-{clients}"
    here.mkdir(exist_ok=True)
    specs = [
        InstanceSpec(
            name,
            role="kv_both",
            cores=core,
            model=facts["path"],
            kv_cache_gib=args.kv_cache_gib,
            max_model_len=8192,
            dtype=facts["dtype"],
            env=env,
            extra_args=[
                "--enable-prompt-tokens-details",
                "--chat-template",
                str(run["template"]),
            ],
        )
        for name, core in (("a", "0"), ("b", "1"))
    ]
    print(
        f"[multiturn] {arm} at {clients} clients: starting a (core 0) and b (core 1)",
        flush=True,
    )
    with Cluster(specs, here, token=TOKEN) as cluster:
        a, b = cluster["a"], cluster["b"]
        served = model_name(a.url)
        for inst in (a, b):
            complete(inst.url, warm(300), max_tokens=2, logprobs=None, model=served)
        cold = cold_prefills(a.url, served, warm, COLD_LENGTHS)
        print(
            f"[multiturn] idle cold prefills on a: {seconds_by_length(cold)}",
            flush=True,
        )
        with vllm_router_workers([a, b], here, "round_robin") as router:
            before = snapshot([a, b])
            metrics, expected, sent = run_benchmark(
                run["python"],
                run["tree"],
                run["config_path"],
                facts["path"],
                served,
                router.url,
                clients,
                args.seed,
                work / f"{arm}-{clients}-requests.json",
                work / f"{arm}-{clients}-benchmark.log",
            )
        time.sleep(2)  # vLLM counts a request's tokens just after it ends
        diff = grown(before, snapshot([a, b]))
        tokens = served_tokens(a.url, served, sent)
        unbounded = unbounded_reuse_of_prompts(tokens, BLOCK)
        checked = check_cached_answers([a, b], [p for p, _ in tokens], args.samples)
        held = wait_no_blocks_in_use(a.url, b.url, timeout=120)
        row = row_of(arm, metrics, expected, diff, held, unbounded, clients)
        row["checked"] = checked
        row["start_cold_prefill_s"] = {str(n): xs for n, xs in cold.items()}
    return row, cold


def main(argv: list[str] | None = None) -> int:
    ap = parser("sessions.multiturn", __doc__)
    ap.add_argument("--conversations", type=int, default=CONVERSATIONS)
    ap.add_argument(
        "--clients",
        default=CLIENTS,
        help="conversations at once, comma-separated: each arm runs at each "
        f"(default {CLIENTS})",
    )
    ap.add_argument(
        "--max-messages",
        type=int,
        default=8,
        help="messages a conversation has at most (user and assistant: 8 = 4 turns)",
    )
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--slo-cold-prefills",
        type=float,
        default=SLO_COLD_PREFILLS,
        help="the SLO: each request's TTFT at most this many idle cold prefills of "
        "its own prompt, for 90%% of a count's requests (microbench/loadcurve.py "
        "says why)",
    )
    ap.add_kv_cache_gib()
    ap.add_seed()
    ap.add_argument(
        "--samples",
        type=int,
        default=4,
        help="prompts checked against a from-scratch reference after each arm",
    )
    ap.add_out()
    args = ap.parse_args(argv)
    try:
        series = parse_clients(args.clients)
    except ValueError as e:
        ap.error(str(e))
    code = code_version()  # the code this process runs: edits made later do not
    run_id = stamp()
    out = args.out or DEFAULT_RESULTS_DIR / f"sessions-multiturn-{run_id}.json"
    work = out.parent / f"sessions-multiturn-{run_id}-logs"
    work.mkdir(parents=True, exist_ok=True)
    facts = model_facts(Path(ensure_model(ModelShape(num_layers=args.layers))))
    text = write_text(work / "words.txt", facts["vocab_size"], 200_000, args.seed)
    config = conversations_config(
        text,
        args.conversations,
        (max(2, args.max_messages - 2), args.max_messages),
        args.system_tokens,
        (512, 1024),
        (128, 512),
        (16, 64),
    )
    run = {
        "python": aiperf.ensure().parent / "python",
        "tree": selected().tree,
        "config_path": work / "conversations.json",
        "template": work / "chat-template.jinja",
    }
    run["config_path"].write_text(json.dumps(config, indent=2))
    run["template"].write_text(CHAT_TEMPLATE)
    print(
        f"[multiturn] {args.conversations} conversations of up to "
        f"{args.max_messages // 2} turns, {', '.join(map(str, series))} at once, "
        f"vLLM's benchmark from {run['tree']}; logs in {work}",
        flush=True,
    )
    warm = PromptSource(facts["vocab_size"], seed=10_000 + args.seed)
    by_clients: dict[int, dict[str, dict]] = {}
    colds: list[dict[int, list[float]]] = []
    t_start = time.monotonic()
    for clients in series:  # both arms at one count, then the next
        for arm, env in (("rr", {}), ("rr+push", {"MOONCAKE_PUSH_AUTO": "1"})):
            row, cold = run_arm(arm, env, clients, args, facts, work, run, warm)
            by_clients.setdefault(clients, {})[arm] = row
            colds.append(cold)
            print(
                f"[multiturn] {arm} at {clients} clients: {row['requests']} "
                f"requests answered; {time.monotonic() - t_start:.0f} s so far",
                flush=True,
            )
    # the SLO's unit is the first start's cold prefills, for every arm and count
    cold_model = ColdPrefill.fit(
        [(n, statistics.median(xs)) for n, xs in colds[0].items()]
    )
    for rows in by_clients.values():
        for row in rows.values():
            add_load_point(row, cold_model)
    slo = args.slo_cold_prefills
    met, gp = series_targets(by_clients, slo)
    ordered = [
        by_clients[c][arm] for arm in ARMS for c in series if arm in by_clients[c]
    ]
    result = {
        "benchmark": "sessions-multiturn",
        "machine": machine_info(),
        "code": code,
        "model": facts,
        "config": config_of(args) | {"conversations_config": config},
        "slo": {
            "cold_prefills": slo,
            "quantile": 0.9,
            "cold_model": {
                "a_s_per_token": cold_model.a,
                "b_s_per_token2": cold_model.b,
            },
            "cold_prefill_s": [{str(n): xs for n, xs in c.items()} for c in colds],
        },
        "goodput_clients": gp,
        "rows": ordered,
        "targets": met,
        "summary": {
            "lines": [
                "each arm at each client count on instances started for it (empty "
                "prefix caches); driver: vLLM's "
                "benchmarks/multi_turn/benchmark_serving_multi_turn.py, closed-loop",
                "answers: the longest prompts sent again to each instance after "
                "the arm (served from the KV it left cached) against from-scratch",
                f"SLO: TTFT p90 within {slo:g} idle cold prefills of each request's "
                f"own prompt (first start: {seconds_by_length(colds[0])}); goodput "
                + ", ".join(f"{arm} {n} clients" for arm, n in gp.items()),
            ]
            + [
                f"{r['arm']} at {r['clients']} clients: an unbounded cache would "
                f"reuse {r['unbounded']['fraction']:.1%} of the prompt tokens "
                f"({r['unbounded']['hit_tokens']:,} of "
                f"{r['unbounded']['prompt_tokens']:,}; vLLM counted "
                f"{r['prompt_tokens_counted']:,.0f} prompt tokens)"
                for r in ordered
                if "unbounded" in r
            ]
            + [target_line(t) for t in met]
        },
    }
    png = None
    if len(series) > 1:
        curve = [r | {"load": r["clients"]} for r in ordered]
        png = plot_curve(
            curve,
            slo,
            out.with_suffix(".png"),
            f"vLLM's multi-turn benchmark, {args.conversations} conversations, "
            f"{facts['layers']} layers, two kv_both instances behind vllm-router "
            "round_robin",
            provenance(result["machine"], code, run_id),
            x=("load", "conversations at once (closed-loop clients)"),
        )
    return finish(
        "sessions-multiturn",
        out,
        result,
        TABLE,
        lambda r: (r["arm"], r["clients"]),
        png,
        display,
    )


if __name__ == "__main__":
    raise SystemExit(main())
