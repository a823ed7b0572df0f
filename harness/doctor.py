"""Check that the environment scripts/setup.sh built actually works.

    python -m harness.doctor

Checks, each in a fresh process with the runtime environment vLLM needs here:
the installed vllm is the patched tree of the selected release (VMP_VLLM, default
the pinned 0.18.1; harness/vllm_series.py) and reports that version;
its kernels load on this CPU; the Mooncake transfer engine imports and starts
on TCP. Exits non-zero naming the first check that failed and what to do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.runtime_env import vllm_env
from harness.vllm_series import selected

ROOT = Path(__file__).resolve().parent.parent
SERIES = selected()
SETUP = "scripts/setup.sh" + ("" if SERIES.pinned else f" --vllm {SERIES.version}")

CHECKS: list[tuple[str, str, str]] = [
    (
        f"vllm is the patched tree of {SERIES.patches.relative_to(ROOT)}, "
        f"version {SERIES.version}",
        f"""
import vllm, os, sys
from importlib.metadata import version
tree = os.path.realpath({str(SERIES.tree)!r})
where = os.path.realpath(os.path.dirname(os.path.dirname(vllm.__file__)))
assert where == tree, f"vllm imported from {{where}}, expected {{tree}}"
assert vllm.__version__.split("+")[0] == {SERIES.version!r}, vllm.__version__
assert version("vllm").split("+")[0] == {SERIES.version!r}, version("vllm")
print("vllm", vllm.__version__, "from", where)
""",
        f"run {SETUP} (it re-applies the series and reinstalls the tree)",
    ),
    (
        "vLLM's platform kernels load on this machine",
        """
from vllm.platforms import current_platform
current_platform.import_kernels()
import torch
if current_platform.device_type == "cpu":
    assert hasattr(torch.ops._C, "rms_norm"), "vllm CPU kernels not registered"
print("platform", current_platform.device_type, "torch", torch.__version__)
""",
        "the precompiled kernels did not load: check patch 0001 placed _C_AVX2/_C_AVX512 in "
        f"{SERIES.tree.relative_to(ROOT)}/vllm and that LD_PRELOAD has libtcmalloc "
        "(apt libtcmalloc-minimal4)",
    ),
    (
        "Mooncake transfer engine starts on TCP",
        """
from mooncake.engine import TransferEngine
e = TransferEngine()
rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
assert rc == 0, f"initialize returned {rc}"
print("mooncake rpc port", e.get_rpc_port())
""",
        "install mooncake-transfer-engine-non-cuda (CPU) and apt libibverbs1",
    ),
]


def main() -> int:
    env = vllm_env()
    for name, code, fix in CHECKS:
        r = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            print(
                f"[doctor] FAILED: {name}\n{tail}\n[doctor] what to do: {fix}",
                file=sys.stderr,
            )
            return 1
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        print(f"[doctor] ok: {name} ({last})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
