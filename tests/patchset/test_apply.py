"""build.py apply: baseline, one commit per patch, zero fuzz, overlay, idempotence."""

from __future__ import annotations

import json

from conftest import OVERLAY_DST, UPSTREAM_FILES, patch_text, replace_line

CONFIG = UPSTREAM_FILES["vllm/config.py"]
ENGINE = UPSTREAM_FILES["vllm/engine.py"]


def add_two_patches(project) -> None:
    new_config = replace_line(CONFIG, "config line 10\n", "config line 10 patched\n")
    project.add_patch(
        "0001-config.patch",
        patch_text("Patch config", project.edit_patch("vllm/config.py", new_config)),
    )
    new_engine = replace_line(ENGINE, "engine line 5\n", "engine line 5\nhook()\n")
    project.add_patch(
        "0002-engine.patch",
        patch_text("Hook engine", project.edit_patch("vllm/engine.py", new_engine)),
    )


def test_apply_builds_tree_with_separate_git_dir(project) -> None:
    add_two_patches(project)
    r = project.run("apply")
    assert r.code == 0, r.text
    assert "[1/2] applying 0001-config.patch" in r.out
    assert "[2/2] applying 0002-engine.patch" in r.out
    tree = project.tree
    assert not (tree / ".git").exists()  # setuptools-scm must not see a repo here
    assert (project.git_dir / "HEAD").is_file()
    assert "/vllm/_version.py" in (project.git_dir / "info" / "exclude").read_text()
    assert "config line 10 patched\n" in (tree / "vllm/config.py").read_text()
    assert "hook()" in (tree / "vllm/engine.py").read_text()
    assert (tree / OVERLAY_DST / "store.py").read_text() == "class Store:\n    pass\n"
    assert (
        tree
        / "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/hashsync/sub/sync.py"
    ).is_file()
    assert project.commits() == [
        "[PATCH] Patch config",
        "[PATCH] Hook engine",
        "vmp-overlay",
    ]
    # the commit carries the patch header: author and body preserved
    log = project.git("log", "-1", "--format=%an <%ae>%n%B", "HEAD~1")
    assert log.startswith("Test Author <author@example.com>\n[PATCH] Hook engine\n")
    assert "Upstream-Status: Pending" in log
    # untracked sdist files matching the artifact rules are still on disk
    assert (tree / "vllm/_version.py").is_file()


def test_apply_is_idempotent(project) -> None:
    add_two_patches(project)
    assert project.run("apply").code == 0
    head = project.head()
    r = project.run("apply")
    assert r.code == 0, r.text
    assert "up to date" in r.out and "nothing changed" in r.out
    assert project.head() == head
    assert len(project.commits()) == 3


def test_fuzzy_patch_refused_tree_left_at_last_good_patch(project) -> None:
    add_two_patches(project)
    # context line 'engine line 4' does not exist as written: fuzz would be needed
    wrong_base = replace_line(ENGINE, "engine line 4\n", "engine line FOUR\n")
    target = replace_line(wrong_base, "engine line 7\n", "engine line 7 changed\n")
    project.add_patch(
        "0003-fuzzy.patch",
        patch_text(
            "Fuzzy", project.edit_patch("vllm/engine.py", target, old=wrong_base)
        ),
    )
    r = project.run("apply")
    assert r.code == 1
    err = r.err
    assert "0003-fuzzy.patch" in err and "file vllm/engine.py" in err
    assert "hunk 1 of 1: @@ -4,7 +4,7 @@" in err
    assert "first mismatching line 4" in err
    assert "expected: 'engine line FOUR'" in err and "actual:   'engine line 4'" in err
    assert "last good patch, 0002-engine.patch" in err
    assert project.commits() == ["[PATCH] Patch config", "[PATCH] Hook engine"]
    assert project.git("status", "--porcelain") == ""  # nothing half-applied
    assert "engine line 7 changed" not in (project.tree / "vllm/engine.py").read_text()
    status = json.loads(project.run("status", "--json").out)
    assert [p["state"] for p in status["patches"]] == ["applied", "applied", "pending"]


def test_offset_patch_refused_with_hunk_named(project) -> None:
    add_two_patches(project)
    # written against a config.py with two extra lines on top: right text, wrong place
    shifted = "extra 1\nextra 2\n" + CONFIG
    target = replace_line(shifted, "config line 30\n", "config line 30 changed\n")
    project.add_patch(
        "0003-offset.patch",
        patch_text("Offset", project.edit_patch("vllm/config.py", target, old=shifted)),
    )
    r = project.run("apply")
    assert r.code == 1
    assert "0003-offset.patch" in r.err and "file vllm/config.py" in r.err
    assert "hunk 1 of 1: @@ -29,7 +29,7 @@" in r.err
    assert "first mismatching line 29" in r.err
    assert "offset -2" in r.err and "offsets are refused" in r.err
    assert len(project.commits()) == 2
    # fixing the patch and re-running continues from the last good patch
    fixed = replace_line(CONFIG, "config line 10\n", "config line 10 patched\n")
    fixed_target = replace_line(fixed, "config line 30\n", "config line 30 changed\n")
    project.write_patch(
        "0003-offset.patch",
        patch_text(
            "Offset", project.edit_patch("vllm/config.py", fixed_target, old=fixed)
        ),
    )
    r = project.run("apply")
    assert r.code == 0, r.text
    assert "[1/3] 0001-config.patch already applied" in r.out
    assert "[3/3] applying 0003-offset.patch" in r.out


