"""Confinement: a patch writes regular text files inside the tree, nothing else.

Each case is refused by ``check`` (a ``confinement`` problem naming the patch,
its line and the path) and by ``apply --force``, which writes nothing, in the
tree or outside it: paths that leave the tree (as written, or through a
symlink on disk), symlinks and binary patches, wherever they point.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import manifest_text, patch_text

from patchset import confine
from patchset.exactapply import PatchLeavesTree, apply_patch
from patchset.project import Project
from patchset.series import parse_patch
from patchset.tree import Tree

EVIL = (
    "diff --git a/../../evil.txt b/../../evil.txt\n"
    "new file mode 100644\n"
    "--- /dev/null\n"
    "+++ b/../../evil.txt\n"
    "@@ -0,0 +1 @@\n"
    "+pwned\n"
)
NEW_FILE = "new file mode 100644\n--- /dev/null\n+++ b/{0}\n@@ -0,0 +1 @@\n+pwned\n"


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line of ``text`` containing ``needle``."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def outside_files(project) -> set[str]:
    """Every file of the test's temp dir outside the tree, its git dir and the cache."""
    keep = (project.tree, project.git_dir, project.cache)
    return {
        p.relative_to(project.base).as_posix()
        for p in project.base.rglob("*")
        if not any(p == k or k in p.parents for k in keep)
    }


def add(project, name: str, diff: str) -> tuple[str, str]:
    text = patch_text(name.split("-", 1)[1].removesuffix(".patch"), diff)
    project.add_patch(name, text)
    return name, text


def checked(project) -> list[dict]:
    """The confinement problems of ``check --json`` (with patch, line, path)."""
    assert project.run("fetch").code == 0
    r = project.run("check", "--json")
    assert r.code == 1, r.text
    problems = json.loads(r.out)["problems"]
    return [p["detail"] for p in problems if p["kind"] == "confinement"]


def found(problems: list[dict], patch: str, line: int, path: str, kind: str) -> dict:
    hits = [
        p
        for p in problems
        if (p["patch"], p["line"], p["path"], p["kind"]) == (patch, line, path, kind)
    ]
    assert hits, problems
    return hits[0]


def apply_refused(project, *needles: str) -> str:
    """``apply --force`` fails, names every needle, and writes nothing outside."""
    before = outside_files(project)
    r = project.run("apply", "--force")
    assert r.code == 1, r.text
    for needle in needles:
        assert needle in r.err, (needle, r.text)
    assert outside_files(project) == before
    return r.err


def test_dotdot_new_path_refused_everywhere_nothing_written(project) -> None:
    name, text = add(project, "0001-evil.patch", EVIL)
    line = line_of(text, "diff --git")
    problem = found(checked(project), name, line, "../../evil.txt", "parent")
    assert (
        f"patch {name} line {line}: path ../../evil.txt leaves the tree "
        "third_party/vllm through '..'" in problem["message"]
    )
    assert "fix the diff's a/ b/ paths" in problem["message"]
    err = apply_refused(project, name, f"line {line}", "../../evil.txt")
    assert "Nothing was written" in err
    assert not (project.root / "evil.txt").exists()
    assert not (project.base / "evil.txt").exists()
    assert not project.tree.exists()  # refused before the tree was even built
    status = json.loads(project.run("status", "--json").out)
    assert status["in_sync"] is False
    (entry,) = status["confinement"]
    assert (entry["patch"], entry["line"], entry["path"]) == (
        name,
        line,
        "../../evil.txt",
    )
    assert "paths leaving the tree" in project.run("status").out


def test_dotdot_old_path_refused(project) -> None:
    secret = project.root / "secret.txt"
    secret.write_text("secret\n")
    diff = (
        "--- a/../../secret.txt\n+++ b/vllm/secret.txt\n@@ -1 +1 @@\n-secret\n+leak\n"
    )
    name, text = add(project, "0001-read-outside.patch", diff)
    found(checked(project), name, line_of(text, "--- a/"), "../../secret.txt", "parent")
    apply_refused(project, name, "../../secret.txt")
    assert secret.read_text() == "secret\n"


