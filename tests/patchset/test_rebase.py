"""build.py rebase --onto: 3-way roll of the series onto another release.

A synthetic 0.19.0 behind a synthetic index (VMP_INDEX_URL): one patch conflicts,
one is already upstream (dropped), one applies at an offset, one applies as is.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import UPSTREAM_FILES, patch_text, replace_line
from test_compat_grid import make_sdist

from patchset import releases

ENGINE = UPSTREAM_FILES["vllm/engine.py"]
CONFIG = UPSTREAM_FILES["vllm/config.py"]
NAMES = [
    "0001-engine-head.patch",
    "0002-config-ten.patch",
    "0003-engine-tail.patch",
    "0004-config-fix.patch",
]
ROLL = "rolls/0.19.0"
ROLL_TREE = "third_party/vllm-0.19.0"


def series(project) -> None:
    engine = replace_line(ENGINE, "engine line 2\n", "engine line 2 ours\n")
    tail = replace_line(engine, "engine line 28\n", "engine line 28 ours\n")
    config = replace_line(CONFIG, "config line 10\n", "config line 10 ours\n")
    fixed = replace_line(config, "config line 30\n", "config line 30 fixed\n")
    diffs = [
        ("Engine head", project.edit_patch("vllm/engine.py", engine)),
        ("Config ten", project.edit_patch("vllm/config.py", config)),
        ("Engine tail", project.edit_patch("vllm/engine.py", tail, old=engine)),
        ("Config fix", project.edit_patch("vllm/config.py", fixed, old=config)),
    ]
    for name, (subject, diff) in zip(NAMES, diffs):
        project.add_patch(name, patch_text(subject, diff))
    assert project.run("apply").code == 0
    assert project.run("export").code == 0  # canonical files
    assert project.run("reset").code == 0


def publish(project, files: dict[str, str], version: str = "0.19.0") -> str:
    index = project.base / "index"
    sdist = index / "files" / f"vllm-{version}.tar.gz"
    sha = make_sdist(sdist, version, files)
    (index / "vllm").mkdir(parents=True, exist_ok=True)
    listing = index / "vllm" / "json"
    known = json.loads(listing.read_text())["releases"] if listing.exists() else {}
    entry = {
        "filename": sdist.name,
        "packagetype": "sdist",
        "url": f"../files/{sdist.name}",
        "digests": {"sha256": sha},
        "yanked": False,
    }
    listing.write_text(json.dumps({"releases": {**known, version: [entry]}}))
    return sha


@pytest.fixture
def rolled(project, monkeypatch):
    monkeypatch.setenv("VMP_INDEX_URL", str(project.base / "index"))
    releases.clear_index_cache()
    series(project)
    return project


def v19_files(conflict: bool) -> dict[str, str]:
    files = dict(UPSTREAM_FILES)
    files["PKG-INFO"] = files["PKG-INFO"].replace("0.18.1", "0.19.0")
    files["vllm/_version.py"] = '__version__ = version = "0.19.0"\n'
    if conflict:  # upstream rewrote the line 0001 changes
        files["vllm/engine.py"] = replace_line(
            ENGINE, "engine line 2\n", "engine line 2 upstream\n"
        )
    config = "".join(f"new line {i}\n" for i in range(5)) + CONFIG  # 0002: offset
    files["vllm/config.py"] = replace_line(
        config, "config line 30\n", "config line 30 fixed\n"
    )
    return files


def test_rebase_stops_at_conflict_then_continue_exports_the_roll(rolled) -> None:
    project = rolled
    sha = publish(project, v19_files(conflict=True))
    pinned = project.snapshot("patches")
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 1, r.text
    assert (
        "patch 0001-engine-head.patch" in r.out
        and f"{ROLL_TREE}/vllm/engine.py" in r.out
    )
    assert "rebase --continue" in r.out and "rebase --abort" in r.out
    engine = project.root / ROLL_TREE / "vllm/engine.py"
    assert "<<<<<<<" in engine.read_text()
    manifest = (project.root / ROLL / "upstream.toml").read_text()
    assert 'version = "0.19.0"' in manifest and f'sha256 = "{sha}"' in manifest
    assert f'tree = "{ROLL_TREE}"' in manifest

    # status of the roll while it is under way: the rebase, not "0 of 0 applied"
    r = project.run("--patches", ROLL, "status")
    assert r.code == 1, r.text
    assert "0 of 0" not in r.out and "rebase:   under way" in r.out, r.out
    assert "4 patches) is being carried onto 0.19.0" in r.out, r.out
    assert "`python build.py rebase --continue --onto 0.19.0`" in r.out, r.out

    r = project.run("rebase", "--continue")  # not resolved yet
    assert r.code != 0 and "vllm/engine.py" in r.err and "add" in r.err

    resolve(engine, "engine line 2 upstream ours\n")
    _roll_git(project, "add", "vllm/engine.py")
    r = project.run("rebase", "--continue")
    assert r.code == 0, r.text
    assert "3 of 4 patches carried onto vllm 0.19.0" in r.out
    assert "dropped as already upstream: 0004-config-fix.patch" in r.out
    names = (project.root / ROLL / "series").read_text().split()
    assert names == NAMES[:3]
    first = (project.root / ROLL / NAMES[0]).read_text()
    assert "+engine line 2 upstream ours" in first and "Patch-Filename" not in first
    # re-numbered
    assert "@@ -12,7 +12,7 @@" in (project.root / ROLL / NAMES[1]).read_text()
    # the roll is a normal series: checks zero-fuzz against its sdist, tree in sync
    r = project.run("--patches", ROLL, "check")
    assert r.code == 0, r.text
    r = project.run("--patches", ROLL, "status", "--json")
    assert r.code == 0 and json.loads(r.out)["in_sync"] is True, r.out
    # the pinned series is untouched and still usable
    assert project.snapshot("patches") == pinned
    assert project.run("check").code == 0
    assert project.run("apply").code == 0
    # no rebase left to continue
    r = project.run("rebase", "--continue")
    assert r.code != 0 and "no rebase" in r.err


def test_rebase_abort_removes_the_roll_and_nothing_else(rolled) -> None:
    project = rolled
    publish(project, v19_files(conflict=True))
    pinned = project.snapshot("patches")
    assert project.run("rebase", "--onto", "0.19.0").code == 1
    r = project.run("rebase", "--onto", "0.19.0")  # a second start is refused
    assert r.code != 0 and "--continue" in r.err
    r = project.run("rebase", "--abort")
    assert r.code == 0, r.text
    for path in (ROLL, ROLL_TREE, f"{ROLL_TREE}.git"):
        assert not (project.root / path).exists(), path
    assert project.snapshot("patches") == pinned
    assert project.run("rebase", "--abort").code != 0


def test_rebase_without_conflicts_finishes_in_one_go(rolled) -> None:
    project = rolled
    publish(project, v19_files(conflict=False))
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 0, r.text
    assert (project.root / ROLL / "series").read_text().split() == NAMES[:3]
    # the overlay stays an overlay
    assert not list((project.root / ROLL).glob("*overlay*"))
    overlay = (
        project.root
        / ROLL_TREE
        / "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/ext/store.py"
    )
    assert overlay.is_file()
    assert project.run("--patches", ROLL, "check").code == 0


def test_rebase_resolution_that_empties_a_patch_drops_it(rolled) -> None:
    project = rolled
    publish(project, v19_files(conflict=True))
    assert project.run("rebase", "--onto", "0.19.0").code == 1
    engine = project.root / ROLL_TREE / "vllm/engine.py"
    resolve(engine, "engine line 2 upstream\n")
    _roll_git(project, "add", "vllm/engine.py")
    r = project.run("rebase", "--continue")
    assert r.code == 0, r.text
    assert "0001-engine-head.patch" in r.out and "empty after the resolution" in r.out
    assert (project.root / ROLL / "series").read_text().split() == NAMES[1:3]


def resolve(path, lines: str) -> None:
    """Replace the one conflict in ``path`` (markers and both sides) by ``lines``."""
    text = path.read_text()
    path.write_text(
        text.split("<<<<<<<")[0] + lines + text.split(">>>>>>>")[1].split("\n", 1)[1]
    )


def _roll_git(project, *args: str, tree_rel: str = ROLL_TREE) -> str:
    """git in the roll's tree, as a user resolving a conflict runs it."""
    tree = project.root / tree_rel
    proc = subprocess.run(
        ["git", f"--git-dir={tree}.git", f"--work-tree={tree}", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=tree,
        env={**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_continue_finishes_a_roll_whose_git_rebase_already_ended(rolled) -> None:
    """git finished (the user ran `git rebase --continue` by hand, or build.py was
    interrupted before its export): --continue exports instead of failing."""
    project = rolled
    publish(project, v19_files(conflict=True))
    assert project.run("rebase", "--onto", "0.19.0").code == 1
    engine = project.root / ROLL_TREE / "vllm/engine.py"
    resolve(engine, "engine line 2 upstream ours\n")
    _roll_git(project, "add", "vllm/engine.py")
    _roll_git(
        project,
        "-c",
        "core.editor=true",
        "-c",
        "user.name=u",
        "-c",
        "user.email=u@x",
        "rebase",
        "--continue",
    )
    r = project.run("rebase", "--continue")
    assert r.code == 0, r.text
    assert (project.root / ROLL / "series").read_text().split() == NAMES[:3]


def test_a_roll_of_a_roll_names_its_source_series_and_its_own_tree(rolled) -> None:
    """Rolling rolls/0.19.0 onto 0.20.0: the tree is named after 0.20.0 alone, the
    manifest says once which series it came from, and --continue (run without
    --patches, as the stop message says) names the source series, not patches/."""
    project = rolled
    publish(project, v19_files(conflict=False))
    assert project.run("rebase", "--onto", "0.19.0").code == 0
    files = v19_files(conflict=True)
    files["PKG-INFO"] = files["PKG-INFO"].replace("0.19.0", "0.20.0")
    files["vllm/_version.py"] = '__version__ = version = "0.20.0"\n'
    publish(project, files, "0.20.0")
    releases.clear_index_cache()
    r = project.run("--patches", ROLL, "rebase", "--onto", "0.20.0")
    assert r.code == 1, r.text
    tree_rel = "third_party/vllm-0.20.0"
    assert f"{tree_rel}/vllm/engine.py" in r.out
    manifest = (project.root / "rolls/0.20.0/upstream.toml").read_text()
    assert manifest.count("# Rolled by") == 1, manifest
    assert f"from the 0.19.0 series ({ROLL}/)" in manifest
    assert f'tree = "{tree_rel}"' in manifest
    engine = project.root / tree_rel / "vllm/engine.py"
    resolve(engine, "engine line 2 upstream ours\n")
    _roll_git(project, "add", "vllm/engine.py", tree_rel=tree_rel)
    r = project.run("rebase", "--continue")
    assert r.code == 0, r.text
    assert f"The 0.19.0 series in {ROLL}/ is unchanged" in r.out, r.out
    assert project.run("--patches", "rolls/0.20.0", "check").code == 0
