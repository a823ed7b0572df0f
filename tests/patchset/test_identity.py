"""Commit <-> patch identity: the Patch-Filename trailer survives amend, fixup,
rebase and reordering in the tree, and export writes each commit back to its file."""

from __future__ import annotations

import json

from conftest import UPSTREAM_FILES, patch_text, replace_line

ENGINE = UPSTREAM_FILES["vllm/engine.py"]
CONFIG = UPSTREAM_FILES["vllm/config.py"]
NAMES = ["0001-engine.patch", "0002-config.patch", "0003-engine-tail.patch"]


def three_patches(project) -> None:
    """Three applied patches, exported once so their files are in canonical form."""
    engine = replace_line(ENGINE, "engine line 2\n", "engine line 2 a\n")
    project.add_patch(
        NAMES[0], patch_text("Engine A", project.edit_patch("vllm/engine.py", engine))
    )
    config = replace_line(CONFIG, "config line 10\n", "config line 10 b\n")
    project.add_patch(
        NAMES[1], patch_text("Config B", project.edit_patch("vllm/config.py", config))
    )
    tail = replace_line(engine, "engine line 28\n", "engine line 28 c\n")
    project.add_patch(
        NAMES[2],
        patch_text("Engine C", project.edit_patch("vllm/engine.py", tail, old=engine)),
    )
    assert project.run("apply").code == 0
    assert project.run("export").code == 0


def status(project) -> dict:
    return json.loads(project.run("status", "--json").out)


def commit_of(project, name: str) -> str:
    return project.git(
        "log", "--format=%H", f"--grep=^Patch-Filename: {name}$", "vmp-pristine..HEAD"
    )


def fixup(project, path: str, old: str, new: str, name: str) -> None:
    """Edit a tree file, commit it as a fixup of patch ``name``'s commit, autosquash."""
    file = project.tree / path
    file.write_text(file.read_text().replace(old, new))
    project.git("add", path)
    project.git("commit", "-q", f"--fixup={commit_of(project, name)}")
    rebase(project, "")


def rebase(project, todo_edit: str) -> None:
    """git rebase -i onto the pristine tag with a sed script as the todo editor."""
    env_editor = f"sed -i -e '{todo_edit}'" if todo_edit else "true"
    project.git(
        "-c",
        f"sequence.editor={env_editor}",
        "-c",
        "core.editor=true",
        "rebase",
        "-q",
        "-i",
        "--autosquash",
        "vmp-pristine",
    )


def test_apply_tags_commits_and_export_strips_the_trailer(project) -> None:
    three_patches(project)
    before = project.snapshot("patches")
    for name in NAMES:
        assert commit_of(project, name), name
    message = project.git("log", "-1", "--format=%B", commit_of(project, NAMES[0]))
    assert message.endswith(
        "Upstream-Status: Pending\nPatch-Filename: 0001-engine.patch"
    )
    overlay = project.git("log", "-1", "--format=%B", "HEAD")
    assert "Vmp-Overlay: true" in overlay
    r = project.run("export")
    assert r.code == 0 and "0 patch files written" in r.out, r.text
    assert project.snapshot("patches") == before
    assert all(b"Patch-Filename" not in v for v in before.values())


def test_amended_commit_is_its_patch_changed_not_unknown(project) -> None:
    three_patches(project)
    fixup(
        project, "vllm/engine.py", "engine line 28 c\n", "engine line 28 c2\n", NAMES[2]
    )
    data = status(project)
    states = {p["name"]: p["state"] for p in data["patches"]}
    assert states == {NAMES[0]: "applied", NAMES[1]: "applied", NAMES[2]: "amended"}, (
        data
    )
    assert [e["path"] for e in data["uncaptured"]] == [NAMES[2]]
    assert "not from a series patch" not in json.dumps(data)
    assert data["in_sync"] is False
    r = project.run("status")
    assert "amended  0003-engine-tail.patch" in r.out and "run export" in r.out

    r = project.run("apply")  # would discard the amendment
    assert r.code == 1 and NAMES[2] in r.err and "run export" in r.err

    r = project.run("export")
    assert r.code == 0, r.text
    assert (project.root / "patches/series").read_text().split() == NAMES
    assert "engine line 28 c2" in (project.root / "patches" / NAMES[2]).read_text()
    assert sorted(p.name for p in (project.root / "patches").glob("*.patch")) == NAMES
    assert status(project)["in_sync"] is True


def test_fixup_into_an_early_patch_keeps_every_name_and_no_overlay_patch(
    project,
) -> None:
    """The fixup rewrites every later commit, the overlay commit too: nothing becomes
    an unknown commit and the overlay commit never turns into a patch."""
    three_patches(project)
    before = project.snapshot("patches")
    fixup(
        project, "vllm/config.py", "config line 10 b\n", "config line 10 b2\n", NAMES[1]
    )
    data = status(project)
    assert {p["name"]: p["state"] for p in data["patches"]} == {
        NAMES[0]: "applied",
        NAMES[1]: "amended",
        NAMES[2]: "amended",  # same content, rewritten by the rebase
    }
    assert data["overlay"]["placed"] is True
    r = project.run("export")
    assert r.code == 0, r.text
    after = project.snapshot("patches")
    assert sorted(after) == sorted(before)  # no 0004-vmp-overlay.patch
    changed = {k for k in after if after[k] != before[k]}
    assert changed == {f"patches/{NAMES[1]}"}
    assert status(project)["in_sync"] is True
    r = project.run("apply")
    assert r.code == 0 and "up to date" in r.out, r.text


