"""The process environment vLLM's CPU backend and the Mooncake engine need here.

The CPU backend refuses to start unless tcmalloc is preloaded, and runs much
better with Intel's OpenMP runtime (shipped as a wheel in the venv) preloaded
too. On a CUDA host none of this applies and the environment is passed through.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)


def is_cpu_target() -> bool:
    """True unless this is a GPU host (VLLM_TARGET_DEVICE, else whether nvidia-smi sees a GPU).

    Not decided from the installed vllm's version suffix: run from inside the
    source tree, the sdist's vllm.egg-info (no "+cpu") shadows the install.
    """
    target = os.environ.get("VLLM_TARGET_DEVICE")
    if target:
        return target == "cpu"
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return True
    try:
        return (
            subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, timeout=20
            ).returncode
            != 0
        )
    except (OSError, subprocess.SubprocessError):
        return True


def preload_libs() -> list[str]:
    libs = []
    for cand in TCMALLOC_CANDIDATES:
        if Path(cand).exists():
            libs.append(cand)
            break
    else:
        raise RuntimeError(
            "libtcmalloc_minimal.so.4 not found: vLLM's CPU backend needs it in "
            "LD_PRELOAD. Install it with `apt-get install -y libtcmalloc-minimal4` "
            "(scripts/setup.sh does this)."
        )
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists():
        libs.append(str(iomp))
    return libs


def vllm_env(base: dict[str, str] | None = None, **overrides: str) -> dict[str, str]:
    """A copy of the environment ready to run a vLLM process on this machine."""
    env = dict(os.environ if base is None else base)
    if is_cpu_target():
        preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
        for lib in preload_libs():
            if lib not in preload:
                preload.append(lib)
        env["LD_PRELOAD"] = ":".join(preload)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    # Our own modules are importable in spawned processes too.
    project_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [project_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.update(overrides)
    return env
