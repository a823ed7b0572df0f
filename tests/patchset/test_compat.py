"""The exported series works with git am and quilt; vLLM's version stays pinned;
and the real 0.18.1 sdist check (when the sdist is cached)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import pytest
from conftest import BUILD_PY, OVERLAY_DST, REPO, TOP, VERSION
from test_export import make_edits

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "T",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "T",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


def sh(*args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        args,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **GIT_ENV, **(env or {})},
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def pristine_copy(project, dest):
    with tarfile.open(project.source) as tar:
        tar.extractall(dest, filter="data")
    return dest / TOP


def exported_series(project) -> list[str]:
    assert project.run("apply").code == 0
    make_edits(project)
    assert project.run("export").code == 0
    return (project.root / "patches/series").read_text().split()


def assert_same_as_tree(project, other, names: list[str]) -> None:
    tracked = project.git("ls-files").splitlines()
    for rel in tracked:
        if rel.startswith(OVERLAY_DST) or "/mooncake/" in rel:
            continue
        assert (other / rel).read_bytes() == (project.tree / rel).read_bytes(), rel


def test_git_am_applies_exported_series(project, tmp_path) -> None:
    names = exported_series(project)
    work = pristine_copy(project, tmp_path / "am")
    sh("git", "init", "-q", cwd=work)
    sh("git", "add", "-A", cwd=work)
    sh("git", "commit", "-qm", "pristine", cwd=work)
    sh("git", "am", "-q", *[str(project.root / "patches" / n) for n in names], cwd=work)
    log = sh("git", "log", "--format=%s|%an", "-2", cwd=work).stdout.split("\n")
    assert log[0] == "Make config line 3 configurable|Jöhn Dev"
    assert_same_as_tree(project, work, names)


@pytest.mark.skipif(
    shutil.which("quilt") is None,
    reason="quilt is not installed (apt-get install quilt)",
)
def test_quilt_push_applies_exported_series(project, tmp_path) -> None:
    names = exported_series(project)
    work = pristine_copy(project, tmp_path / "quilt")
    env = {
        "QUILT_PATCHES": str(project.root / "patches"),
        "QUILTRC": os.devnull,
        "HOME": str(tmp_path),
    }
    sh("quilt", "push", "-a", "--fuzz=0", cwd=work, env=env)
    assert_same_as_tree(project, work, names)


def test_vllm_version_stays_pinned_inside_a_git_checkout(project) -> None:
    """No .git in the tree, so setuptools-scm reads PKG-INFO, even though the
    project around it is a git repo with commits."""
    scm = subprocess.run(
        [sys.executable, "-c", "import setuptools_scm"],
        capture_output=True,
        check=False,
    )
    if scm.returncode != 0:
        pytest.skip("setuptools_scm is not installed in this interpreter")
    (project.root / ".gitignore").write_text("/third_party/\n")
    sh("git", "init", "-q", cwd=project.root)
    sh("git", "add", "-A", cwd=project.root)
    sh("git", "commit", "-qm", "project", cwd=project.root)
    assert project.run("apply").code == 0
    assert not (project.tree / ".git").exists()
    proc = sh(
        sys.executable,
        "-c",
        "import setuptools_scm; print(setuptools_scm.get_version(root='.'))",
        cwd=project.tree,
    )
    assert proc.stdout.strip() == VERSION


def test_real_sdist_check() -> None:
    """`check` on the real vLLM 0.18.1 sdist and this repo's series (CI's check)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("VMP_SDIST_URL", "VMP_ROOT")
    }
    sys.path.insert(0, str(REPO))
    from patchset.project import Project
    from patchset.upstream import cache_dir

    manifest = Project(REPO).manifest
    cached = cache_dir() / manifest.sdist
    if not cached.is_file():
        pytest.skip(
            f"real vLLM {manifest.version} sdist not cached at {cached}; run python build.py fetch"
        )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(BUILD_PY), "check", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    elapsed = time.monotonic() - start
    data = json.loads(proc.stdout)
    assert proc.returncode == 0, json.dumps(data["problems"], indent=2) + proc.stderr
    assert elapsed < 40, f"check took {elapsed:.1f}s"
