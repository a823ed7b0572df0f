#!/usr/bin/env python3
"""Run upstream vLLM's own unit tests for the areas our patches touch, offline.

    python tests/upstream/run_upstream.py [--tree PATH] [--release V --patches DIR]
                                          [--list] [--timeout S]
                                          [--only SUBSTR ...] [--json OUT]
                                          [--hf-home DIR] [--full-cleanup]
                                          [-- PYTEST_ARGS...]

Runs the tests upstream ships for every file the release's series touches
(selection.py, derived from the patches) and the hand-picked SELECTION below,
with pytest in one subprocess (cwd = the vLLM tree,
the CPU runtime environment of harness.runtime_env.vllm_env(), -p
no:cacheprovider, a per-test timeout), offline: HF_HUB_OFFLINE=1 and a private
HF_HOME holding local stand-ins (hub_standins.py) for the hub models the tests
name. Tests listed in DESELECT are deselected with their reason. The selected
tests skip upstream's per-test global cleanup (upstream_offline_plugin.py, point
4); --full-cleanup keeps it. Prints a table per file (passed / failed / skipped
/ deselected, with reasons) and exits 1 if any selected test failed or errored,
a file could not be collected or the run did not complete; 0 otherwise.
Deselected and skipped tests are never counted as passed.

Use the Python that has the (editable) vLLM installed; the default is the one
running this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Upstream test files run in addition to those the series selects (selection.py),
# each with why it matters to our patch series (the
# MooncakeConnector extensions drive the scheduler's KV-connector paths and the
# KV cache manager; patch 0003 reads the attention backend's KV cache layout,
# 0004 injects faults into received KV).
SELECTION: list[tuple[str, str]] = [
    (
        "tests/v1/core/test_prefix_caching.py",
        "KVCacheManager/BlockPool prefix-cache hits and block hashing: the local hits a "
        "connector's external match is added to, and the blocks Mooncake sends/receives",
    ),
    (
        "tests/v1/core/test_kv_cache_utils.py",
        "KV cache specs, page sizes, KV cache config and block hashes: the layout and "
        "block geometry the connector registers and transfers",
    ),
    (
        "tests/v1/core/test_scheduler.py",
        "the V1 scheduler, including its KV-connector paths (WAITING_FOR_REMOTE_KVS, "
        "finished_recving/sending, async loads) that MooncakeConnector drives",
    ),
    (
        "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
        "decode-side (kv_consumer, do_remote_prefill) request lifecycle with a connector",
    ),
    (
        "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
        "prefill-side (kv_producer, do_remote_decode) lifecycle: blocks held until sent",
    ),
    (
        "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
        "scheduler recovery when a connector reports invalid (failed) KV blocks: the path "
        "a bad or fault-injected (patch 0004) transfer takes",
    ),
    (
        "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
        "invalid received blocks are recomputed, not freed early, not prefix-cached",
    ),
    (
        "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py",
        "blocks whose KV load failed are evicted from the prefix cache",
    ),
    (
        "tests/v1/kv_connector/unit/test_error_propagation.py",
        "kv_load_failure_policy='fail': a failed KV load ends the request with an error",
    ),
    (
        "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",
        "worker-side connector metadata bind/clear around each forward pass",
    ),
    (
        "tests/v1/kv_connector/unit/test_output_aggregator.py",
        "aggregation of finished_sending/finished_recving/invalid blocks across workers",
    ),
]

_LLAVA = (
    "builds its scheduler from llava-hf/llava-1.5-7b-hf (multimodal: vision "
    "config, image processor and processor); no offline stand-in provided"
)
# node id, or node id without [params] (covers every parametrization) -> reason
DESELECT: dict[str, str] = {
    f"tests/v1/core/test_scheduler.py::{name}": _LLAVA
    for name in (
        "test_schedule_multimodal_requests",
        "test_schedule_partial_requests",
        "test_no_mm_input_chunking",
        "test_ec_connector_text_only_request",
        "test_ec_connector_cache_hit_external_load",
        "test_ec_connector_cache_miss_computes_locally",
        "test_ec_connector_with_partial_cache_hit_multi_round",
        "test_ec_connector_schedule_multiple_requests",
        "test_ec_connector_unable_to_allocate",
        "test_priority_scheduling_ec_connector_preemption_and_resumption",
        "test_ec_connector_allocate_encoder_tokens_with_external_load",
        "test_eagle3_mm_encoder_cache_with_shift",
    )
}
_HTTPX2 = (
    "patches httpx.AsyncClient, but upstream's module imports httpx as "
    "huggingface_hub.utils.httpx, which with huggingface_hub 2.4.0 (the lock) is "
    "httpx2: the stub is never called and the real client tries the test's host "
    "(this series' one hook there returns the host as upstream has it)"
)
DESELECT.update(
    {
        f"tests/v1/kv_connector/unit/test_mooncake_connector.py::{name}": _HTTPX2
        for name in (
            "test_register_worker_retries_on_read_timeout",
            "test_register_worker_raises_after_max_attempts",
        )
    }
)

LLAVA_MODEL = "llava-hf/llava-1.5-7b-hf"


def llava_tests(tree: Path) -> dict[str, str]:
    """Deselections for the tests of the tree's test_scheduler.py that name the llava
    model themselves (newer releases add such tests: 0.32.0 has 18 more than the
    list above), found by reading the file, so a release's own tests are covered."""
    import ast  # noqa: PLC0415

    rel = "tests/v1/core/test_scheduler.py"
    path = tree / rel
    if not path.is_file():
        return {}
    source = path.read_text()
    found = {}
    for node in ast.parse(source).body:
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test_")
            and LLAVA_MODEL in (ast.get_source_segment(source, node) or "")
        ):
            found[f"{rel}::{node.name}"] = _LLAVA
    return found