def test_reordered_commits_keep_their_files(project) -> None:
    three_patches(project)
    before = project.snapshot("patches")
    # move "Config B" (second) to the end of the patch commits
    rebase(project, "2{h;d};3{G}")
    assert project.commits() == [
        "[PATCH] Engine A",
        "[PATCH] Engine C",
        "[PATCH] Config B",
        "vmp-overlay",
    ]
    assert status(project)["in_sync"] is False
    r = project.run("export")
    assert r.code == 0, r.text
    assert (project.root / "patches/series").read_text().split() == [
        NAMES[0],
        NAMES[2],
        NAMES[1],
    ]
    after = project.snapshot("patches")
    assert {k for k in after if k != "patches/series"} == {
        k for k in before if k != "patches/series"
    }
    assert after[f"patches/{NAMES[1]}"] == before[f"patches/{NAMES[1]}"]
    assert status(project)["in_sync"] is True


def test_reworded_subject_keeps_the_file_name(project) -> None:
    three_patches(project)
    rebase(project, "1s/^pick/reword/")  # reword with the message unchanged ...
    # ... then a real reword of the tip patch through amend on a detached rebase stop
    rebase(project, "3s/^pick/edit/")
    message = project.git("log", "-1", "--format=%B")
    project.git(
        "commit",
        "-q",
        "--amend",
        "-m",
        message.replace("Engine C", "Engine C, renamed"),
    )
    project.git("-c", "core.editor=true", "rebase", "--continue")
    r = project.run("export")
    assert r.code == 0, r.text
    assert (project.root / "patches/series").read_text().split() == NAMES
    assert (
        "Subject: [PATCH] Engine C, renamed"
        in (project.root / "patches" / NAMES[2]).read_text()
    )


def test_new_commit_gets_a_new_file_then_keeps_it_when_amended(project) -> None:
    three_patches(project)
    engine = project.tree / "vllm/engine.py"
    engine.write_text(
        engine.read_text().replace("engine line 15\n", "engine line 15 d\n")
    )
    project.git("add", "-A")
    project.git("commit", "-q", "-m", "Engine D\n\nWhy D.\n\nUpstream-Status: Pending")
    r = project.run("export")
    assert r.code == 0, r.text
    names = (project.root / "patches/series").read_text().split()
    assert names == [*NAMES, "0004-engine-d.patch"]
    # export tagged the new commit (message only; the work tree did not change)
    assert commit_of(project, "0004-engine-d.patch")
    assert status(project)["in_sync"] is True
    # the new commit is now the overlay's parent; amend it via fixup: same file
    engine.write_text(
        engine.read_text().replace("engine line 15 d\n", "engine line 15 d2\n")
    )
    project.git("add", "-A")
    project.git("commit", "-q", f"--fixup={commit_of(project, '0004-engine-d.patch')}")
    rebase(project, "")
    assert status(project)["patches"][3]["state"] == "amended"
    assert project.run("export").code == 0
    assert (project.root / "patches/series").read_text().split() == names
    assert (
        "engine line 15 d2"
        in (project.root / "patches/0004-engine-d.patch").read_text()
    )


def test_tree_from_before_the_trailers_is_rebuilt_by_apply(project) -> None:
    three_patches(project)
    state_file = project.git_dir / "patchset-state.json"
    data = json.loads(state_file.read_text())
    data["version"] = 1
    state_file.write_text(json.dumps(data))
    r = project.run("apply")
    assert r.code == 0 and "[1/3] applying" in r.out, r.text
    assert json.loads(state_file.read_text())["version"] == 2


def test_upstream_file_amended_into_the_overlay_commit_is_an_edit(project) -> None:
    three_patches(project)
    engine = project.tree / "vllm/engine.py"
    engine.write_text(
        engine.read_text().replace("engine line 15\n", "engine line 15 hidden\n")
    )
    # HEAD is the overlay commit
    project.git("commit", "-q", "-a", "--amend", "--no-edit")
    data = status(project)
    assert data["in_sync"] is False
    assert [e["path"] for e in data["uncaptured"]] == ["vllm/engine.py"]
    assert "overlay commit" in data["uncaptured"][0]["why"]
    r = project.run("apply")
    assert r.code == 1 and "vllm/engine.py" in r.err


def test_a_trailer_cannot_name_a_file_outside_patches(project) -> None:
    three_patches(project)
    engine = project.tree / "vllm/engine.py"
    engine.write_text(
        engine.read_text().replace("engine line 16\n", "engine line 16 e\n")
    )
    project.git("add", "-A")
    project.git(
        "commit",
        "-q",
        "-m",
        "Engine E\n\nWhy E.\n\nUpstream-Status: Pending\nPatch-Filename: "
        "0009-../../evil.patch",
    )
    r = project.run("export")
    assert r.code == 0, r.text
    assert not (project.root.parent / "evil.patch").exists()
    assert (project.root / "patches/series").read_text().split()[
        -1
    ] == "0004-engine-e.patch"
