"""Shared pieces of the microbenchmarks: prompts, machine facts, JSON + table output,
the command line's shared options and the plots' figures."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.launcher import log_tail

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS_DIR = PROJECT_ROOT / "results"


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
    }
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10
        ).stdout
        for line in out.splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("Model name", "Vendor ID"):
                info[key.strip().lower().replace(" ", "_")] = val.strip()
            if key.strip() == "Flags":
                info["avx512"] = "avx512f" in val.split()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def provenance(machine: dict, code: dict, run_id: str) -> str:
    """A figure's machine, commit and run (its date and time), for its title."""
    isa = {True: "AVX-512", False: "no AVX-512"}.get(machine.get("avx512"), "")
    cpu = ", ".join(
        x
        for x in (f"{machine.get('cores')}-core {machine.get('model_name', '?')}", isa)
        if x
    )
    commit = code.get("commit", "?") + (" with changes" if code.get("changed") else "")
    return f"{cpu}; commit {commit}; run {run_id}"


def code_version() -> dict:
    """The project's commit the run used, and whether the checkout had changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(PROJECT_ROOT),
                "status",
                "--porcelain",
                "--untracked-files=no",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "changed": None}
    return {"commit": head or None, "changed": bool(dirty)}


def verbose() -> bool:
    """VMP_VERBOSE=1 (scripts/main.sh -v): show what normally goes to log files too."""
    return os.environ.get("VMP_VERBOSE", "") not in ("", "0")


def run_logged(module: str, args: list[str], log_path: Path, *, timeout: float) -> Any:
    """``python -m module *args --result FILE`` in a child process whose stdout and
    stderr are appended to ``log_path`` (also shown here with VMP_VERBOSE=1); returns
    the JSON the child wrote to FILE. Keeps what C++ libraries and vLLM write to the
    process's own file descriptors (glog lines, vLLM's log) off the terminal.
    Raises RuntimeError naming the log and showing its tail when the child fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="vmp-child-") as tmp,
        open(log_path, "a") as log,
    ):
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, *args, "--result", str(result)]
        log.write(f"# {shlex.join(cmd)}\n")
        log.flush()
        show = verbose()
        proc = subprocess.Popen(
            cmd,
            cwd=PROJECT_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if show else log,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        try:
            if show:  # no timeout while streaming: the child's own timeouts bound it
                for line in proc.stdout:
                    log.write(line)
                    sys.stderr.write(line)
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"python -m {module} {args[0] if args else ''} did not finish "
                f"in {timeout:.0f}s (log: {log_path})"
            ) from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        log.flush()
        if rc != 0 or not result.exists():
            raise RuntimeError(
                f"python -m {module} {args[0] if args else ''} failed (exit {rc}; "
                f"log: {log_path}). Last lines:\n{log_tail(log_path, 30)}"
            )
        return json.loads(result.read_text())


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec)."""
    head = [h for _, h, _ in columns]
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt) if fmt else str(v))
        body.append(cells)
    widths = [
        max(len(h), *(len(c[i]) for c in body)) if body else len(h)
        for i, h in enumerate(head)
    ]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join(
        [line(head), line(["-" * w for w in widths])] + [line(c) for c in body]
    )


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


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


def figure(
    nrows: int, ncols: int, figsize: tuple[float, float], *, tag: str | None = None
) -> tuple[Any, Any] | None:
    """``plt.subplots`` on the file-only backend: the figure and its axes, or None
    where matplotlib is not installed (then no plot; said on stderr under ``tag``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if tag:
            print(f"[{tag}] matplotlib not installed: no plot", file=sys.stderr)
        return None
    return plt.subplots(nrows, ncols, figsize=figsize)


def save_figure(
    fig: Any,
    path: Path,
    title: str,
    origin: str,
    *,
    fontsize: float = 9,
    wrap: int | None = None,
) -> Path:
    """Title ``fig`` with ``title`` and ``origin`` (machine, commit and run, as
    :func:`provenance` gives them), wrapped at ``wrap`` characters; write it to
    ``path`` and close it. ``origin`` has no default: no figure is written
    without its machine, date and commit."""
    import matplotlib.pyplot as plt

    full = f"{title} ({origin})"
    fig.suptitle(textwrap.fill(full, wrap) if wrap else full, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class Parser(argparse.ArgumentParser):
    """A benchmark's command line, with the options several benchmarks share."""

    def add_seed(self) -> None:
        self.add_argument("--seed", type=int, default=0)

    def add_kv_cache_gib(self) -> None:
        self.add_argument("--kv-cache-gib", type=int, default=4)

    def add_out(self, default: Path | None = None, help: str | None = None) -> None:
        self.add_argument("--out", type=Path, default=default, help=help)


def parser(module: str, doc: str | None) -> Parser:
    """``python -m microbench.<module>``'s parser, described by ``doc``'s first
    paragraph."""
    return Parser(
        prog=f"python -m microbench.{module}",
        description=doc.split("\n\n")[0] if doc else None,
    )


def config_of(args: argparse.Namespace) -> dict:
    """The parsed options as a result's ``config`` holds them (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def clean_run_target(name: str, row: dict) -> dict:
    """A row's target that every run holds: no error, no wrong sampled answer
    (``row["checks"]``), no KV block held after it (``row["blocks_held_after"]``)."""
    wrong = sum(not c["ok"] for c in row["checks"])
    return {
        "target": f"{name}: 0 errors, 0 wrong answers, 0 blocks held",
        "value": f"{row['errors']} errors, {wrong} wrong of {len(row['checks'])} "
        f"checked, blocks held {row['blocks_held_after']}",
        "met": bool(row["correct"] and not any(row["blocks_held_after"])),
        "why": "",
    }


def target_line(t: dict) -> str:
    """A target as the benchmarks print it."""
    return f"target {'MET' if t['met'] else 'NOT MET'}: {t['target']}: {t['value']}" + (
        f" ({t['why']})" if t["why"] else ""
    )


def finish(
    tag: str,
    out: Path,
    result: dict,
    table: list[tuple[str, str, str]],
    label: Callable[[dict], object],
    png: Path | None = None,
    display: Callable[[list[dict]], list[dict]] | None = None,
) -> int:
    """Write the JSON, print the table (of ``display(rows)`` if given) and the
    summary lines; exit code 1 when a row's correctness check failed."""
    write_json(out, result)
    rows = result["rows"]
    print()
    print(format_table(display(rows) if display else rows, table))
    for line in result["summary"]["lines"]:
        print(line)
    print(f"\n[{tag}] wrote {out}" + (f" and {png}" if png else ""))
    bad = [r for r in rows if not r["correct"]]
    if bad:
        print(
            f"[{tag}] CORRECTNESS FAILED for {[label(r) for r in bad]}: "
            f"{bad[0].get('problems') or bad[0].get('error')}",
            file=sys.stderr,
        )
        return 1
    return 0
