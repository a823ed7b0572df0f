"""build.py rebase: a step that git merges cleanly can still leave broken Python.

A synthetic upstream (0.18.1 pinned, 0.19.0 behind a synthetic index) has one
Python module, ``vllm/worker.py``. Its 0.19.0 changes lines far from the
patches' hunks, so every 3-way merge is clean, yet:

- 0001 adds ``Worker.has_requests`` and 0.19.0 adds its own: the merged class
  defines it twice, and ours silently replaces upstream's;
- 0002 makes ``step`` use ``BLOCK``, which 0.19.0 renamed to ``BLOCK_SIZE``:
  the merged file uses a name nothing defines.

The rebase must stop after such a step, as it does at a conflict.
"""

from __future__ import annotations

import pytest
from conftest import UPSTREAM_FILES, Project, patch_text, replace_line
from test_rebase import _roll_git, publish

from patchset import releases

WORKER_PATH = "vllm/worker.py"
ROLL = "rolls/0.19.0"
ROLL_TREE = "third_party/vllm-0.19.0"

WORKER = '''"""A worker."""

BLOCK = 16


def scale(n):
    return n * BLOCK


class Worker:
    def __init__(self, n):
        self.n = n
        self.block_len = scale(n)
        self.ready = False

    def start(self):
        self.ready = True
        return self.n

    def step(self):
        return self.n + 1

    def pause(self):
        self.ready = False

    def resume(self):
        self.ready = True

    def stop(self):
        self.ready = False
        return None
'''

OUR_HAS_REQUESTS = "\n    def has_requests(self):\n        return self.ready\n"
UPSTREAM_HAS_REQUESTS = (
    "    def has_requests(self):\n        return self.n > 0\n\n    def step(self):\n"
)

DUPLICATE = "0001-worker-has-requests.patch"
BLOCK_LEN = "0002-worker-step-by-block.patch"


def with_our_has_requests(text: str) -> str:
    return text + OUR_HAS_REQUESTS


def with_step_by_block(text: str) -> str:
    return replace_line(
        text, "        return self.n + 1\n", "        return self.n + BLOCK\n"
    )


PATCHES = {
    DUPLICATE: ("Worker: say whether requests are pending", with_our_has_requests),
    BLOCK_LEN: ("Worker: step by the block length", with_step_by_block),
}


@pytest.fixture
def project(tmp_path, monkeypatch) -> Project:
    proj = Project(tmp_path, {**UPSTREAM_FILES, WORKER_PATH: WORKER})
    monkeypatch.setenv("VMP_CACHE_DIR", str(proj.cache))
    monkeypatch.setenv("VMP_SDIST_URL", str(proj.source))
    monkeypatch.setenv("VMP_INDEX_URL", str(proj.base / "index"))
    monkeypatch.delenv("VMP_ROOT", raising=False)
    releases.clear_index_cache()
    yield proj
    releases.clear_index_cache()


def series(project: Project, *names: str) -> None:
    """The given patches of ``PATCHES``, each on the file the earlier ones left."""
    text = WORKER
    for name in names:
        subject, edit = PATCHES[name]
        new = edit(text)
        project.add_patch(
            name, patch_text(subject, project.edit_patch(WORKER_PATH, new, old=text))
        )
        text = new
    assert project.run("apply").code == 0
    assert project.run("export").code == 0  # canonical files
    assert project.run("reset").code == 0


def v19(worker: str) -> dict[str, str]:
    files = {**UPSTREAM_FILES, WORKER_PATH: worker}
    files["PKG-INFO"] = files["PKG-INFO"].replace("0.18.1", "0.19.0")
    files["vllm/_version.py"] = '__version__ = version = "0.19.0"\n'
    return files


def upstream_has_requests(text: str) -> str:
    """0.19.0 adds its own has_requests, next to start (far from 0001's hunk)."""
    return replace_line(text, "    def step(self):\n", UPSTREAM_HAS_REQUESTS)


def upstream_block_size(text: str) -> str:
    """0.19.0 renames BLOCK (far from 0002's hunk)."""
    text = replace_line(text, "BLOCK = 16\n", "BLOCK_SIZE = 16\n")
    return replace_line(text, "    return n * BLOCK\n", "    return n * BLOCK_SIZE\n")


def roll_file() -> str:
    return f"{ROLL_TREE}/{WORKER_PATH}"


def test_rebase_stops_when_a_clean_merge_defines_a_method_twice(project) -> None:
    series(project, DUPLICATE)
    publish(project, v19(upstream_has_requests(WORKER)))
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 1, r.text
    merged = (project.root / roll_file()).read_text()
    assert (
        "<<<<<<<" not in merged and merged.count("def has_requests") == 2
    )  # clean merge
    assert f"patch {DUPLICATE}" in r.out and roll_file() in r.out
    assert "F811 Redefinition of unused `has_requests`" in r.out
    assert "rebase --continue" in r.out and "rebase --abort" in r.out
    assert not (project.root / ROLL / DUPLICATE).exists()  # nothing exported yet

    # Nothing changed: --continue checks the step again and stops again.
    r = project.run("rebase", "--continue")
    assert r.code == 1 and "`has_requests`" in r.out, r.text

    # Keep upstream's method: the patch is then empty and dropped, by the user.
    path = project.root / roll_file()
    path.write_text(merged.replace(OUR_HAS_REQUESTS, ""))
    _roll_git(project, "add", WORKER_PATH)
    r = project.run("rebase", "--continue")
    assert r.code == 0, r.text
    assert f"dropped by you: {DUPLICATE}" in r.out
    assert "already upstream" not in r.out
    assert (project.root / ROLL / "series").read_text().split() == []


