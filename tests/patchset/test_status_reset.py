"""build.py status and reset."""

from __future__ import annotations

import json

from conftest import OVERLAY_DST, UPSTREAM_FILES, patch_text, replace_line

ENGINE = UPSTREAM_FILES["vllm/engine.py"]


def engine_patch(project, name: str, line: str, suffix: str = " patched") -> None:
    new = replace_line(ENGINE, line, line.rstrip("\n") + suffix + "\n")
    project.write_patch(
        name, patch_text(f"Engine {name}", project.edit_patch("vllm/engine.py", new))
    )


def status(project) -> tuple[int, dict]:
    r = project.run("status", "--json")
    return r.code, json.loads(r.out)


def test_status_reports_applied_changed_pending_uncaptured(project) -> None:
    engine_patch(project, "0001-a.patch", "engine line 2\n")
    engine_patch(project, "0002-b.patch", "engine line 20\n")
    project.set_series("0001-a.patch", "0002-b.patch")
    assert project.run("apply").code == 0
    code, data = status(project)
    assert code == 0 and data["in_sync"] is True
    assert [p["state"] for p in data["patches"]] == ["applied", "applied"]
    assert data["upstream"]["version"] == "0.18.1"

    engine_patch(project, "0002-b.patch", "engine line 20\n", " changed")
    engine_patch(project, "0003-c.patch", "engine line 28\n")
    project.set_series("0001-a.patch", "0002-b.patch", "0003-c.patch")
    (project.tree / "vllm/config.py").write_text("hand edit\n")
    (project.tree / OVERLAY_DST / "store.py").write_text("edited in tree\n")
    code, data = status(project)
    assert code == 1 and data["in_sync"] is False
    assert [(p["name"], p["state"]) for p in data["patches"]] == [
        ("0001-a.patch", "applied"),
        ("0002-b.patch", "changed"),
        ("0003-c.patch", "pending"),
    ]
    assert {e["path"] for e in data["uncaptured"]} == {
        "vllm/config.py",
        f"{OVERLAY_DST}/store.py",
    }
    assert data["overlay"]["tree_edited"] == [f"{OVERLAY_DST}/store.py"]

    r = project.run("status")
    assert r.code == 1
    assert "changed  0002-b.patch" in r.out and "pending  0003-c.patch" in r.out
    assert "vllm/config.py  (uncommitted change (M))" in r.out
    assert "status: out of sync" in r.out


def test_status_removed_patch(project) -> None:
    engine_patch(project, "0001-a.patch", "engine line 2\n")
    project.set_series("0001-a.patch")
    assert project.run("apply").code == 0
    project.set_series()
    code, data = status(project)
    assert code == 1 and [p["name"] for p in data["removed"]] == ["0001-a.patch"]
    assert project.run("apply").code == 0
    assert status(project)[0] == 0
    assert (project.tree / "vllm/engine.py").read_text() == ENGINE


def test_status_without_tree(project) -> None:
    engine_patch(project, "0001-a.patch", "engine line 2\n")
    project.set_series("0001-a.patch")
    code, data = status(project)
    assert code == 1
    assert data["tree"]["present"] is False
    assert data["patches"][0]["state"] == "pending"


def test_reset_restores_pristine_tree(project) -> None:
    engine_patch(project, "0001-a.patch", "engine line 2\n")
    project.set_series("0001-a.patch")
    assert project.run("apply").code == 0
    (project.tree / "vllm/untracked.py").write_text("x\n")
    r = project.run("reset")
    assert r.code == 1 and "vllm/untracked.py" in r.err
    r = project.run("reset", "--force")
    assert r.code == 0, r.text
    for rel, text in UPSTREAM_FILES.items():
        assert (project.tree / rel).read_text() == text, rel
    assert not (project.tree / "vllm/untracked.py").exists()
    assert not (project.tree / OVERLAY_DST).exists()
    assert project.head() == project.git("rev-parse", "vmp-pristine")
    assert project.git("status", "--porcelain") == ""
    code, data = status(project)
    assert code == 1 and data["patches"][0]["state"] == "pending"
    assert data["overlay"]["placed"] is False
    assert project.run("apply").code == 0
    assert status(project)[0] == 0


def test_reset_without_tree_unpacks_pristine(project) -> None:
    r = project.run("reset")
    assert r.code == 0, r.text
    assert (project.tree / "vllm/engine.py").read_text() == ENGINE
    assert not (project.tree / OVERLAY_DST).exists()