DEFAULT_TIMEOUT = 300  # seconds per test (pytest-timeout)


def runtime_env(
    hf_home: Path, deselect_file: Path, report_file: Path
) -> dict[str, str]:
    sys.path.insert(0, str(REPO))
    from harness.runtime_env import vllm_env  # noqa: PLC0415

    env = vllm_env()
    env.update(
        {
            # keep the cwd (the tree, with its own vllm.egg-info) off sys.path,
            # in pytest and in the subprocesses vLLM starts (model inspection)
            "PYTHONSAFEPATH": "1",
            "HF_HOME": str(hf_home),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "UPSTREAM_DESELECT": str(deselect_file),
            "UPSTREAM_REPORT": str(report_file),
        }
    )
    for var in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "TRANSFORMERS_CACHE",
        "HF_TOKEN",
        "PYTEST_ADDOPTS",
        "PYTEST_PLUGINS",
    ):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env


# What upstream's test_kv_cache_utils.py::test_is_kv_cache_spec_uniform imports in
# a `python -O` subprocess it gives 60 s.
OPTIMIZED_IMPORT = "import vllm.v1.core.kv_cache_utils, vllm.v1.kv_cache_interface"
WARM_TIMEOUT_S = 900


def warm_optimized_bytecode(python: str, tree: Path, env: dict[str, str]) -> None:
    """Write the optimized bytecode that upstream test's ``python -O`` import
    needs. With PYTHONDONTWRITEBYTECODE (as on CI) none exists, and that import
    compiles vLLM and torch from source every time: past its 60 s on a 2-core
    machine running other tests. A failure here is left to the test to show."""
    warm_env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    try:
        subprocess.run(
            [python, "-O", "-c", OPTIMIZED_IMPORT],
            cwd=tree,
            env=warm_env,
            timeout=WARM_TIMEOUT_S,
            check=False,
            capture_output=True,
        )
    except subprocess.TimeoutExpired:
        print(
            f"run_upstream: `python -O -c {OPTIMIZED_IMPORT!r}` took over "
            f"{WARM_TIMEOUT_S} s",
            flush=True,
        )