def test_dirty_tree_refused_naming_files_then_force(project) -> None:
    add_two_patches(project)
    assert project.run("apply").code == 0
    (project.tree / "vllm/config.py").write_text("edited by hand\n")
    (project.tree / "vllm/new_file.py").write_text("x = 1\n")
    r = project.run("apply")
    assert r.code == 1
    assert "vllm/config.py" in r.err and "vllm/new_file.py" in r.err
    assert "--force" in r.err and "export" in r.err
    # a changed series does not get around it either
    project.set_series("0001-config.patch")
    r = project.run("apply")
    assert r.code == 1 and "vllm/config.py" in r.err
    r = project.run("apply", "--force")
    assert r.code == 0, r.text
    assert "config line 10 patched" in (project.tree / "vllm/config.py").read_text()
    assert not (project.tree / "vllm/new_file.py").exists()
    assert project.commits() == ["[PATCH] Patch config", "vmp-overlay"]


def test_commit_not_from_a_patch_is_an_uncaptured_edit(project) -> None:
    assert project.run("apply").code == 0
    (project.tree / "vllm/engine.py").write_text("mine\n")
    project.git("commit", "-qam", "wip")
    r = project.run("apply")
    assert r.code == 1
    assert "vllm/engine.py" in r.err and "'wip' is not from a series patch" in r.err


def test_series_change_reapplies_from_first_changed_patch(project) -> None:
    add_two_patches(project)
    assert project.run("apply").code == 0
    new_engine = replace_line(ENGINE, "engine line 5\n", "engine line 5\nhook2()\n")
    project.write_patch(
        "0002-engine.patch",
        patch_text("Hook engine", project.edit_patch("vllm/engine.py", new_engine)),
    )
    r = project.run("apply")
    assert r.code == 0, r.text
    assert "[1/2] 0001-config.patch already applied" in r.out
    assert "[2/2] applying 0002-engine.patch" in r.out
    assert "hook2()" in (project.tree / "vllm/engine.py").read_text()
    assert len(project.commits()) == 3


def test_build_artifacts_are_not_edits(project) -> None:
    add_two_patches(project)
    assert project.run("apply").code == 0
    artifacts = [
        "vllm/_C.abi3.so",
        "vllm/__pycache__/config.cpython-311.pyc",
        "build/temp/obj.o",
        ".deps/cutlass/x.h",
        "vllm.egg-info/PKG-INFO",
        "vllm/_version.py",
    ]
    for rel in artifacts:
        path = project.tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("artifact\n")
    assert project.run("status").code == 0
    assert "up to date" in project.run("apply").out
    assert project.run("reset").code == 0
    for rel in artifacts:  # reset keeps ignored build artifacts
        assert (project.tree / rel).is_file(), rel


def test_overlay_overwriting_upstream_file_refused(project) -> None:
    # an overlay whose destination holds an upstream file
    (project.root / "connector" / "base.py").write_text("mine\n")
    toml = project.root / "patches" / "upstream.toml"
    toml.write_text(
        toml.read_text().replace(
            OVERLAY_DST, "vllm/distributed/kv_transfer/kv_connector/v1"
        )
    )
    r = project.run("apply")
    assert r.code == 1
    assert (
        "connector/base.py -> vllm/distributed/kv_transfer/kv_connector/v1/base.py"
        in r.err
    )
    assert "upstream file" in r.err
    assert (
        (project.tree / "vllm/distributed/kv_transfer/kv_connector/v1/base.py")
        .read_text()
        .startswith("base line 1")
    )
    r = project.run("check")
    assert r.code == 1 and "would overwrite an upstream file" in r.out


def test_overlay_change_in_repo_is_placed_again(project) -> None:
    assert project.run("apply").code == 0
    (project.root / "connector" / "store.py").write_text("class Store:\n    size = 2\n")
    status = json.loads(project.run("status", "--json").out)
    assert status["overlay"]["repo_changed"] == [f"{OVERLAY_DST}/store.py"]
    assert status["uncaptured"] == []
    r = project.run("apply")
    assert r.code == 0, r.text
    assert (
        project.tree / OVERLAY_DST / "store.py"
    ).read_text() == "class Store:\n    size = 2\n"
    assert project.run("status").code == 0


def test_missing_series_file_refused_before_touching_anything(project) -> None:
    project.set_series("0001-missing.patch")
    r = project.run("apply")
    assert r.code == 1
    assert (
        "0001-missing.patch is listed but patches/0001-missing.patch does not exist"
        in r.err
    )
    assert not project.tree.exists()


def test_tree_without_git_dir_cannot_run(project) -> None:
    (project.tree / "vllm").mkdir(parents=True)
    r = project.run("apply")
    assert r.code == 2
    assert "third_party/vllm.git does not" in r.err


def test_real_cli_subprocess_exit_codes(project) -> None:
    r = project.run_cli("status", "--json")
    assert r.code == 1, r.text
    assert json.loads(r.out)["tree"]["present"] is False
    r = project.run_cli("apply")
    assert r.code == 0, r.text
    r = project.run_cli("status")
    assert r.code == 0, r.text


def test_git_missing_cannot_run(project, monkeypatch, tmp_path) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    r = project.run_cli("apply")
    assert r.code == 2
    assert "git is not installed" in r.err
    assert not project.tree.exists()
