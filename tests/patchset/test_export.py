"""build.py export: deterministic patches from the tree's commits; round trip."""

from __future__ import annotations

import shutil

from conftest import OVERLAY_DST, UPSTREAM_FILES, patch_text, replace_line

FOLDERS = ("patches", "connector", "hashsync")

MESSAGE_1 = (
    "[PATCH] Add a KV transfer hook to the engine\n\n"
    "The mooncake connector needs to run after each engine step; this is the\n"
    "one-line hook, the logic lives in the overlay.\n\n"
    "# a line starting with a hash is kept\n\n"
    "Upstream-Status: Inappropriate [mooncake-specific wiring]\n"
)
MESSAGE_2 = (
    "[PATCH] Make config line 3 configurable\n\n"
    "Why: hashsync reads it. Non-ASCII stays intact: façade.\n\n"
    "Upstream-Status: Submitted [https://github.com/vllm-project/vllm/pull/1]\n"
)


def commit_in_tree(
    project, message: str, author: str = "Jöhn Dev <john@example.com>"
) -> None:
    msg = project.base / "msg.txt"
    msg.write_text(message, encoding="utf-8")
    project.git("add", "-A")
    project.git(
        "commit", "-q", "--cleanup=verbatim", f"--author={author}", "-F", str(msg)
    )


def make_edits(project) -> None:
    tree = project.tree
    engine = tree / "vllm/engine.py"
    engine.write_text(
        replace_line(
            engine.read_text(), "engine line 12\n", "engine line 12\nkv_hook()\n"
        )
    )
    (tree / "vllm/hooks.py").write_text("def kv_hook():\n    pass\n")
    commit_in_tree(project, MESSAGE_1)
    config = tree / "vllm/config.py"
    config.write_text(
        replace_line(config.read_text(), "config line 3\n", "config line 3 = env()\n")
    )
    (tree / "vllm/no_newline.py").write_text("first\nlast, still without newline")
    commit_in_tree(project, MESSAGE_2)


def test_export_writes_deterministic_patches_and_round_trips(project) -> None:
    assert project.run("apply").code == 0
    make_edits(project)
    # overlay edits in the tree are copied back, no commit needed
    (project.tree / OVERLAY_DST / "store.py").write_text(
        "class Store:\n    edited = True\n"
    )
    (project.tree / OVERLAY_DST / "extra.py").write_text("NEW = 1\n")
    r = project.run("export")
    assert r.code == 0, r.text
    names = (project.root / "patches/series").read_text().split()
    assert names == [
        "0001-add-a-kv-transfer-hook-to-the-engine.patch",
        "0002-make-config-line-3-configurable.patch",
    ]
    first = (project.root / "patches" / names[0]).read_text()
    assert first.startswith(
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: =?UTF-8?q?J=C3=B6hn=20Dev?= <john@example.com>\n"
        "Subject: [PATCH] Add a KV transfer hook to the engine\n"
    )
    assert "Date:" not in first
    assert "# a line starting with a hash is kept\n" in first
    assert (
        "Upstream-Status: Inappropriate [mooncake-specific wiring]\n---\ndiff --git"
        in first
    )
    assert (
        "\nindex " in first and ".." in first.split("\nindex ")[1][:90]
    )  # full index line
    assert len(first.split("\nindex ")[2].split("..")[0]) == 40
    assert OVERLAY_DST not in first  # overlay files are not patch material
    assert (
        project.root / "connector/store.py"
    ).read_text() == "class Store:\n    edited = True\n"
    assert (project.root / "connector/extra.py").read_text() == "NEW = 1\n"
    assert project.run("check").code == 0

    exported = project.snapshot(*FOLDERS)
    # export again: nothing changes
    r = project.run("export")
    assert r.code == 0 and "0 patch files written" in r.out
    assert project.snapshot(*FOLDERS) == exported
    # apply (rebuilds the order: patches, then overlay) then export: no byte changes
    assert project.run("apply").code == 0
    assert project.run("export").code == 0
    assert project.snapshot(*FOLDERS) == exported
    # from a fresh tree: apply then export changes no byte
    shutil.rmtree(project.tree)
    shutil.rmtree(project.git_dir)
    r = project.run("apply")
    assert r.code == 0, r.text
    assert project.run("status").code == 0
    assert project.run("export").code == 0
    assert project.snapshot(*FOLDERS) == exported