def read_report(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a crash
            out.append(json.loads(line))
    return out


def summarize(
    files: list[str], records: list[dict], pytest_rc: int | None
) -> tuple[str, bool, dict]:
    per_file: dict[str, Counter] = {f: Counter() for f in files}
    reasons: dict[str, list[str]] = defaultdict(list)
    deselect_reasons: dict[str, Counter] = defaultdict(Counter)
    session = None
    used_keys = set()
    finished = {r["nodeid"] for r in records if r["kind"] == "test"}
    for rec in records:  # started, never reported: the process died in that test
        if rec["kind"] == "start" and rec["nodeid"] not in finished:
            finished.add(rec["nodeid"])
            records = records + [
                {
                    "kind": "test",
                    "nodeid": rec["nodeid"],
                    "outcome": "error",
                    "reason": "CRASHED: the pytest process died during this test",
                }
            ]
    for rec in records:
        nodeid = rec.get("nodeid", "")
        fname = nodeid.split("::", 1)[0]
        kind = rec["kind"]
        if kind == "session":
            session = rec
        elif kind == "deselected":
            per_file.setdefault(fname, Counter())["deselected"] += 1
            deselect_reasons[fname][rec["reason"]] += 1
            used_keys.add(rec["key"])
        elif kind == "collect_error":
            per_file.setdefault(fname, Counter())["collect_error"] += 1
            reasons[fname].append(f"COLLECTION ERROR {nodeid}: {rec['reason']}")
        elif kind == "test":
            outcome = rec["outcome"] or "error"
            per_file.setdefault(fname, Counter())[outcome] += 1
            if outcome not in ("passed",):
                reasons[fname].append(
                    f"{outcome.upper()} {nodeid.split('::', 1)[-1]}: {rec['reason']}"
                )

    ok = True
    lines = []
    cols = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "deselected")
    header = f"{'file':<62} " + " ".join(f"{c:>10}" for c in cols)
    lines += [header, "-" * len(header)]
    total = Counter()
    for f in files + [f for f in per_file if f not in files]:
        c = per_file.get(f, Counter())
        total.update(c)
        ran = sum(
            c[k] for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
        )
        note = ""
        if c["collect_error"]:
            note = "  <- COLLECTION ERROR"
        elif ran == 0 and c["deselected"] == 0:
            note = "  <- NO RESULTS (not collected or run crashed)"
        if note or c["failed"] or c["error"]:
            ok = False
        lines.append(f"{f:<62} " + " ".join(f"{c[k]:>10}" for k in cols) + note)
    lines.append("-" * len(header))
    lines.append(f"{'TOTAL':<62} " + " ".join(f"{total[k]:>10}" for k in cols))

    detail = []
    for f in files + [f for f in per_file if f not in files]:
        if deselect_reasons.get(f) or reasons.get(f):
            detail.append(f"\n{f}:")
            for reason, n in deselect_reasons.get(f, {}).items():
                detail.append(f"  DESELECTED x{n}: {reason}")
            for r in reasons.get(f, []):
                detail.append(f"  {r}")
    stale = sorted(set(DESELECT) - used_keys)
    stale = [k for k in stale if k.split("::", 1)[0] in files]
    if stale:
        detail.append(
            "\nWARNING: deselect entries that matched no collected test (renamed upstream?):"
        )
        detail += [f"  {k}" for k in stale]
    if session is None:
        ok = False
        detail.append(
            f"\nRUN DID NOT COMPLETE: pytest exited with {pytest_rc} and no session summary "
            "(crash or kill); files without results are counted as failures."
        )
    elif session["exitstatus"] not in (
        0,
        1,
    ):  # 2 interrupted, 3 internal, 4 usage, 5 no tests
        ok = False
        detail.append(f"\npytest exit status {session['exitstatus']} (not a clean run)")
    summary = "\n".join(lines + detail)
    counts = {f: dict(per_file.get(f, Counter())) for f in per_file}
    return (
        summary,
        ok,
        {
            "files": counts,
            "total": dict(total),
            "stale_deselect": stale,
            "pytest_rc": pytest_rc,
            "session": session,
        },
    )


def print_list(files: list[str], sel: Any) -> None:
    from hub_standins import STANDINS  # noqa: PLC0415

    print("Selected upstream test files:")
    for path in files:
        print(f"  {path}\n      why: {sel.why[path]}")
    if sel.not_shipped:
        print("\nNot in this release:")
        for path, since in sel.not_shipped.items():
            print(f"  {path} (from {since})")
    if sel.untested:
        print("\nTouched by the series, no upstream test file selected:")
        for path, why in sel.untested.items():
            print(f"  {path}\n      why: {why}")
    print("\nDeselected (reported as DESELECTED, never as passed):")
    for key, reason in DESELECT.items():
        print(f"  {key}\n      reason: {reason}")
    print("\nOffline hub stand-ins (config from the real repo, small local tokenizer):")
    for name, (why, _f) in STANDINS.items():
        print(f"  {name}: {why}")