def test_absolute_path_refused(project) -> None:
    target = project.base / "abs-evil.txt"
    diff = f"--- /dev/null\n+++ {target}\n@@ -0,0 +1 @@\n+pwned\n"
    name, text = add(project, "0001-absolute.patch", diff)
    found(checked(project), name, line_of(text, "+++ /"), str(target), "absolute")
    apply_refused(project, name, str(target))
    assert not target.exists()


def test_rename_to_outside_refused(project) -> None:
    diff = (
        "diff --git a/vllm/config.py b/vllm/config2.py\n"
        "similarity index 100%\n"
        "rename from vllm/config.py\n"
        "rename to ../../evil.py\n"
    )
    name, text = add(project, "0001-rename.patch", diff)
    found(checked(project), name, line_of(text, "rename to"), "../../evil.py", "parent")
    apply_refused(project, name, "../../evil.py")


def test_copy_to_outside_refused(project) -> None:
    diff = (
        "diff --git a/vllm/config.py b/vllm/config2.py\n"
        "similarity index 100%\n"
        "copy from vllm/config.py\n"
        "copy to ../../../copied.py\n"
    )
    name, text = add(project, "0001-copy.patch", diff)
    found(
        checked(project), name, line_of(text, "copy to"), "../../../copied.py", "parent"
    )
    apply_refused(project, name, "../../../copied.py")


def test_binary_patches_refused_outright_even_inside_the_tree(project) -> None:
    git_binary = (
        "diff --git a/vllm/logo.bin b/vllm/logo.bin\n"
        "new file mode 100644\n"
        "index 0000000000000000000000000000000000000000..88768efdf77ec78c9a995f94881793be6a41752b\n"
        "GIT binary patch\n"
        "literal 5\n"
        "McmZQzO3KUw00MIXJOBUy\n"
        "\n"
        "literal 0\n"
        "HcmV?d00001\n"
        "\n"
    )
    one, one_text = add(project, "0001-git-binary.patch", git_binary)
    # the short form names the file only on the "Binary files" line
    short = (
        "diff --git a/vllm/x.bin b/vllm/x.bin\n"
        "new file mode 100644\n"
        "index 0000000..88768ef\n"
        "Binary files /dev/null and b/../../evil2.bin differ\n"
    )
    two, two_text = add(project, "0002-short-binary.patch", short)
    problems = checked(project)
    problem = found(
        problems, one, line_of(one_text, "GIT binary"), "vllm/logo.bin", "binary"
    )
    assert "is a binary patch" in problem["message"]
    assert "overlay" in problem["message"]
    line = line_of(two_text, "Binary files")
    found(problems, two, line, "../../evil2.bin", "binary")
    found(problems, two, line, "../../evil2.bin", "parent")
    apply_refused(project, one, "vllm/logo.bin", "is a binary patch")
    assert not (project.tree / "vllm" / "logo.bin").exists()


LINK = (
    "diff --git a/vllm/link b/vllm/link\n"
    "new file mode 120000\n"
    "index 0000000..3594e94\n"
    "--- /dev/null\n"
    "+++ b/vllm/link\n"
    "@@ -0,0 +1 @@\n"
    "+{0}\n"
    "\\ No newline at end of file\n"
)


@pytest.mark.parametrize("target", ["config.py", "../../.."])
def test_a_new_symlink_is_refused_wherever_it_points(project, target) -> None:
    name, text = add(project, "0001-link.patch", LINK.format(target))
    line = line_of(text, "new file mode 120000")
    problem = found(checked(project), name, line, "vllm/link", "symlink")
    assert (
        f"patch {name} line {line}: path vllm/link is a symlink (git mode 120000)"
        in problem["message"]
    )
    apply_refused(project, name, "vllm/link", "is a symlink")
    assert not (project.tree / "vllm" / "link").exists()
    assert not (project.tree / "vllm" / "link").is_symlink()


