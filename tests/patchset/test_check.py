"""build.py check: series/file agreement, headers (and Backport claims), zero-fuzz apply
on the sdist, overlay. Newer releases (check --release): test_compat_grid.py."""

from __future__ import annotations

import json

import pytest
from conftest import OVERLAY_DST, UPSTREAM_FILES, patch_text, replace_line

ENGINE = UPSTREAM_FILES["vllm/engine.py"]


def good_patch(
    project, name: str = "0001-engine.patch", line: str = "engine line 2\n"
) -> str:
    new = replace_line(ENGINE, line, line.rstrip("\n") + " patched\n")
    text = patch_text("Engine tweak", project.edit_patch("vllm/engine.py", new))
    project.write_patch(name, text)
    return text


def check_json(project) -> tuple[int, dict]:
    r = project.run("check", "--json")
    return r.code, json.loads(r.out)


def test_empty_series_is_valid(project) -> None:
    assert project.run("fetch").code == 0
    r = project.run("check")
    assert r.code == 0, r.text
    assert "check: ok: 0 patches" in r.out
    assert not project.tree.exists()  # check never builds a tree


def test_good_series_passes(project) -> None:
    assert project.run("fetch").code == 0
    good_patch(project)
    project.set_series("0001-engine.patch")
    code, data = check_json(project)
    assert code == 0, data
    assert data["ok"] is True and data["applied_to_pristine"] == ["0001-engine.patch"]


def test_series_and_files_disagree(project) -> None:
    assert project.run("fetch").code == 0
    good_patch(project, "0001-engine.patch")
    good_patch(project, "0009-unlisted.patch", "engine line 9\n")
    project.set_series("0001-engine.patch", "0002-missing.patch", "0001-engine.patch")
    code, data = check_json(project)
    assert code == 1
    messages = [p["message"] for p in data["problems"] if p["kind"] == "series"]
    assert any(
        "0002-missing.patch is listed but patches/0002-missing.patch does not exist"
        in m
        for m in messages
    )
    assert any(
        "patches/0009-unlisted.patch is not listed in patches/series" in m
        for m in messages
    )
    assert any(
        "series line 3: 0001-engine.patch is listed twice" in m for m in messages
    )
    assert len(messages) == 3


def test_headers_are_enforced(project) -> None:
    assert project.run("fetch").code == 0
    diffs = {
        "0001-no-subject.patch": ("engine line 1\n", {"subject": None}),
        "0002-no-why.patch": ("engine line 9\n", {"body": ""}),
        "0003-no-status.patch": ("engine line 17\n", {"status": None}),
        "0004-bad-status.patch": (
            "engine line 25\n",
            {"status": "Upstream-Status: Submitted"},
        ),
    }
    base = ENGINE
    for name, (line, kwargs) in diffs.items():
        new = replace_line(base, line, line.rstrip("\n") + " x\n")
        project.write_patch(
            name,
            patch_text(
                diff=project.edit_patch("vllm/engine.py", new, old=base),
                **{"subject": "S", **kwargs},
            ),
        )
        base = new
    project.set_series(*diffs)
    code, data = check_json(project)
    assert code == 1
    header = {
        p["patch"]: p["message"] for p in data["problems"] if p["kind"] == "header"
    }
    assert "missing Subject" in header["0001-no-subject.patch"]
    assert "does not say why" in header["0002-no-why.patch"]
    assert "missing 'Upstream-Status:'" in header["0003-no-status.patch"]
    assert "invalid 'Upstream-Status: Submitted'" in header["0004-bad-status.patch"]
    assert data["applied_to_pristine"] == list(diffs)  # the diffs themselves are fine
    r = project.run("check")
    assert r.code == 1 and "problem [header]: 0002-no-why.patch" in r.out


def test_fuzzy_patch_caught_with_hunk_named(project) -> None:
    assert project.run("fetch").code == 0
    good_patch(project)
    wrong = replace_line(ENGINE, "engine line 20\n", "engine line twenty\n")
    new = replace_line(wrong, "engine line 22\n", "engine line 22 x\n")
    project.write_patch(
        "0002-fuzzy.patch",
        patch_text("Fuzzy", project.edit_patch("vllm/engine.py", new, old=wrong)),
    )
    good_patch(project, "0003-after.patch", "engine line 28\n")
    project.set_series("0001-engine.patch", "0002-fuzzy.patch", "0003-after.patch")
    code, data = check_json(project)
    assert code == 1
    (problem,) = [p for p in data["problems"] if p["kind"] == "apply"]
    assert problem["patch"] == "0002-fuzzy.patch"
    detail = problem["detail"]
    assert detail["file"] == "vllm/engine.py" and detail["hunk"] == 1
    assert detail["hunk_header"].startswith("@@ -19,7 +19,7 @@")
    assert detail["line"] == 20 and detail["expected"] == "engine line twenty\n"
    assert detail["actual"] == "engine line 20\n"
    assert data["unchecked"] == ["0003-after.patch"]


