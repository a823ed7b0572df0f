"""Runs upstream vLLM's unit tests for the areas our patches touch (offline, on the
patched tree) through tests/upstream/run_upstream.py, and fails with its summary
if any selected upstream test failed; the counts per file stay in
.cache/logs/upstream-<release>.json. Select or skip it with -m upstream /
-m "not upstream". The tree is the selected release's (harness/vllm_series.py:
third_party/vllm for the pinned 0.18.1) unless VMP_UPSTREAM_TREE names another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.vllm_series import selected

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RUNNER = HERE / "run_upstream.py"


@pytest.mark.upstream
@pytest.mark.timeout(1800)
def test_upstream_vllm_unit_tests():
    series = selected()
    tree = Path(os.environ.get("VMP_UPSTREAM_TREE") or series.tree)
    if not (tree / "tests" / "v1" / "core").is_dir():
        pytest.skip(
            f"no vLLM source tree with upstream tests at {tree} (scripts/setup.sh builds it)"
        )
    # the counts per file, kept for the CI results page (scripts/test.sh's logs)
    out = REPO / ".cache" / "logs" / f"upstream-{series.version}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [
            sys.executable,
            str(RUNNER),
            "--tree",
            str(tree),
            "--release",
            series.version,
            "--patches",
            str(series.patches),
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    marker = "=" * 30 + " upstream vLLM unit tests (offline) "
    summary = (
        proc.stdout[proc.stdout.find(marker) :]
        if marker in proc.stdout
        else proc.stdout[-6000:]
    )
    print(summary)
    if proc.returncode != 0:
        pytest.fail(
            f"upstream vLLM unit tests: runner exited {proc.returncode}\n{summary}\n"
            f"--- stderr (tail) ---\n{proc.stderr[-4000:]}",
            pytrace=False,
        )
    data = json.loads(out.read_text())
    assert data["ok"] and data["total"].get("passed", 0) > 0, summary