def test_path_through_symlink_on_disk_refused(project) -> None:
    assert project.run("apply").code == 0
    outside = project.base / "outside"
    outside.mkdir()
    os.symlink(outside, project.tree / "vllm" / "out")
    path = "vllm/out/evil.txt"
    name, text = add(
        project,
        "0001-through-disk.patch",
        f"diff --git a/{path} b/{path}\n" + NEW_FILE.format(path),
    )
    line = line_of(text, "diff --git")
    apply_refused(project, name, f"line {line}", path)
    assert not (outside / "evil.txt").exists()
    status = json.loads(project.run("status", "--json").out)
    assert [(c["patch"], c["line"], c["path"]) for c in status["confinement"]] == [
        (name, line, path)
    ]
    # the last line of defence, right before writing, sees the same symlink
    patch = parse_patch(name, text.encode())
    (v,) = confine.disk_violations(project.tree, patch, [path])
    assert (v.line, v.path, v.kind) == (line, path, "through-symlink")
    # and Tree._apply_one (past the series-level refusal) writes nothing either
    with pytest.raises(PatchLeavesTree, match="vllm/out/evil.txt"):
        Tree(Project(project.root))._apply_one(patch)
    assert not (outside / "evil.txt").exists()


def test_git_dir_component_refused(project) -> None:
    path = ".git/hooks/post-checkout"
    diff = f"diff --git a/{path} b/{path}\n" + NEW_FILE.format(path).replace(
        "100644", "100755"
    )
    name, text = add(project, "0001-hook.patch", diff)
    found(checked(project), name, line_of(text, "diff --git"), path, "git-dir")
    apply_refused(project, name, path)
    assert not (project.tree / ".git").exists()


def test_header_lines_apart_are_still_read_as_unidiff_reads_them(project) -> None:
    """A line between --- and +++: unidiff still takes the +++ name, so the check does too."""
    path = ".git/hooks/post-commit"
    diff = f"--- /dev/null\njunk\n+++ b/{path}\n@@ -0,0 +1 @@\n+evil\n"
    name, text = add(project, "0001-apart.patch", diff)
    found(checked(project), name, line_of(text, "+++ b/"), path, "git-dir")
    apply_refused(project, name, path)


def test_unparseable_patch_still_scanned(project) -> None:
    # the hunk claims 3 lines and has 1: unidiff rejects it, the path is still seen
    diff = "--- /dev/null\n+++ b/../../evil.txt\n@@ -0,0 +1,3 @@\n+pwned\n"
    name, text = add(project, "0001-broken.patch", diff)
    assert project.run("fetch").code == 0
    problems = json.loads(project.run("check", "--json").out)["problems"]
    assert {"parse", "confinement"} <= {
        p["kind"] for p in problems if p["patch"] == name
    }
    conf = [p["detail"] for p in problems if p["kind"] == "confinement"]
    found(conf, name, line_of(text, "+++ b/"), "../../evil.txt", "parent")


def test_export_refuses_commit_adding_a_symlink(project) -> None:
    assert project.run("apply").code == 0
    os.symlink("config.py", project.tree / "vllm" / "alias.py")
    project.git("add", "vllm/alias.py")
    project.git("commit", "-q", "-m", "Add a link\n\nWhy.\n\nUpstream-Status: Pending")
    before = project.snapshot("patches")
    r = project.run("export")
    assert r.code == 1, r.text
    assert "refusing to export" in r.err
    assert "0001-add-a-link.patch line" in r.err and "path vllm/alias.py" in r.err
    assert "is a symlink (git mode 120000)" in r.err and "rebase -i" in r.err
    assert project.snapshot("patches") == before


def test_overlay_dst_through_symlink_refused(project) -> None:
    assert project.run("apply").code == 0
    outside = project.base / "outside"
    outside.mkdir()
    os.symlink(outside, project.tree / "vllm" / "outlink")
    (project.root / "extra").mkdir()
    (project.root / "extra" / "mod.py").write_text("X = 1\n")
    overlays = [("connector", "vllm/ext"), ("extra", "vllm/outlink/ext")]
    (project.root / "patches/upstream.toml").write_text(
        manifest_text(project.sha, overlays)
    )
    apply_refused(project, "overlay extra/ -> vllm/outlink/ext/", "vllm/outlink/ext")
    assert not (outside / "ext").exists()
    status = json.loads(project.run("status", "--json").out)
    assert [c["path"] for c in status["confinement"]] == ["vllm/outlink/ext"]


