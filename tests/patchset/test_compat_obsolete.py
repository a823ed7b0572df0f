"""compat's "obsolete" verdict, and check's look at each Backport claim.

A patch whose header says it is upstream's own change (``Backport [...]``, or
``Inappropriate [superseded by ...]``) and whose change a release already has is
"obsolete: drop it" there, not a conflict: the roll drops it instead of porting
it. A patch that claims nothing of the kind keeps its plain verdict.
"""

from __future__ import annotations

import json

import pytest
from conftest import OVERLAY_DST, Project, manifest_text, numbered, patch_text, udiff
from test_compat_grid import Upstream, change, make_sdist

from patchset import releases
from patchset.compat.applycheck import check_patch
from patchset.compat.inputs import TreeState
from patchset.series import parse_patch

PATH = "vllm/x.py"
PIN = numbered("x", 30)
FIX = change({PATH: PIN}, PATH, "x line 10\n", "x line 10 fixed\n")[PATH]
BACKPORT = "Upstream-Status: Backport [vllm-project/vllm#12345]"
SUPERSEDED = "Upstream-Status: Inappropriate [superseded by vllm-project/vllm#777]"
PENDING = "Upstream-Status: Pending"


def fix_patch(status: str, name: str = "0001-fix.patch"):
    diff = udiff(PATH, PIN, FIX)
    return parse_patch(name, patch_text("Fix x line 10", diff, status=status).encode())


def verdict(patch, release: str) -> dict:
    return check_patch(patch, TreeState({PATH}, {PATH: release.encode()}))


# the release has the fix, and reworded the line above it: the patch neither
# applies nor reverse-applies, but its added line is there
MOVED_ON = change({PATH: FIX}, PATH, "x line 9\n", "x line nine\n")[PATH]


@pytest.mark.parametrize("status", [BACKPORT, SUPERSEDED])
def test_a_backport_whose_change_the_release_has_is_obsolete(status) -> None:
    row = verdict(fix_patch(status), MOVED_ON)
    assert row["status"] == "obsolete", row
    assert row["obsolete"]["claim"] == status.split(": ", 1)[1]
    assert "added lines" in row["obsolete"]["how"]
    assert row["files"][0]["status"] == "conflict"  # what it would be otherwise


def test_a_backport_that_reverse_applies_is_obsolete() -> None:
    row = verdict(fix_patch(BACKPORT), FIX)
    assert row["status"] == "obsolete", row
    assert "reverse-applies" in row["obsolete"]["how"]


def test_a_patch_that_claims_nothing_keeps_its_verdict() -> None:
    assert verdict(fix_patch(PENDING), MOVED_ON)["status"] == "conflict"
    assert verdict(fix_patch(PENDING), FIX)["status"] == "upstream"


def test_a_backport_the_release_lacks_is_not_obsolete() -> None:
    assert verdict(fix_patch(BACKPORT), PIN)["status"] == "exact"
    elsewhere = change({PATH: PIN}, PATH, "x line 10\n", "x line ten\n")[PATH]
    assert verdict(fix_patch(BACKPORT), elsewhere)["status"] == "conflict"


def test_the_grid_says_obsolete_drop_it(tmp_path, monkeypatch) -> None:
    up = Upstream(tmp_path)
    files = {
        "PKG-INFO": "Name: vllm\n",
        "vllm/__init__.py": "",
        f"{OVERLAY_DST.rsplit('/', 1)[0]}/__init__.py": "",  # the overlay's parent
        PATH: PIN,
    }
    up.commit("initial", files)
    up.release("0.18.1")
    up.commit("Fix x line 10 (#12345)", {**files, PATH: MOVED_ON})
    up.release("0.19.0")
    up.release("0.20.0")  # publish() lists 0.20.0 (and an rc of it)
    up.publish()
    proj = Project(tmp_path / "p", files)
    sha = make_sdist(proj.source, "0.18.1", files)
    (proj.root / "patches" / "upstream.toml").write_text(manifest_text(sha))
    diff = udiff(PATH, PIN, FIX)
    proj.add_patch("0001-fix.patch", patch_text("Fix x line 10", diff, status=BACKPORT))
    monkeypatch.setenv("VMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VMP_INDEX_URL", str(up.index))
    monkeypatch.delenv("VMP_SDIST_URL", raising=False)
    releases.clear_index_cache()
    try:
        res = proj.run("compat", "--versions", "0.19.0")
    finally:
        releases.clear_index_cache()
    assert res.code == 0, res.text  # not a break: nothing to port
    report = json.loads((proj.root / "results" / "compat.json").read_text())
    (row,) = report["versions"][0]["patches"]
    assert row["status"] == "obsolete"
    grid = next(ln for ln in res.out.splitlines() if ln.startswith("0.19.0"))
    assert grid.split()[1] == "D"
    assert "D obsolete" in res.out
    assert "0001  obsolete from 0.19.0: drop it" in res.out
    assert "Backport [vllm-project/vllm#12345]" in res.out


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