def test_unparseable_patch(project) -> None:
    assert project.run("fetch").code == 0
    text = patch_text(
        "Broken", "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n-a\n+b\n"
    )
    project.write_patch("0001-broken.patch", text)
    project.set_series("0001-broken.patch")
    code, data = check_json(project)
    assert code == 1
    assert [p["kind"] for p in data["problems"]] == ["parse"]
    assert "does not parse" in data["problems"][0]["message"]


def test_sdist_not_cached_cannot_run(project) -> None:
    r = project.run("check")
    assert r.code == 2
    assert "run `python build.py fetch`" in r.err
    code, data = check_json(project)
    assert code == 2 and "not cached" in data["cannot_run"]


def test_overlay_overwriting_a_file_a_patch_creates(project) -> None:
    assert project.run("fetch").code == 0
    diff = project.edit_patch(f"{OVERLAY_DST}/store.py", "x = 1\n", old="")
    project.write_patch("0001-adds.patch", patch_text("Adds a file", diff))
    project.set_series("0001-adds.patch")
    code, data = check_json(project)
    assert code == 1
    (problem,) = data["problems"]
    assert (
        problem["kind"] == "overlay" and "a file a patch creates" in problem["message"]
    )


def test_every_patch_carries_the_series_one_identity(project) -> None:
    assert project.run("fetch").code == 0
    authors = {
        "0001-a.patch": ("engine line 1\n", "Dev <dev@example.com>"),
        "0002-b.patch": ("engine line 9\n", "Dev <dev@example.com>"),
        "0003-c.patch": ("engine line 17\n", "Other <other@example.com>"),
        "0004-d.patch": ("engine line 25\n", "Nobody"),
    }
    base = ENGINE
    for name, (line, author) in authors.items():
        new = replace_line(base, line, line.rstrip("\n") + " x\n")
        project.write_patch(
            name,
            patch_text(
                "S",
                project.edit_patch("vllm/engine.py", new, old=base),
                author=author,
            ),
        )
        base = new
    project.set_series(*authors)
    code, data = check_json(project)
    assert code == 1
    header = [
        (p["patch"], p["message"]) for p in data["problems"] if p["kind"] == "header"
    ]
    named = {patch for patch, _ in header}
    assert named == {"0003-c.patch", "0004-d.patch"}, header
    messages = " ".join(m for _, m in header)
    assert "the series' identity is Dev <dev@example.com> (2 patches)" in messages
    assert "names no email address" in messages


@pytest.mark.parametrize(
    ("claim", "warned"),
    [
        ("Backport [vllm-project/vllm#12345]", False),
        ("Backport [https://github.com/vllm-project/vllm/pull/12345]", False),
        ("Backport [vllm-project/vllm@1a2b3c4d5e6f]", False),
        ("Backport [commit 0123456789abcdef0123456789abcdef01234567]", False),
        ("Backport [from upstream main]", True),
        ("Backport [#12345]", True),
        ("Pending", False),
    ],
)
def test_check_warns_when_a_backport_names_nothing_checkable(
    project, claim, warned
) -> None:
    assert project.run("fetch").code == 0
    diff = project.edit_patch(
        "vllm/engine.py",
        project.upstream_files["vllm/engine.py"].replace(
            "engine line 2\n", "engine line 2 ours\n"
        ),
    )
    project.add_patch(
        "0001-engine.patch",
        patch_text("Engine tweak", diff, status=f"Upstream-Status: {claim}"),
    )
    r = project.run("check", "--json")
    assert r.code == 0, r.text  # a warning, not a problem
    data = json.loads(r.out)
    found = [w for w in data["warnings"] if w["kind"] == "backport"]
    assert bool(found) == warned, data["warnings"]
    if warned:
        assert found[0]["patch"] == "0001-engine.patch"
        assert "vllm-project/vllm#" in found[0]["message"]
        text = project.run("check")
        assert "warning [backport]" in text.out and "0001-engine.patch" in text.out