def test_overlay_git_dst_and_outside_source_symlink_refused(project) -> None:
    secret = project.base / "secret.txt"
    secret.write_text("secret\n")
    os.symlink(secret, project.root / "connector" / "leak.py")
    overlays = [("connector", "vllm/ext"), ("hashsync", "vllm/.git/hooks")]
    (project.root / "patches/upstream.toml").write_text(
        manifest_text(project.sha, overlays)
    )
    problems = checked(project)
    assert {(p["path"], p["kind"]) for p in problems} == {
        ("connector/leak.py", "source-symlink"),
        ("vllm/.git/hooks", "git-dir"),
    }
    apply_refused(project, "connector/leak.py", "vllm/.git/hooks")
    assert not Path(project.tree / "vllm/.git").exists()


def _kinds(*diffs: str) -> list[tuple[str, str, str]]:
    patches = [
        parse_patch(f"{i}.patch", patch_text("x", d).encode())
        for i, d in enumerate(diffs, 1)
    ]
    return [(v.patch, v.path, v.kind) for p in patches for v in confine.violations(p)]


def test_policy_units() -> None:
    # every diff that touches a symlink is refused: new, changed, deleted, retyped
    changed = (
        "diff --git a/vllm/up b/vllm/up\nindex 1111111..2222222 120000\n"
        "--- a/vllm/up\n+++ b/vllm/up\n@@ -1 +1 @@\n-..\n+.\n"
    )
    deleted = (
        "diff --git a/vllm/up b/vllm/up\ndeleted file mode 120000\n"
        "--- a/vllm/up\n+++ /dev/null\n@@ -1 +0,0 @@\n-..\n"
    )
    retyped = "diff --git a/vllm/up b/vllm/up\nold mode 120000\nnew mode 100644\n"
    for diff in (changed, deleted, retyped):
        assert _kinds(diff) == [("1.patch", "vllm/up", "symlink")], diff
    # a regular file's modes are fine
    assert (
        _kinds("diff --git a/vllm/x b/vllm/x\nold mode 100644\nnew mode 100755\n") == []
    )
    # a binary diff in a form only unidiff reads is refused too
    loose = "diff --git a/vllm/x.bin b/vllm/x.bin\nBinary file vllm/x.bin has changed\n"
    assert _kinds(loose) == [("1.patch", "vllm/x.bin", "binary")]
    # and apply refuses before reading anything
    link = parse_patch("1.patch", patch_text("x", LINK.format("config.py")).encode())
    with pytest.raises(PatchLeavesTree, match="vllm/link is a symlink"):
        apply_patch(link, {}.get)
    # git C-quoted names are decoded
    quoted = '--- /dev/null\n+++ "b/../\\303\\251vil.txt"\n@@ -0,0 +1 @@\n+x\n'
    assert _kinds(quoted) == [("1.patch", "../\u00e9vil.txt", "parent")]
    # a hunk line that looks like a header is content, not a path or a mode
    content = (
        "diff --git a/vllm/config.py b/vllm/config.py\n--- a/vllm/config.py\n"
        "+++ b/vllm/config.py\n@@ -1,2 +1,2 @@\n--- a/../../x\n+++ b/../../x\n"
        "-new mode 120000\n+GIT binary patch\n"
    )
    assert _kinds(content) == []


def test_overlay_file_below_dst_through_symlink(tmp_path) -> None:
    from patchset.upstream import Overlay

    (tmp_path / "extra" / "sub").mkdir(parents=True)
    (tmp_path / "extra" / "sub" / "mod.py").write_text("X = 1\n")
    tree = tmp_path / "tree"
    (tree / "vllm" / "ext").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tree / "vllm" / "ext" / "sub")
    (v,) = confine.overlay_violations(tmp_path, [Overlay("extra", "vllm/ext")], tree)
    assert (v.path, v.kind) == ("vllm/ext/sub/mod.py", "through-symlink")
