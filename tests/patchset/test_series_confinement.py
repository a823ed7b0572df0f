"""Every series entry is a file of its patch folder; a missing series is an error.

A series line that names a file elsewhere (``../../x.patch``, an absolute path,
a symlink out of the folder) is refused by ``check``, ``apply``, ``status`` and
``export`` with its line named, and no command reads, writes or deletes the
file it names. Without a series file every command stops with exit code 2.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import patch_text, replace_line

ENGINE_EDIT = (
    "diff --git a/vllm/engine.py b/vllm/engine.py\n"
    "--- a/vllm/engine.py\n"
    "+++ b/vllm/engine.py\n"
)


def outside_patch(project) -> tuple[str, bytes]:
    """A valid patch in the test's temp dir, beside (not in) the project."""
    text = patch_text("add a hook", project.edit_patch("vllm/hooks.py", "HOOK = 1\n"))
    path = project.base / "benign.patch"
    path.write_text(text)
    return str(path), path.read_bytes()


def committed_edit(project) -> None:
    """A tree built from an empty series, with one commit for export to write."""
    assert project.run("apply").code == 0
    engine = project.tree / "vllm/engine.py"
    engine.write_text(
        replace_line(engine.read_text(), "engine line 12\n", "engine line 12\nx()\n")
    )
    project.git("add", "-A")
    project.git("commit", "-q", "-m", "Call x\n\nWhy.\n\nUpstream-Status: Pending")


def names_outside(project, entry: str, line: int) -> list[str]:
    """The problems ``check`` reports for the series (rc 1), naming the line."""
    assert project.run("fetch").code == 0
    r = project.run("check", "--json")
    assert r.code == 1, r.text
    got = [p["message"] for p in json.loads(r.out)["problems"]]
    hits = [m for m in got if f"series line {line}: {entry}" in m]
    assert hits, got
    return hits


@pytest.mark.parametrize("entry", ["../../benign.patch", "absolute"])
def test_a_series_line_outside_the_folder_is_refused_and_its_file_kept(
    project, entry
) -> None:
    path, data = outside_patch(project)
    entry = path if entry == "absolute" else entry
    project.set_series(entry)
    (hit,) = names_outside(project, entry, 1)
    assert "is not a file name in patches/" in hit
    # apply refuses before building anything from it
    r = project.run("apply", "--force")
    assert r.code == 1 and f"series line 1: {entry}" in r.err, r.text
    assert not project.tree.exists()
    # status names it and reads nothing
    st = json.loads(project.run("status", "--json").out)
    assert any(f"series line 1: {entry}" in p for p in st["series_problems"])
    # export (even --force) writes and deletes nothing
    project.set_series()
    committed_edit(project)
    project.set_series(entry)
    before = sorted(os.listdir(project.root / "patches"))
    for args in (["export"], ["export", "--force"]):
        r = project.run(*args)
        assert r.code == 1, r.text
        assert f"series line 1: {entry}" in r.err and "Nothing was written" in r.err
        with open(path, "rb") as f:
            assert f.read() == data
        assert sorted(os.listdir(project.root / "patches")) == before


def test_a_symlink_out_of_the_folder_is_refused_and_its_target_kept(project) -> None:
    path, data = outside_patch(project)
    os.symlink(path, project.root / "patches" / "0001-link.patch")
    project.set_series("0001-link.patch")
    (hit,) = names_outside(project, "0001-link.patch", 1)
    assert "is a symlink out of patches/" in hit
    r = project.run("apply", "--force")
    assert r.code == 1 and "series line 1: 0001-link.patch" in r.err, r.text
    project.set_series()
    committed_edit(project)
    project.set_series("0001-link.patch")
    r = project.run("export", "--force")
    assert r.code == 1 and "0001-link.patch is a symlink out of" in r.err, r.text
    with open(path, "rb") as f:
        assert f.read() == data
    assert os.path.islink(project.root / "patches" / "0001-link.patch")


def test_a_symlink_inside_the_folder_is_a_patch_like_any_other(project) -> None:
    path, _ = outside_patch(project)
    real = project.root / "patches" / "0001-real.patch"
    real.write_bytes((project.base / "benign.patch").read_bytes())
    os.symlink("0001-real.patch", project.root / "patches" / "0002-alias.patch")
    project.set_series("0002-alias.patch")
    r = project.run("apply")
    assert r.code == 0, r.text


@pytest.mark.parametrize("command", ["apply", "check", "status", "export", "compat"])
def test_a_missing_series_is_an_error_everywhere(project, command) -> None:
    if command == "export":
        committed_edit(project)
    (project.root / "patches" / "series").unlink()
    assert project.run("fetch").code == 0
    r = project.run(command)
    assert r.code == 2, r.text
    assert "patches/series does not exist" in r.err, r.text
    assert not (project.root / "patches" / "series").exists()


def test_a_hint_carries_the_patch_folder_it_was_run_with(project) -> None:
    shutil.copytree(project.root / "patches", project.root / "rolls" / "x")
    r = project.run("--patches", "rolls/x", "export")
    assert r.code == 1, r.text
    assert "run `python build.py --patches rolls/x apply` first" in r.text, r.text
    r = project.run("export")  # the default folder: no --patches in the hint
    assert "run `python build.py apply` first" in r.text, r.text
    r = project.run("--patches", "rolls/x", "status")
    assert "is not there: run `python build.py --patches rolls/x apply`" in r.out
    r = project.run("--patches", "rolls/x", "rebase", "--continue")
    assert r.code == 2, r.text
    assert "`python build.py --patches rolls/x rebase --onto VERSION`" in r.text, r.text


@pytest.mark.parametrize(
    "command",
    ["fetch", "apply", "status", "export", "check", "reset", "compat", "rebase"],
)
def test_every_subcommand_help_page_says_what_it_does_downloads_and_returns(
    project, command
) -> None:
    r = project.run_cli(command, "-h")
    assert r.code == 0, r.text
    page = " ".join(r.out.split())
    assert "Download" in page or "download" in page, page
    assert "Exit codes: 0 ok, 1" in page and "2 could not run" in page, page
