"""Which of upstream's test files a release's run selects, derived from its series.

Every upstream file a patch of the release's series touches (patches/series, or
rolls/<version>/series) is looked up here: TESTS_OF names the test files upstream
ships for it, UNTESTED says why there are none we can run. The hand-picked files
of run_upstream.py (the scheduler and KV-cache areas this series' connector
drives) are added to what the series selects.

Checked against the release's tree: a touched file in neither map is an error
(name its tests, or why there are none); a test file the release should ship
(SINCE: the first release that ships it) and does not is an error. Pure: no
vLLM import.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MOONCAKE = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py"
KV_UNIT = "tests/v1/kv_connector/unit"

# upstream file -> the test files upstream ships for it
TESTS_OF: dict[str, tuple[str, ...]] = {
    MOONCAKE: (
        f"{KV_UNIT}/test_mooncake_connector.py",
        f"{KV_UNIT}/test_mooncake_connector_hma.py",
        f"{KV_UNIT}/test_mooncake_stats.py",
    ),
    "vllm/v1/core/block_pool.py": (
        "tests/v1/core/test_prefix_caching.py",
        "tests/v1/core/test_kv_cache_utils.py",
    ),
    "vllm/v1/core/sched/scheduler.py": (
        "tests/v1/core/test_scheduler.py",
        f"{KV_UNIT}/test_remote_prefill_lifecycle.py",
        f"{KV_UNIT}/test_remote_decode_lifecycle.py",
        f"{KV_UNIT}/test_kv_load_failure_recovery.py",
    ),
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": (
        f"{KV_UNIT}/test_kv_connector_lifecycle.py",
        f"{KV_UNIT}/test_output_aggregator.py",
    ),
}

_CPU_RUNTIME = (
    "no upstream test file names this module (vLLM 0.18.1's and 0.32.0's tests/); "
    "every integration test of this project (tests/integration) runs through it "
    "on the CPU backend"
)
# upstream file -> why no upstream test file is selected for it
UNTESTED: dict[str, str] = {
    "setup.py": "a build input: scripts/setup.sh builds, installs and imports the tree "
    "(harness.doctor)",
    "requirements/cpu.txt": "a build input: scripts/setup.sh installs from it",
    "vllm/distributed/kv_transfer/kv_connector/factory.py": "upstream's tests of the "
    "factory (test_multi_connector.py) build LLM(meta-llama/Llama-3.2-1B-Instruct); the "
    "patch changes the class one name resolves to, which "
    "tests/unit/connector/test_ext_connector.py checks",
    "vllm/v1/worker/cpu_model_runner.py": _CPU_RUNTIME,
    "vllm/v1/worker/cpu_worker.py": _CPU_RUNTIME,
    "vllm/utils/cpu_triton_utils.py": _CPU_RUNTIME,
}

# test file -> the first release that ships it
SINCE: dict[str, str] = {
    f"{KV_UNIT}/test_mooncake_connector.py": "0.32.0",
    f"{KV_UNIT}/test_mooncake_connector_hma.py": "0.32.0",
    f"{KV_UNIT}/test_mooncake_stats.py": "0.32.0",
}


@dataclass
class Selection:
    files: list[str] = field(default_factory=list)  # in the order they run
    why: dict[str, str] = field(default_factory=dict)  # file -> why it runs
    untested: dict[str, str] = field(default_factory=dict)  # touched file -> reason
    not_shipped: dict[str, str] = field(default_factory=dict)  # file -> from release
    errors: list[str] = field(default_factory=list)


def touched_files(patches: Path) -> dict[str, list[str]]:
    """Upstream file -> the patches of the series in ``patches`` that touch it."""
    sys.path.insert(0, str(REPO))
    from patchset.exactapply import touched_paths  # noqa: PLC0415
    from patchset.series import read_patch, read_series  # noqa: PLC0415

    out: dict[str, list[str]] = {}
    for name in read_series(patches / "series").names:
        for path in sorted(touched_paths(read_patch(patches / name, name))):
            out.setdefault(path, []).append(name[:4])
    return out


def shipped(path: str, release: str) -> bool:
    from packaging.version import Version  # noqa: PLC0415

    since = SINCE.get(path)
    return since is None or Version(release) >= Version(since)


def derive(
    touched: dict[str, list[str]],
    hand_picked: list[tuple[str, str]],
    tree: Path,
    release: str,
) -> Selection:
    """The release's selection: the tests of every touched file, then the hand-picked."""
    sel = Selection()

    def add(test: str, why: str) -> None:
        if not shipped(test, release):
            sel.not_shipped[test] = SINCE[test]
        elif not (tree / test).is_file():
            sel.errors.append(f"{test} ({why}) is not in the tree {tree}")
        elif test not in sel.why:
            sel.files.append(test)
            sel.why[test] = why

    for path, patches in sorted(touched.items()):
        if path in TESTS_OF:
            for test in TESTS_OF[path]:
                add(test, f"upstream's tests of {path} (patches {', '.join(patches)})")
        elif path in UNTESTED:
            sel.untested[path] = UNTESTED[path]
        else:
            sel.errors.append(
                f"{path} (patches {', '.join(patches)}) has no entry in "
                "tests/upstream/selection.py: name upstream's tests of it in TESTS_OF, "
                "or why there are none in UNTESTED"
            )
    for test, why in hand_picked:
        add(test, why)
    return sel
