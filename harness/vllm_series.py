"""Which vLLM release this checkout runs on: the pinned series or a rolled one.

    VMP_VLLM=0.32.0 scripts/test.sh      (or scripts/setup.sh --vllm 0.32.0)
    python -m harness.vllm_series shell     the selection as shell assignments
    python -m harness.vllm_series releases  the releases scripts/test.sh runs, as
                                            shell assignments

One place decides it, read once from ``VMP_VLLM`` (default: the pinned release,
``patches/``). The releases are those of ``releases.toml`` (patchset/release_index.py):
each has its own patch folder (``patches/`` or ``rolls/<version>/``, whose
``upstream.toml`` names the tree), its own virtualenv (``.venv`` for the pinned one,
``.venv-<version>`` for a roll, since each release needs its own torch) and its own
requirements folder (``requirements/`` or ``requirements/<version>/``, each with
base/cpu/cuda/lock). The set-up and test scripts, the doctor and the test suite's
guards read it here; this module needs the standard library only (the scripts run it
with the system's python3 before a virtualenv exists).
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# run as a script too (scripts/*.sh, with the system's python3)
sys.path.insert(0, str(ROOT))
from patchset import release_index  # noqa: E402

# releases.toml: every supported release, the pinned one, and which are checked only
# (build.py check: every patch applies with zero fuzz, the overlay's subclasses
# still fit upstream's classes; no CPU build of them is on the package index, so
# they are never installed or run here)
RELEASES = release_index.read(ROOT)
PINNED = next(r.version for r in RELEASES.values() if r.pinned)
# every release that is set up and tested -> its patch folder (relative to ROOT)
SUPPORTED: dict[str, str] = {
    v: r.patches for v, r in RELEASES.items() if r.status == release_index.TESTED
}
CHECKED_ONLY: dict[str, str] = {
    v: r.patches for v, r in RELEASES.items() if r.status == release_index.CHECKED
}

# Tests whose outcome does not depend on the vLLM release: they run the Mooncake
# engine (the same pinned version in every release's lock.txt) and this series' own
# writer (one overlay for every release), no vLLM code. scripts/test.sh runs them
# with the pinned release only; `scripts/test.sh --vllm V` runs them on V as well.
RELEASE_INDEPENDENT_TESTS = (
    "tests/integration/test_engine_failure_semantics.py",
    "tests/integration/test_engine_listeners.py",
)

# Tests of vLLM instances that scripts/test.sh runs with the pinned release only,
# for CI's time: on an AVX2-only machine of this project's kind the whole suite on
# both releases took close to CI's 90 min, and these are its slowest modules whose
# subject is this series' own code (the fault matrix, D's handling of a source's
# answers). `scripts/test.sh --vllm V` runs them on V as well.
PINNED_ONLY_TESTS = (
    "tests/integration/test_faults.py",
    "tests/integration/test_faults_cut.py",
    "tests/integration/test_faults_blind.py",
    "tests/integration/test_push_proxy_answers.py",
)

# Integration tests that scripts/test.sh runs beside the unit tests (which start no
# vLLM instance) instead of after them, each release those of them it runs (a roll:
# not the pinned-only ones): the ones that mostly wait (link cuts, deadlines of
# minutes; one cluster each, started once) and one instance's start that ends in
# an exit. Measured on the 2-core machine: the fault matrix beside both releases'
# unit runs, all of it ended in 8.9 min instead of 14.4 one after the other.
BESIDE_UNIT_TESTS = (
    "tests/integration/test_bootstrap_port_taken.py",
    "tests/integration/test_faults.py",
    "tests/integration/test_faults_cut.py",
)

# Tests run once, with the pinned release, that scripts/test.sh runs in the
# background beside every release's integration tests: the release-independent ones and
# the pinned-only ones that mostly wait out a deadline (test_push_proxy_answers: D's
# hold of about 31 s).
BESIDE_INTEGRATION_TESTS = RELEASE_INDEPENDENT_TESTS + (
    "tests/integration/test_push_proxy_answers.py",
    "tests/integration/test_faults_blind.py",
)

# Unit tests of the project's own tooling (the harness, the scripts, the benchmarks'
# release-free parts) that import no vLLM and no connector code: the same on every
# release, so scripts/test.sh runs them with the pinned release only
# (tests/unit/harness/test_vllm_series.py checks that none of them imports vllm).
TOOLING_TESTS = (
    "tests/unit/harness",
    "tests/unit/scripts",
    "tests/unit/microbench/test_bandwidth.py",
    "tests/unit/microbench/test_mb7_eta.py",
    "tests/unit/microbench/test_sessions_trace.py",
    "tests/unit/test_connector_imports.py",
)


@dataclass(frozen=True)
class VllmSeries:
    version: str
    patches: Path  # upstream.toml, series, *.patch
    tree: Path  # the patched tree build.py applies into
    venv: Path  # the virtualenv that has this release installed
    requirements: Path  # base.txt, cpu.txt, cuda.txt, lock.txt
    overlay: dict[str, str]  # repo folder -> placed folder in the tree ([[overlay]])

    @property
    def pinned(self) -> bool:
        return self.version == PINNED


def series(version: str, root: Path = ROOT) -> VllmSeries:
    """The series for ``version``, a tested release of ``root``'s releases.toml (this
    checkout's: the index read once at import); a ValueError naming the supported
    ones (or what is wrong with the index) else."""
    try:
        index = RELEASES if root == ROOT else release_index.read(root)
    except release_index.PatchsetError as exc:
        raise ValueError(str(exc)) from exc
    release = index.get(version)
    if release is None or release.status != release_index.TESTED:
        tested = [v for v, r in index.items() if r.status == release_index.TESTED]
        raise ValueError(
            f"vLLM {version!r} is not a supported release of this series; "
            f"supported: {', '.join(tested)}"
        )
    patches = root / release.patches
    manifest = tomllib.loads((patches / "upstream.toml").read_text())
    return VllmSeries(
        version=version,
        patches=patches,
        tree=root / manifest["upstream"]["tree"],
        venv=root / release.venv,
        requirements=root / release.requirements,
        overlay={o["src"]: o["dst"] for o in manifest.get("overlay", [])},
    )


def selected(root: Path = ROOT) -> VllmSeries:
    """The series ``VMP_VLLM`` selects (default: the pinned release)."""
    return series(os.environ.get("VMP_VLLM") or PINNED, root)


def release_assignments() -> dict[str, str]:
    """What scripts/test.sh runs: the pinned release, the rolls it runs, the patch
    folders of the rolls it checks only, the tests it runs once, and of those the
    ones it runs beside the integration tests, and the integration tests it
    runs beside the unit tests (space-separated)."""
    return {
        "VMP_PINNED": PINNED,
        "VMP_ROLLS": " ".join(v for v in SUPPORTED if v != PINNED),
        "VMP_CHECKED_ONLY": " ".join(CHECKED_ONLY.values()),
        "VMP_ONCE": " ".join(
            RELEASE_INDEPENDENT_TESTS + PINNED_ONLY_TESTS + TOOLING_TESTS
        ),
        "VMP_BESIDE_INTEGRATION": " ".join(BESIDE_INTEGRATION_TESTS),
        "VMP_BESIDE_UNIT": " ".join(BESIDE_UNIT_TESTS),
    }


def selection_assignments() -> dict[str, str]:
    """The series VMP_VLLM selects; a ValueError names the supported ones."""
    s = selected()
    return {
        "VMP_VLLM": s.version,
        "VMP_PATCHES": str(s.patches.relative_to(ROOT)),
        "VMP_TREE": str(s.tree.relative_to(ROOT)),
        "VMP_DEFAULT_VENV": str(s.venv),
        "VMP_REQ_DIR": str(s.requirements),
    }


MODES = {"shell": selection_assignments, "releases": release_assignments}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in MODES:
        print(
            f"usage: python -m harness.vllm_series {{{'|'.join(MODES)}}}",
            file=sys.stderr,
        )
        return 2
    try:
        values = MODES[argv[0]]()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, value in values.items():
        print(f"{name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
