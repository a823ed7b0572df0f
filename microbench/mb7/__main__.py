"""mb7: what moving a prompt's KV from prefill to decode adds to the critical path.

Two vLLM instances (P: kv_producer, D: kv_consumer) with MooncakeConnector over
the Mooncake transfer engine, both started with MOONCAKE_LAYERWISE=1. Each
request chooses its mode in P's kv_transfer_params ({"mooncake_mode":
"layerwise"} or "posthoc"), so both modes run in the same cluster,
interleaved in ABBA order (plan.py). Per prompt length, repetition and mode
(measure.py):

  tail        D's first token (D's scheduler) after P's last layer (P's
              worker), same request, on the engines' clock (one host's
              CLOCK_MONOTONIC): what the transfer adds to the critical path.
              The client's figure (D's response - P's response) is kept in
              the JSON as client_tail_s
  floor       D's own TTFT for the same prompt with the prefix already in its
              cache (local hit, as D's engine measured it) + one layer's write
              at the engine's measured speed: what layer-wise push cannot beat
  tail/floor  per repetition; post-hoc/layer-wise tail, paired by repetition
  P slowdown  P's latency with a layer-wise transfer / P alone (prefill-only
              arm, same repetition) - 1
  share       layer-wise bytes written before P's last layer finished (P's
              /layerwise/transfers)
  correct     D's cached tokens == KV tokens and D's token + top-5 logprobs equal
              P's answer from its own KV

Idle, the transfer threads run on D's core (MOONCAKE_IO_CPUS), off P's compute
core, as a NIC works beside a GPU; under --load (decode streams on each
instance) a second cluster keeps them per instance (cluster_plan). Writes
JSON, prints a table with min/median/max over repetitions, one verdict line
per target, and draws a PNG.

    python -m microbench.mb7 [--model DIR] [--sizes 512,1024,2048] [--reps 3] [--load 0,8] [--full]
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import httpx

from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK, Cluster, InstanceSpec
from harness.model import ModelShape, ensure_model
from harness.pd_client import (
    RequestFailed,
    complete,
    model_name,
    pd_generate,
)
from harness.prompts import PromptSource
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
from microbench.load import DecodeLoad

from .concurrency import level_rows, sweep, table_lines
from .measure import (
    measure,
    one_layer_writes,
    transfer_timelines,
    where_the_tail_goes,
)
from .plan import LAYERWISE, POSTHOC, TRANSFER_ARMS, Progress, Step, plan
from .report import TABLE, build_rows, plot, summary_lines, table_rows, targets

REQUEST_TIMEOUT_S = float(os.environ.get("VMP_MB7_REQUEST_TIMEOUT_S", "180"))
QUICK = {
    "sizes": "512,1024,2048",
    "reps": 3,
    "load": "0,8",
    "concurrency": "1,4,16",
    # a third instance's start costs ~1 min here: two P's only under --full (or
    # with --two-prefill-levels), so the default run stays near 10 min
    "two_prefill": "0",
    # the sweep's prompt lengths: a 2048-token prefill takes ~9 s on this machine's
    # one P core, so the default sweep mixes the shorter two (<= 10 min in all)
    "sweep_sizes": "512,1024",
}
FULL = {
    "sizes": "512,1024,2048,4096",
    "reps": 5,
    "load": "0,8",
    "concurrency": "1,4,16,32",
    "two_prefill": "4,16",
    "sweep_sizes": None,  # all of --sizes
}
HELD_WAIT_S = 30.0


class Phases:
    """Wall time of each part of the run, in order (the JSON's "phases")."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.last = clock()
        self.laps: list[dict] = []

    def lap(self, name: str) -> None:
        now = self.clock()
        self.laps.append({"phase": name, "seconds": now - self.last})
        self.last = now

    def text(self) -> str:
        return ", ".join(f"{x['phase']} {x['seconds']:.0f}s" for x in self.laps)


def cluster_plan(loads: list[int], io_cpus: str) -> list[tuple[bool, list[int]]]:
    """(transfer threads on D's cores?, loads) per cluster.

    "auto": idle on D's cores (the GPU + NIC emulation), under load not: with
    decode streams on both instances no core is free to stand in for a NIC,
    and pinning every transfer thread to D's busy core starved them (P's
    engine then stalled behind its sender loop: seen in mb7 under load)."""
    if io_cpus == "auto":
        idle, busy = [x for x in loads if x == 0], [x for x in loads if x > 0]
        return [(True, idle)] * bool(idle) + [(False, busy)] * bool(busy)
    return [(io_cpus == "on", loads)]


def cluster_specs(
    args, facts: dict, io_on: bool, two_prefills: bool = False
) -> list[InstanceSpec]:
    common = dict(
        model=facts["path"],
        protocol=args.protocol,
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=facts["dtype"],
        extra_args=["--enable-prompt-tokens-details"],
    )
    # All transfer threads (P's sending, D's receiving) on D's cores when io_on:
    # P's compute core does nothing but compute, as with a GPU and a NIC.
    io = {"MOONCAKE_IO_CPUS": args.d_cores} if io_on else {}
    env = {"MOONCAKE_LAYERWISE": "1", **io}  # the mode is chosen per request
    # D's admission of incoming transfers (unset: the connector's default)
    admission = (
        {}
        if args.decode_max_pulls is None
        else {"MOONCAKE_DECODE_MAX_PULLS": str(args.decode_max_pulls)}
    )
    gpus = lambda ids: {"CUDA_VISIBLE_DEVICES": ids} if ids else {}  # noqa: E731
    # a second P for the sweep's two-P levels (its cores: --p2-cores)
    second = [
        InstanceSpec(
            "prefill2",
            role="kv_producer",
            cores=args.p2_cores or args.p_cores,
            env={**env, **gpus(args.p2_gpus)},
            **common,
        )
    ]
    return [
        InstanceSpec(
            "prefill",
            role="kv_producer",
            cores=args.p_cores,
            env={**env, **gpus(args.p_gpus)},
            **common,
        ),
        *(second if two_prefills else []),
        InstanceSpec(
            "decode",
            role="kv_consumer",
            cores=args.d_cores,
            env={**env, **admission, **gpus(args.d_gpus)},
            **common,
        ),
    ]


def warm_up(
    p, d, p_model: str, d_model: str, prompts, progress: Progress
) -> list[dict]:
    """The first requests after start, timed (they pay one-time costs: reported
    in the JSON, never measured as samples). Shaped like the measurements (top-5
    logprobs on D): the first one that asked for logprobs was ~60 ms slower."""
    out = []
    for i, mode in enumerate((LAYERWISE, POSTHOC, LAYERWISE)):
        t0 = time.perf_counter()
        r = pd_generate(
            p.url,
            p.bootstrap_url,
            d.url,
            prompts(BLOCK * 4 + 1),
            max_tokens=1,
            logprobs=5,
            extra_prefill_params={"mooncake_mode": mode},
            timeout=REQUEST_TIMEOUT_S,
        )
        out.append(
            {
                "request": i + 1,
                "mode": mode,
                "total_s": time.perf_counter() - t0,
                "prefill_s": r.prefill.latency_s,
            }
        )
    complete(p.url, prompts(64), max_tokens=1, logprobs=None, model=p_model)
    complete(d.url, prompts(64), max_tokens=1, logprobs=None, model=d_model)
    progress.note(
        "warm-up P->D requests after start: "
        + ", ".join(f"#{w['request']} {w['mode']} {w['total_s']:.2f}s" for w in out)
    )
    return out


def blocks_held(p, d, modes, prompts, kv_tokens: int, phase: str) -> list[dict]:
    """Per mode: one more P -> D request, then how long until P and D hold no
    KV block (an idle instance must return to baseline)."""
    out = []
    for mode in modes:
        error = None
        try:
            pd_generate(
                p.url,
                p.bootstrap_url,
                d.url,
                prompts(kv_tokens + 1),
                max_tokens=1,
                logprobs=None,
                extra_prefill_params={"mooncake_mode": mode},
                timeout=REQUEST_TIMEOUT_S,
            )
        except RequestFailed as e:  # a failed request must leave no block held either
            error = str(e)[:300]
        t0 = time.monotonic()
        pu, du = wait_no_blocks_in_use(p.url, d.url, timeout=HELD_WAIT_S, poll=0.2)
        out.append(
            {
                "mode": mode,
                "phase": phase,
                "p_usage": pu,
                "d_usage": du,
                "returned": pu == 0.0 and du == 0.0,
                "seconds": time.monotonic() - t0,
                "request_error": error,
            }
        )
    return out


def describe(s) -> str:
    if s.error:
        return f"FAILED: {s.error[:160]}"
    cpu = (
        f", its forward thread's CPU {s.p_forward_cpu_s:.2f}s"
        if s.p_forward_cpu_s is not None
        else ""
    )
    if s.arm == "prefill_only":
        return f"P alone {s.p_latency_s:.2f}s{cpu}"
    hit = f"{1e3 * s.local_hit_s:.0f}ms" if s.local_hit_s is not None else "-"
    hit += (
        f" (client {1e3 * s.local_hit_client_s:.0f}ms)" if s.local_hit_client_s else ""
    )
    return (
        f"client tail {1e3 * s.client_tail_s:.0f}ms (P {s.p_latency_s:.2f}s{cpu}), "
        f"local hit {hit}, "
        f"correct={s.correct}"
    )


def run_cluster(
    args,
    facts: dict,
    log_dir: Path,
    io_on: bool,
    steps: dict[int, list[Step]],
    progress: Progress,
    modes: tuple[str, ...],
    phases: Phases,
) -> tuple[list[dict], list, list, tuple[list, list]]:
    samples, held, warm, conc = [], [], [], ([], [])
    prompts = PromptSource(facts["vocab_size"], seed=args.seed + (0 if io_on else 1000))
    sweeping = 0 in steps and bool(args.concurrency or args.two_prefill)
    two_p = sweeping and bool(args.two_prefill)
    progress.note(
        f"starting P (cores {args.p_cores}) "
        + (f"and a second P (cores {args.p2_cores or args.p_cores}) " if two_p else "")
        + f"and D (cores {args.d_cores}), transfer "
        f"threads {'on D' if io_on else 'per instance'}; logs in {log_dir}"
    )
    with Cluster(cluster_specs(args, facts, io_on, two_p), log_dir) as cluster:
        p, d = cluster["prefill"], cluster["decode"]
        pm, dm = model_name(p.url), model_name(d.url)
        phases.lap("cluster start" + (" (3 instances)" if two_p else ""))
        progress.note("P and D ready")
        warm = warm_up(p, d, pm, dm, prompts, progress)
        phases.lap("warm-up")
        for load, load_steps in steps.items():
            with contextlib.ExitStack() as streams:
                if load:
                    streams.enter_context(
                        DecodeLoad(
                            p.url, pm, load, facts["vocab_size"], seed=args.seed + 1
                        )
                    )
                    streams.enter_context(
                        DecodeLoad(
                            d.url, dm, load, facts["vocab_size"], seed=args.seed + 2
                        )
                    )
                    progress.note(
                        f"load {load}: {load} decode streams on each of P and D"
                    )
                phase = []
                for step in load_steps:
                    t0 = time.monotonic()
                    sample = measure(step, p, d, pm, dm, prompts, REQUEST_TIMEOUT_S)
                    phase.append(sample)
                    progress.step_done(
                        step, describe(sample), seconds=time.monotonic() - t0
                    )
            try:
                timelines = transfer_timelines(p.bootstrap_url)
            except (httpx.HTTPError, KeyError) as e:
                progress.note(f"P's /layerwise/transfers unreadable: {e!r}")
                timelines = {}
            phases.lap(f"single requests, {'idle' if not load else f'load {load}'}")
            for s in phase:
                row = s.as_dict()
                row.update(where_the_tail_goes(row, timelines.get(s.transfer_id)))
                if s.arm != LAYERWISE:
                    row["share_before_prefill_end"] = None
                row["io_cpus"] = io_on
                samples.append(row)
            if load == 0:
                held += blocks_held(p, d, modes, prompts, min(args.sizes), "idle")
                phases.lap("blocks held, idle")
        conc_samples, conc_held = [], []
        runs = [([p], args.concurrency)] if args.concurrency else []
        if two_p:
            runs.append(([p, cluster["prefill2"]], args.two_prefill))
        for ps, levels in runs if sweeping else []:
            cs, ch = sweep(
                ps,
                d,
                levels,
                modes,
                args.sweep_sizes,
                prompts,
                REQUEST_TIMEOUT_S,
                progress.note,
            )
            conc_samples += cs
            conc_held += ch
            phases.lap(f"concurrency sweep, {len(ps)} P")
        conc = (conc_samples, conc_held)
    phases.lap("cluster stop")
    return samples, held, warm, conc


def main(argv: list[str] | None = None) -> int:
    ap = parser("mb7", __doc__)
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model dir (default: the generated default model)",
    )
    ap.add_argument(
        "--full",
        action="store_true",
        help=f"the long sweep: sizes {FULL['sizes']}, {FULL['reps']} reps",
    )
    ap.add_argument(
        "--sizes",
        default=None,
        help=f"KV tokens per request, comma separated (default {QUICK['sizes']}; "
        "the prompt is one token longer)",
    )
    ap.add_argument("--reps", type=int, default=None, help=f"default {QUICK['reps']}")
    ap.add_argument(
        "--modes",
        default=",".join(TRANSFER_ARMS),
        help=f"comma separated of {list(TRANSFER_ARMS)}",
    )
    ap.add_argument(
        "--load",
        default=None,
        help="background decode streams per instance, comma separated "
        f"(0 = idle; default {QUICK['load']})",
    )
    ap.add_argument(
        "--concurrency",
        default=None,
        help="P->D requests in flight at once, comma separated, run in the idle "
        f"cluster after its steps; 0 = no sweep (default {QUICK['concurrency']}, "
        f"--full {FULL['concurrency']})",
    )
    ap.add_argument(
        "--two-prefill-levels",
        default=None,
        help="levels of the sweep run again with two P instances writing into one D "
        "(requests alternate between them; starts a third instance); 0 = none "
        "(default "
        f"{QUICK['two_prefill']}, --full {FULL['two_prefill']})",
    )
    ap.add_argument(
        "--sweep-sizes",
        default=None,
        help="KV tokens of the sweep's prompts, mixed in every level (default "
        f"{QUICK['sweep_sizes']}; --full: all of --sizes)",
    )
    ap.add_argument(
        "--p2-cores",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND of the second P (default: P's cores, shared)",
    )
    ap.add_argument(
        "--p2-gpus",
        default=None,
        help="GPU hosts: CUDA_VISIBLE_DEVICES of the second P; unverified here",
    )
    ap.add_argument(
        "--decode-max-pulls",
        type=int,
        default=None,
        help="D's MOONCAKE_DECODE_MAX_PULLS (0 = no bound; default: the connector's, 8)",
    )
    ap.add_argument(
        "--protocol",
        default="tcp",
        help="Mooncake protocol (tcp here; rdma on RDMA hosts)",
    )
    ap.add_kv_cache_gib()
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--p-cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND of P (CPU only)"
    )
    ap.add_argument(
        "--d-cores", default="1", help="VLLM_CPU_OMP_THREADS_BIND of D (CPU only)"
    )
    ap.add_argument(
        "--p-gpus",
        default=None,
        help="GPU hosts: CUDA_VISIBLE_DEVICES of P (e.g. 0); unverified here",
    )
    ap.add_argument(
        "--d-gpus",
        default=None,
        help="GPU hosts: CUDA_VISIBLE_DEVICES of D (e.g. 1); unverified here",
    )
    ap.add_argument(
        "--io-cpus",
        choices=["auto", "on", "off"],
        default="auto",
        help="transfer threads on D's cores (MOONCAKE_IO_CPUS): auto = idle only",
    )
    ap.add_seed()
    ap.add_out(help="JSON path (default results/mb7-<time>.json)")
    args = ap.parse_args(argv)
    defaults = FULL if args.full else QUICK
    args.sizes = [int(s) for s in (args.sizes or defaults["sizes"]).split(",")]
    args.reps = args.reps or defaults["reps"]
    args.loads = [int(s) for s in (args.load or defaults["load"]).split(",")]
    args.concurrency = [
        int(s)
        for s in (args.concurrency or defaults["concurrency"]).split(",")
        if int(s) > 0
    ]
    args.two_prefill = [
        int(s)
        for s in (args.two_prefill_levels or defaults["two_prefill"]).split(",")
        if int(s) > 0
    ]
    sweep_sizes = args.sweep_sizes or defaults["sweep_sizes"]
    args.sweep_sizes = (
        [int(s) for s in sweep_sizes.split(",")] if sweep_sizes else list(args.sizes)
    )
    if not set(args.sweep_sizes) <= set(args.sizes):
        ap.error(
            f"--sweep-sizes {args.sweep_sizes} must be among --sizes {args.sizes} "
            "(their floors come from the single-request steps)"
        )
    modes = tuple(m for m in args.modes.split(",") if m)
    for m in modes:
        if m not in TRANSFER_ARMS:
            ap.error(f"unknown mode {m!r}; known: {list(TRANSFER_ARMS)}")

    t_start = time.monotonic()
    phases = Phases()
    model_dir = args.model or ensure_model(ModelShape())
    facts = model_facts(Path(model_dir))
    code = code_version()  # the code this process runs: edits made later do not
    run_id = stamp()
    out = args.out or DEFAULT_RESULTS_DIR / f"mb7-{run_id}.json"
    log_dir = out.parent / f"mb7-{run_id}-logs"
    steps = {
        load: plan(args.sizes, args.reps, load, modes, prefill_only=(load == 0))
        for load in args.loads
    }
    progress = Progress([s for v in steps.values() for s in v])
    progress.note(
        f"model {facts['path']} ({facts['layers']} layers, "
        f"{facts['kv_bytes_per_token'] / 1024:.0f} KiB KV/token); KV tokens "
        f"{args.sizes}; {args.reps} reps; modes {list(modes)}; loads {args.loads}; "
        f"{progress.count} measurements"
    )
    probe_log = log_dir / "engine-probe.log"
    layer = one_layer_writes(
        args.sizes,
        facts["kv_bytes_per_token"],
        facts["layers"],
        args.protocol,
        probe_log,
    )
    progress.note(
        "one layer's write on the engine: "
        + ", ".join(
            f"{n} tok {v['layer_bytes'] / 2**20:.1f} MiB in {1e3 * v['median_s']:.1f} ms"
            for n, v in layer.items()
        )
        + f" (engine log: {probe_log})"
    )
    phases.lap("model and engine probe")
    samples, held, warm = [], [], []
    conc_samples, conc_held = [], []
    for io_on, loads in cluster_plan(args.loads, args.io_cpus):
        s, h, w, (cs, ch) = run_cluster(
            args,
            facts,
            log_dir / ("io-on-d" if io_on else "io-per-instance"),
            io_on,
            {x: steps[x] for x in loads},
            progress,
            modes,
            phases,
        )
        samples += s
        held += h
        conc_samples += cs
        conc_held += ch
        warm.append({"io_cpus": io_on, "requests": w})

    rows = build_rows(samples, {n: v["median_s"] for n, v in layer.items()}, facts)
    tgts = targets(rows)
    conc_rows = level_rows(
        conc_samples,
        conc_held,
        {r["kv_tokens"]: r["floor_s"] for r in rows if r["load"] == 0 and r["floor_s"]},
        {n: v["gb_per_s"] * 1e9 for n, v in layer.items()},
    )
    machine = machine_info()
    result = {
        "benchmark": "mb7",
        "machine": machine,
        "code": code,
        "model": facts,
        "config": config_of(args),
        "one_layer_write": layer,
        "warm_up": warm,
        "rows": rows,
        "targets": tgts,
        "blocks_held": held,
        "samples": samples,
        "concurrency": {
            "rows": conc_rows,
            "samples": conc_samples,
            "blocks_held": conc_held,
        },
        "seconds": time.monotonic() - t_start,
        "phases": phases.laps,
    }
    mname = f"{machine.get('model_name', '?')}, {machine.get('cores')} cores"
    lines = summary_lines(rows, tgts, held)
    if conc_rows:
        lines.append(
            "[mb7] concurrency sweep (idle cluster; N P->D requests at once from "
            f"one P, or alternating between two; prompts of {args.sweep_sizes} KV "
            "tokens mixed; engines' clock):"
        )
        lines += ["    " + ln for ln in table_lines(conc_rows)]
    lines.append(
        f"[mb7] {len(samples)} measurements in {result['seconds'] / 60:.1f} min on "
        f"{mname}; logs in {log_dir}"
    )
    lines.append("[mb7] where the run's time went: " + phases.text())
    result["summary"] = {"lines": lines}
    png = plot(rows, out.with_suffix(".png"), facts, provenance(machine, code, run_id))
    return finish(
        "mb7",
        out,
        result,
        TABLE,
        lambda r: (r["load"], r["mode"], r["kv_tokens"]),
        png,
        display=table_rows,
    )


if __name__ == "__main__":
    raise SystemExit(main())
