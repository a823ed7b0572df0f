"""AIPerf's agentic-code traces for microbench.sessions.

``aiperf synthesize agentic-code`` (AIPerf, Apache-2.0) writes multi-turn
Mooncake-format traces shaped like agentic coding: a prefix every session shares
(tools, system prompt), one per session, a history growing turn by turn, short
tool-call gaps and long human ones, resets. It runs offline once installed. AIPerf
pins versions that vLLM's environment does not take (pandas, pyzmq, ...), so it
lives in a virtualenv of its own, ``.venv-aiperf`` beside the project's, made on
first use (``ensure()``: a few minutes, printed as it goes).

``agentic-code-small.json`` beside this module is AIPerf's default distribution
(its ``configs/default.json``) with every length divided by about 4 (shared
prefix 32,000 -> 8,192 tokens, new tokens a turn 6,000 -> 1,200 mean, prompts
at most 24,000 tokens, outputs 1,000 -> 200 mean) so that, after the benchmark's
own 4x block scaling, a session's first six turns fit this machine's prompts;
delays, resets and the block size (512) are AIPerf's.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
VERSION = "0.13.0"
VENV = PROJECT / ".venv-aiperf"
SMALL_CONFIG = Path(__file__).with_name("agentic-code-small.json")
INSTALL_TIMEOUT_S = 1800
SYNTH_TIMEOUT_S = 600


def _run(cmd: list[str], what: str, timeout: float) -> None:
    t0 = time.monotonic()
    print(f"[sessions] {what}: {' '.join(cmd)}", flush=True)
    try:
        got = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what}: no end after {timeout:.0f} s") from None
    if got.returncode != 0:
        tail = "\n".join((got.stdout + got.stderr).splitlines()[-20:])
        raise RuntimeError(f"{what} failed (exit {got.returncode}):\n{tail}")
    print(f"[sessions] {what}: done in {time.monotonic() - t0:.0f} s", flush=True)


def ensure(venv: Path = VENV) -> Path:
    """The ``aiperf`` command of ``venv``, installed (aiperf==VERSION) if missing."""
    exe = venv / "bin" / "aiperf"
    stamp = venv / f".aiperf-{VERSION}"
    if exe.exists() and stamp.exists():
        return exe
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)], "making .venv-aiperf", 300)
    _run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            f"aiperf=={VERSION}",
        ],
        f"installing aiperf {VERSION} into {venv.name} (first use only; minutes)",
        INSTALL_TIMEOUT_S,
    )
    stamp.touch()
    return exe


def synthesize(
    out_dir: Path, sessions: int, seed: int, config: Path = SMALL_CONFIG
) -> Path:
    """An agentic-code trace of ``sessions`` sessions: the JSONL's path."""
    exe = ensure()
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*/dataset.jsonl"))
    _run(
        [
            str(exe),
            "synthesize",
            "agentic-code",
            "--num-sessions",
            str(sessions),
            "--seed",
            str(seed),
            "--config",
            str(config),
            "--output",
            str(out_dir),
        ],
        f"aiperf synthesize agentic-code ({sessions} sessions)",
        SYNTH_TIMEOUT_S,
    )
    made = [
        p for p in set(out_dir.glob("*/dataset.jsonl")) - before if p.stat().st_size
    ]
    if len(made) != 1:
        raise RuntimeError(
            f"aiperf synthesize: expected one new */dataset.jsonl under {out_dir}, "
            f"found {len(made)}"
        )
    return made[0]
