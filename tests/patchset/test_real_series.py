"""This repo's own series on the real vLLM 0.18.1 sdist: apply then export changes no byte."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _project():
    sys.path.insert(0, str(REPO))
    from patchset.project import Project

    return Project(REPO)


def _cached_sdist() -> Path:
    from patchset.upstream import cache_dir

    return cache_dir() / _project().manifest.sdist


def _folders() -> list[str]:
    """patches/ and every overlay source folder the real manifest names."""
    return ["patches", *dict.fromkeys(ov.src for ov in _project().manifest.overlays)]


def _tree_files(root: Path) -> dict[str, bytes]:
    out = {}
    for d in _folders():
        for f in sorted((root / d).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                out[str(f.relative_to(root))] = f.read_bytes()
    return out


def test_repo_series_round_trips_on_real_sdist(tmp_path):
    sdist = _cached_sdist()
    if not sdist.is_file():
        pytest.skip(f"real vLLM sdist not cached at {sdist}; run python build.py fetch")
    root = tmp_path / "proj"
    root.mkdir()
    for d in _folders():
        shutil.copytree(
            REPO / d, root / d, ignore=shutil.ignore_patterns("__pycache__")
        )
    before = _tree_files(root)
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, str(REPO / "build.py"), "--root", str(root), *a],
        capture_output=True,
        text=True,
        check=False,
    )
    r = run("apply")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run("export")
    assert r.returncode == 0, r.stdout + r.stderr
    after = _tree_files(root)
    changed = sorted(
        k for k in before.keys() | after.keys() if before.get(k) != after.get(k)
    )
    assert not changed, (
        f"apply+export changed {changed}: run `python build.py export` and commit"
    )
    # The tree reports the pinned version, untouched by our git metadata.
    r = run("status", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert filecmp.cmp(
        REPO / "patches" / "series", root / "patches" / "series", shallow=False
    )