def selected_series() -> tuple[str, Path]:
    """(version, patches folder) of the selected release (harness/vllm_series.py)."""
    sys.path.insert(0, str(REPO))
    from harness.vllm_series import selected  # noqa: PLC0415

    series = selected()
    return series.version, series.patches


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree",
        type=Path,
        default=REPO / "third_party" / "vllm",
        help="vLLM source tree holding tests/ (default: <repo>/third_party/vllm)",
    )
    ap.add_argument(
        "--release",
        help="the tree's vLLM release (default: the selected series', "
        "harness/vllm_series.py)",
    )
    ap.add_argument(
        "--patches",
        type=Path,
        help="the release's series folder (default: the selected series')",
    )
    ap.add_argument("--list", action="store_true", help="print the selection and exit")
    ap.add_argument(
        "--timeout", type=int, default=DEFAULT_TIMEOUT, help="per-test timeout, seconds"
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SUBSTR",
        help="run only the selected files whose path contains SUBSTR (repeatable)",
    )
    ap.add_argument(
        "--python", default=sys.executable, help="interpreter with vLLM installed"
    )
    ap.add_argument(
        "--hf-home",
        type=Path,
        help="build the stand-ins here and keep them "
        "(default: a temporary directory, removed afterwards)",
    )
    ap.add_argument("--json", type=Path, help="also write the counts as JSON here")
    ap.add_argument(
        "--full-cleanup",
        action="store_true",
        help="run upstream's cleanup_dist_env_and_memory() after every test, as "
        "upstream's suite does (slower; by default the selected tests are marked "
        "skip_global_cleanup: tests/upstream/upstream_offline_plugin.py)",
    )
    args = ap.parse_args(argv)

    sys.path.insert(0, str(HERE))
    from selection import derive, touched_files  # noqa: PLC0415

    release, patches = selected_series()
    if args.release or args.patches:
        if not (args.release and args.patches):
            ap.error("--release and --patches go together")
        release, patches = args.release, args.patches
    tree = args.tree.resolve()
    sel = derive(touched_files(patches), SELECTION, tree, release)
    if sel.errors:
        print(
            "run_upstream: the selection of vLLM "
            f"{release} ({patches}):\n  " + "\n  ".join(sel.errors),
            file=sys.stderr,
        )
        return 2
    files = [f for f in sel.files if not args.only or any(s in f for s in args.only)]
    if not files:
        ap.error("--only matched no selected file")
    if args.list:
        print_list(files, sel)
        return 0

    from hub_standins import build_hf_home  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="vmp-upstream-"))
    try:
        hf_home = args.hf_home.resolve() if args.hf_home else work / "hf_home"
        build_hf_home(hf_home)
        deselect_file = work / "deselect.json"
        DESELECT.update(llava_tests(args.tree))
        deselect_file.write_text(json.dumps(DESELECT, indent=1))
        report_file = work / "report.jsonl"
        env = runtime_env(hf_home, deselect_file, report_file)
        if args.full_cleanup:
            env["UPSTREAM_FULL_CLEANUP"] = "1"
        cmd = [
            args.python,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "upstream_offline_plugin",
            "--rootdir",
            str(tree),
            "--timeout",
            str(args.timeout),
            "-q",
            "-rfEs",
            "--continue-on-collection-errors",
            "--durations=10",
            *files,
            *extra,
        ]
        if (tree / "pyproject.toml").is_file():
            cmd[3:3] = ["-c", str(tree / "pyproject.toml")]
        print(
            f"run_upstream: tree {tree}\nrun_upstream: HF_HOME {hf_home} (offline stand-ins)\n"
            f"run_upstream: cd {tree} && {' '.join(cmd)}",
            flush=True,
        )
        warm_optimized_bytecode(args.python, tree, env)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=tree, env=env)
        elapsed = time.monotonic() - t0
        summary, ok, data = summarize(files, read_report(report_file), proc.returncode)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print("\n" + "=" * 30 + " upstream vLLM unit tests (offline) " + "=" * 30)
    print(summary)
    print(f"\nselected from the series of vLLM {release} ({patches}) and by hand:")
    for path in sel.not_shipped:
        print(f"  not in this release: {path} (from {sel.not_shipped[path]})")
    for path, why in sel.untested.items():
        print(f"  touched, no upstream test file selected: {path}: {why}")
    print(
        f"\nwall time {elapsed:.0f} s; pytest exit code {proc.returncode}; "
        f"result: {'OK' if ok else 'FAILED'}"
    )
    if args.json:
        data.update(
            {
                "elapsed_s": round(elapsed, 1),
                "ok": ok,
                "tree": str(tree),
                "release": release,
                "why": {f: sel.why[f] for f in files},
                "untested": sel.untested,
                "not_shipped": sel.not_shipped,
            }
        )
        args.json.write_text(json.dumps(data, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