def test_rebase_stops_when_the_patch_uses_a_name_upstream_renamed(
    project,
) -> None:
    series(project, BLOCK_LEN)
    publish(project, v19(upstream_block_size(WORKER)))
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 1, r.text
    merged = (project.root / roll_file()).read_text()
    assert "<<<<<<<" not in merged and "self.n + BLOCK\n" in merged  # clean merge
    assert f"patch {BLOCK_LEN}" in r.out and roll_file() in r.out
    assert "F821 Undefined name `BLOCK`" in r.out and "use what replaced" in r.out
    assert "rebase --continue" in r.out and "rebase --abort" in r.out

    # Port the patch to upstream's new name: the fix goes into the patch's commit.
    path = project.root / roll_file()
    path.write_text(merged.replace("self.n + BLOCK\n", "self.n + BLOCK_SIZE\n"))
    _roll_git(project, "add", WORKER_PATH)
    r = project.run("rebase", "--continue")
    assert r.code == 0, r.text
    assert "1 of 1 patches carried onto vllm 0.19.0" in r.out
    exported = (project.root / ROLL / BLOCK_LEN).read_text()
    assert "+        return self.n + BLOCK_SIZE" in exported
    assert project.run("--patches", ROLL, "check").code == 0


def test_rebase_checks_every_step_of_the_series(project) -> None:
    """Both patches, both broken: one stop per step, each fixed in turn."""
    series(project, DUPLICATE, BLOCK_LEN)
    publish(project, v19(upstream_block_size(upstream_has_requests(WORKER))))
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 1 and f"patch {DUPLICATE}" in r.out, r.text
    path = project.root / roll_file()
    path.write_text(path.read_text().replace(OUR_HAS_REQUESTS, ""))
    _roll_git(project, "add", WORKER_PATH)
    r = project.run("rebase", "--continue")
    assert r.code == 1, r.text
    assert f"patch {BLOCK_LEN}" in r.out and "`BLOCK`" in r.out
    path.write_text(
        path.read_text().replace("self.n + BLOCK\n", "self.n + BLOCK_SIZE\n")
    )
    _roll_git(project, "add", WORKER_PATH)
    r = project.run("rebase", "--continue")
    assert r.code == 0, r.text
    assert (project.root / ROLL / "series").read_text().split() == [BLOCK_LEN]


def test_rebase_does_not_stop_when_the_merged_code_is_consistent(project) -> None:
    """Upstream moved on around the patches without breaking what they use."""
    series(project, DUPLICATE, BLOCK_LEN)
    worker = (
        replace_line(  # a property with a setter: one name, two defs, upstream's own
            WORKER,
            "    def stop(self):\n",
            "    @property\n    def size(self):\n        return self.n\n\n"
            "    @size.setter\n    def size(self, n):\n        self.n = n\n\n"
            "    def stop(self):\n",
        )
    )
    worker = replace_line(worker, "BLOCK = 16\n", "BLOCK = 32\n")
    publish(project, v19(worker))
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 0, r.text
    assert "2 of 2 patches carried onto vllm 0.19.0" in r.out
    assert (project.root / ROLL / "series").read_text().split() == [
        DUPLICATE,
        BLOCK_LEN,
    ]


def test_continue_accept_goes_on_past_a_flagged_step(project) -> None:
    """The check can be wrong (the name is inherited now): --accept keeps the step as is."""
    series(project, BLOCK_LEN)
    publish(project, v19(upstream_block_size(WORKER)))
    assert project.run("rebase", "--onto", "0.19.0").code == 1
    r = project.run("rebase", "--abort", "--accept")  # only with --continue
    assert r.code != 0 and "--accept" in r.err, r.text
    r = project.run("rebase", "--continue", "--accept")
    assert r.code == 0, r.text
    assert "self.n + BLOCK\n" in (project.root / ROLL / BLOCK_LEN).read_text()


def test_abort_at_a_flagged_step_removes_the_roll(project) -> None:
    series(project, DUPLICATE)
    publish(project, v19(upstream_has_requests(WORKER)))
    pinned = project.snapshot("patches")
    assert project.run("rebase", "--onto", "0.19.0").code == 1
    r = project.run("rebase", "--abort")
    assert r.code == 0, r.text
    for path in (ROLL, ROLL_TREE, f"{ROLL_TREE}.git"):
        assert not (project.root / path).exists(), path
    assert project.snapshot("patches") == pinned


def test_rebase_ends_with_the_override_check_against_the_release_it_came_from(
    project,
) -> None:
    """Ours overrides Worker.pause without super(); 0.19.0 renamed it. Every patch
    merges, but our override would never be called there: the rebase writes the
    roll and ends with exit 1 naming it (before, "1 of 1 carried", exit 0)."""
    (project.root / "connector" / "ext.py").write_text(
        "from typing_extensions import override\n\nfrom vllm.worker import Worker\n\n\n"
        "class Ext(Worker):\n    @override\n    def pause(self):\n        self.ready = None\n"
    )
    series(project, BLOCK_LEN)
    publish(project, v19(WORKER.replace("def pause(self):", "def halt(self):")))
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 1, r.text
    assert "1 of 1 patches carried onto vllm 0.19.0" in r.out, r.text
    assert "override-missing" in r.out and "Ext.pause" in r.out, r.text
    assert (project.root / ROLL / "series").read_text().split() == [BLOCK_LEN]
