"""Project-wide pytest configuration: markers, the repo root on sys.path, and a
guard that the connector code under test is the code in this repo.

Our connector/ package runs only as placed into the vLLM tree by `build.py apply`
(vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext): tests import it
under that one name. If the placed copy differs from the repo's files, every
unit and integration test fails at once with the command that fixes it, instead
of testing stale code."""

import filecmp
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.vllm_series import selected  # noqa: E402

# The release under test (VMP_VLLM; default the pinned one): its patch folder and tree.
SERIES = selected()


def stale_overlay_files(root: Path = ROOT) -> list[str]:
    """Repo overlay files whose placed copy is missing or different (and placed
    files the repo no longer has)."""
    tree = root / SERIES.tree.relative_to(ROOT)
    problems = []
    for src, dst in SERIES.overlay.items():
        repo_files = {p.relative_to(root / src) for p in (root / src).rglob("*.py")}
        placed_dir = tree / dst
        placed = (
            {p.relative_to(placed_dir) for p in placed_dir.rglob("*.py")}
            if placed_dir.is_dir()
            else set()
        )
        for rel in sorted(repo_files | placed):
            a, b = root / src / rel, placed_dir / rel
            if (
                not b.is_file()
                or not a.is_file()
                or not filecmp.cmp(a, b, shallow=False)
            ):
                problems.append(f"{src}/{rel}")
    return problems


@pytest.fixture(autouse=True, scope="session")
def _placed_code_is_current(request):
    wants = any(
        Path(str(item.fspath)).parts[-3:-1]
        in (("tests", "unit"), ("tests", "integration"))
        or "tests/unit" in str(item.fspath)
        or "tests/integration" in str(item.fspath)
        for item in request.session.items
    )
    if wants and (stale := stale_overlay_files()):
        pytest.fail(
            "the vLLM tree holds a stale copy of these files (tests import the placed "
            f"copy): {', '.join(stale[:8])}. Run `python build.py"
            + (
                ""
                if SERIES.pinned
                else f" --patches {SERIES.patches.relative_to(ROOT)}"
            )
            + " apply`.",
            pytrace=False,
        )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "integration: starts real vLLM instances with the real Mooncake engine (slow)",
    )
    config.addinivalue_line(
        "markers",
        "hosts: needs hosts of its own (network namespaces, harness/netns.py); "
        "skipped, with the reason, where they cannot be made",
    )


def pytest_collection_modifyitems(items):
    """Tests marked ``hosts`` are skipped, naming why, without network namespaces."""
    if not any(item.get_closest_marker("hosts") for item in items):
        return
    from harness import netns

    why = netns.available()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"no network namespaces here: {why}")
    for item in items:
        if item.get_closest_marker("hosts"):
            item.add_marker(skip)