def test_export_refuses_uncommitted_edits_outside_overlay(project) -> None:
    assert project.run("apply").code == 0
    before = project.snapshot(*FOLDERS)
    (project.tree / "vllm/engine.py").write_text("changed\n")
    r = project.run("export")
    assert r.code == 1
    assert "vllm/engine.py" in r.err and "commit" in r.err and "vllm.git" in r.err
    assert project.snapshot(*FOLDERS) == before


def test_export_refuses_to_overwrite_newer_patch_file(project) -> None:
    new = replace_line(
        UPSTREAM_FILES["vllm/engine.py"], "engine line 2\n", "engine line 2!\n"
    )
    project.add_patch(
        "0001-engine.patch",
        patch_text("Engine", project.edit_patch("vllm/engine.py", new)),
    )
    assert project.run("apply").code == 0
    path = project.root / "patches/0001-engine.patch"
    path.write_text(path.read_text().replace("Because", "Because, edited,"))
    r = project.run("export")
    assert r.code == 1
    assert "patches/0001-engine.patch: changed since it was applied" in r.err
    assert "Because, edited," in path.read_text()
    r = project.run("export", "--force")
    assert r.code == 0, r.text
    assert "Because, edited," not in path.read_text()  # the tree's version won
    assert (project.root / "patches/series").read_text() == "0001-engine.patch\n"


def test_export_normalises_hand_written_patches_once(project) -> None:
    new = replace_line(
        UPSTREAM_FILES["vllm/engine.py"], "engine line 2\n", "engine line 2!\n"
    )
    project.add_patch(
        "fix-engine.patch",
        patch_text("Fix engine", project.edit_patch("vllm/engine.py", new)),
    )
    assert project.run("apply").code == 0
    assert project.run("export").code == 0
    assert (project.root / "patches/series").read_text() == "0001-fix-engine.patch\n"
    assert not (project.root / "patches/fix-engine.patch").exists()
    canonical = project.snapshot(*FOLDERS)
    assert project.run("apply").code == 0
    assert project.run("export").code == 0
    assert project.snapshot(*FOLDERS) == canonical


def test_export_keeps_overlay_files_that_are_newer_in_the_repo(project) -> None:
    """Edit a hook (commit in the tree) and its overlay module (in the repo) in
    one go: export writes the patch and leaves the repo's module alone; apply
    then places it. (Both sides edited stays a refusal.)"""
    assert project.run("apply").code == 0
    repo_store = project.root / "connector/store.py"
    repo_store.write_text("class Store:\n    newer_in_repo = True\n")
    (project.root / "connector/added.py").write_text("ADDED = 1\n")
    make_edits(project)
    r = project.run("export")
    assert r.code == 0, r.text
    assert "newer in the repo kept" in r.text
    assert repo_store.read_text() == "class Store:\n    newer_in_repo = True\n"
    assert (project.root / "connector/added.py").read_text() == "ADDED = 1\n"
    assert len((project.root / "patches/series").read_text().split()) == 2
    assert project.run("apply").code == 0
    assert "newer_in_repo" in (project.tree / OVERLAY_DST / "store.py").read_text()
    assert project.run("check").code == 0

    (project.tree / OVERLAY_DST / "store.py").write_text("tree side\n")
    repo_store.write_text("repo side\n")
    r = project.run("export")
    assert r.code == 1 and "changed both in the repo and in the tree" in r.err
    assert repo_store.read_text() == "repo side\n"
