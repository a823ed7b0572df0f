"""``build.py compat``: the grid over synthetic releases, attribution, caching.

Everything is local: three synthetic sdists (0.18.1 = the pin, 0.19.0, 0.20.0)
behind a synthetic PyPI-JSON index (``VMP_INDEX_URL``), and a tmp git repo
whose tags hold the same trees, so the conflict can be traced to the commit
that changed the hunk's lines.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from conftest import OVERLAY_DST, Project, manifest_text, numbered, patch_text, udiff

from patchset import compat, releases, upstream
from patchset.compat import imports as compat_imports
from patchset.compat import run as compat_run

CONNECTOR = (
    "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py"
)

PIN_FILES = {
    "PKG-INFO": "Name: vllm\n",
    "vllm/__init__.py": "",
    "vllm/a.py": numbered("a", 30),  # 0001: exact everywhere
    "vllm/b.py": numbered("b", 30),  # 0002: offset (lines inserted above)
    "vllm/c.py": numbered("c", 30),  # 0003: fuzz (its first context line changed)
    "vllm/d.py": numbered(
        "d", 30
    ),  # 0004: conflict from 0.20.0 (its removed line changed)
    "vllm/e.py": numbered("e", 30),  # 0005: already upstream from 0.19.0
    "vllm/old/f.py": numbered("f", 30),  # 0006: moved to vllm/new/f.py in 0.19.0
    "vllm/base.py": "class Thing:\n    pass\n\n\ndef helper():\n    return 1\n",
    CONNECTOR: (
        "Hook = object()\n\n\nclass Worker:\n"
        "    def get_finished(self):\n        return set()\n"
    ),
}

STORE = (
    "from vllm.base import Thing, helper\n"
    "from ..mooncake_connector import Hook\n"
    "from . import other\n"
    "import vllm.base\n"
)
# Our subclass of upstream's Worker: 0.20.0 renames the method it overrides.
WORKER = (
    "from ..mooncake_connector import Worker\n\n\n"
    "class ExtWorker(Worker):\n"
    "    def get_finished(self):\n"
    "        return super().get_finished()\n"
)


def change(files: dict[str, str], path: str, old: str, new: str) -> dict[str, str]:
    assert old in files[path], (path, old)
    return {**files, path: files[path].replace(old, new, 1)}


def make_sdist(path: Path, version: str, files: dict[str, str]) -> str:
    top = f"vllm-{version}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(buf.getvalue(), mtime=0))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "U",
        "GIT_AUTHOR_EMAIL": "u@example.com",
        "GIT_COMMITTER_NAME": "U",
        "GIT_COMMITTER_EMAIL": "u@example.com",
    }
    proc = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


class Upstream:
    """Synthetic releases: a git history with tags, sdists of the tagged trees, an index."""

    def __init__(self, base: Path) -> None:
        self.repo = base / "vllm-git"
        self.index = base / "index"
        self.files: dict[str, dict[str, str]] = {}
        self.commits: dict[str, str] = {}
        git(self.repo.parent, "init", "-q", "-b", "main", str(self.repo))
        self.current: dict[str, str] = {}

    def commit(self, label: str, files: dict[str, str]) -> None:
        for path in set(self.current) - set(files):
            (self.repo / path).unlink()
        for path, text in files.items():
            p = self.repo / path
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        git(self.repo, "add", "-A")
        git(self.repo, "commit", "-q", "-m", label)
        self.commits[label] = git(self.repo, "rev-parse", "HEAD")
        self.current = dict(files)

    def release(self, version: str) -> None:
        git(self.repo, "tag", f"v{version}")
        self.files[version] = dict(self.current)

    def publish(self, extra: dict | None = None) -> None:
        releases_json: dict = {}
        for version, files in self.files.items():
            sdist = self.index / "files" / f"vllm-{version}.tar.gz"
            sha = make_sdist(sdist, version, files)
            releases_json[version] = [
                {
                    "filename": sdist.name,
                    "packagetype": "sdist",
                    "url": f"../files/{sdist.name}",  # relative, like a mirror
                    "digests": {"sha256": sha},
                    "yanked": False,
                }
            ]
        releases_json["0.21.0rc1"] = releases_json["0.20.0"]  # pre-release: ignored
        releases_json.update(extra or {})
        (self.index / "vllm").mkdir(parents=True, exist_ok=True)
        (self.index / "vllm" / "json").write_text(
            json.dumps({"releases": releases_json})
        )


@pytest.fixture
def world(tmp_path, monkeypatch):
    up = Upstream(tmp_path)
    pin = PIN_FILES
    up.commit("initial", pin)
    up.release("0.18.1")
    v19 = {**pin, "vllm/b.py": numbered("new b", 5) + pin["vllm/b.py"]}
    v19 = change(v19, "vllm/c.py", "c line 12\n", "c line twelve\n")
    v19 = change(v19, "vllm/e.py", "e line 5\n", "e line 5 patched\n")
    v19["vllm/new/f.py"] = v19.pop("vllm/old/f.py")
    v19[f"{OVERLAY_DST}/store.py"] = "# upstream's own store\n"
    up.commit("Rework b, c, e; move f to new/; add ext/store.py", v19)
    up.release("0.19.0")
    up.commit(
        "Unrelated: tweak d's tail and a.py's end",
        change(
            change(up.current, "vllm/d.py", "d line 28\n", "d line 28!\n"),
            "vllm/a.py",
            "a line 30\n",
            "a line 30!\n",
        ),
    )
    up.commit(
        "Rename d line 15",
        change(up.current, "vllm/d.py", "d line 15\n", "d line fifteen\n"),
    )
    up.commit(
        "Drop helper()",
        change(up.current, "vllm/base.py", "\n\ndef helper():\n    return 1\n", ""),
    )
    up.commit(
        "Rename Worker.get_finished",
        change(up.current, CONNECTOR, "def get_finished(", "def get_finished_reqs("),
    )
    up.release("0.20.0")
    up.publish()

    proj = Project(tmp_path / "p", {k: v for k, v in pin.items()})
    # The project's pin must be the index's 0.18.1 sdist (the same bytes).
    sha = make_sdist(proj.source.with_name("vllm-0.18.1.tar.gz"), "0.18.1", pin)
    (proj.root / "patches" / "upstream.toml").write_text(manifest_text(sha))
    (proj.root / "connector" / "store.py").write_text(STORE)
    (proj.root / "connector" / "other.py").write_text("")
    (proj.root / "connector" / "worker.py").write_text(WORKER)
    # 0001 also adds two lines at the top of d.py, so 0004's hunk is numbered
    # two lines lower than the pristine file's (its region is mapped back).
    current = dict(pin)
    edits = [
        [
            ("vllm/a.py", "a line 10\n", "a line 10 ours\n"),
            ("vllm/d.py", "d line 1\n", "d line 1\nx\ny\n"),
        ],
        [("vllm/b.py", "b line 10\n", "b line 10 ours\n")],
        [("vllm/c.py", "c line 15\n", "c line 15 ours\n")],
        [("vllm/d.py", "d line 15\n", "d line 15 ours\n")],
        [("vllm/e.py", "e line 5\n", "e line 5 patched\n")],
        [("vllm/old/f.py", "f line 10\n", "f line 10 ours\n")],
        # edits d.py after 0004 (which breaks on 0.20.0): checked on that tree
        [("vllm/d.py", "d line 25\n", "d 25\n")],
    ]
    for i, changes in enumerate(edits, 1):
        diff = ""
        for path, old, new in changes:
            diff += udiff(path, current[path], current[path].replace(old, new, 1))
            current = change(current, path, old, new)
        proj.add_patch(f"000{i}-p{i}.patch", patch_text(f"patch {i}", diff))
    monkeypatch.setenv("VMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VMP_INDEX_URL", str(up.index))
    monkeypatch.delenv("VMP_SDIST_URL", raising=False)
    releases.clear_index_cache()
    yield up, proj
    releases.clear_index_cache()


def run(proj, *args):
    out = proj.root / "results" / "compat.json"
    res = proj.run("compat", *args)
    return res, json.loads(out.read_text()) if out.is_file() else None


def statuses(report: dict) -> dict[str, list[str]]:
    return {
        v["version"]: [p["status"] for p in v["patches"]] for v in report["versions"]
    }


def test_list_versions_and_sdist_info(world) -> None:
    up, _ = world
    assert releases.list_versions() == ["0.18.1", "0.19.0", "0.20.0"]
    assert releases.list_versions(since="0.18.1") == ["0.19.0", "0.20.0"]
    name, url, sha = releases.sdist_info("0.19.0")
    assert name == "vllm-0.19.0.tar.gz"
    assert url == (up.index / "files" / name).resolve().as_uri()
    assert len(sha) == 64


def test_grid_covers_every_status(world) -> None:
    up, proj = world
    res, report = run(proj, "--since", "0.18.1", "--upstream-git", str(up.repo))
    assert res.code == 1, res.text
    v19, v20 = report["versions"]
    assert statuses(report) == {
        "0.19.0": ["exact", "offset", "fuzz", "exact", "upstream", "missing", "exact"],
        "0.20.0": [
            "exact",
            "offset",
            "fuzz",
            "conflict",
            "upstream",
            "missing",
            "fuzz",
        ],
    }
    p7 = v20["patches"][6]
    assert p7["after_failed_same_files"] == ["0004-p4.patch"]
    assert p7["alone_on_target"] == "fuzz"  # its last context line, d line 28, changed
    moved = v19["patches"][5]["files"][0]
    assert (
        moved["moved_to"] == "vllm/new/f.py" and moved["moved_how"] == "same file name"
    )
    assert v19["overlay"]["collisions"] == [f"{OVERLAY_DST}/store.py"]
    assert all(d["parent_exists"] for d in v19["overlay"]["destinations"])
    imports = {(i["module"], i["name"]): i["status"] for i in v20["imports"]}
    assert imports[("vllm.base", "helper")] == "name missing"
    assert imports[("vllm.base", "Thing")] == "ok"
    assert (
        imports[(CONNECTOR[:-3].replace("/", "."), "Hook")] == "ok"
    )  # relative import
    assert not any(
        m.endswith(".ext") or ".ext." in m for m, _ in imports
    )  # ours: skipped
    assert {i["status"] for i in v19["imports"]} == {"ok"}

    # The conflict names the hunk and shows upstream's change of its lines.
    hunk = v20["patches"][3]["files"][0]["hunks"][0]
    assert hunk["result"] == "failed"
    assert "-d line 15\n+d line fifteen" in hunk["upstream_change"]["diff"]
    # pristine numbering on both sides (git's), not the patched file's
    assert hunk["header"].startswith("@@ -14,7 ")
    assert hunk["upstream_change"]["base_range"] == [9, 21]
    assert hunk["upstream_change"]["target_range"] == [9, 21]

    # ... and the commit that changed them, not the unrelated one.
    first = report["first_breaks"]["patches"]["0004-p4.patch"]
    assert (first["version"], first["after"]) == ("0.20.0", "0.19.0")
    shas = [c["sha"] for c in first["causes"][0]["commits"]]
    assert shas == [up.commits["Rename d line 15"]]
    assert up.commits["Unrelated: tweak d's tail and a.py's end"] not in shas
    gone = report["first_breaks"]["patches"]["0006-p6.patch"]
    assert (
        gone["version"] == "0.19.0" and gone["causes"][0]["moved_to"] == "vllm/new/f.py"
    )
    assert [c["sha"] for c in gone["causes"][0]["commits"]] == [
        up.commits["Rework b, c, e; move f to new/; add ext/store.py"]
    ]
    helper = report["first_breaks"]["imports"]["vllm.base.helper"]
    assert helper["version"] == "0.20.0"
    assert helper["used_at"] == [f"{OVERLAY_DST}/store.py:1"]
    assert [c["sha"] for c in helper["commits"]] == [up.commits["Drop helper()"]]

    # The grid on stdout: one row per version, codes from the legend.
    rows = {
        line.split()[0]: line.split()
        for line in res.out.splitlines()
        if line[:1].isdigit()
    }
    assert rows["0.19.0"][1:11] == [".", "o", "f", ".", "U", "M", ".", "C", ".", "."]
    assert rows["0.20.0"][1:11] == [".", "o", "f", "C", "U", "M", "f*", "C", "1", "2"]
    assert "Rename d line 15" in res.out
    assert "[2/2] 0.20.0:" in res.err


def test_grid_reports_an_override_upstream_renamed(world) -> None:
    up, proj = world
    res, report = run(proj, "--since", "0.18.1", "--upstream-git", str(up.repo))
    v19, v20 = report["versions"]
    assert v19["overrides"]["problems"] == [] and v19["overrides"]["errors"] == 0
    (cls,) = v19["overrides"]["classes"]
    assert (cls["class"], cls["file"], cls["overrides"]) == (
        "ExtWorker",
        "connector/worker.py",
        ["get_finished"],
    )
    ov = v20["overrides"]
    assert (ov["errors"], ov["warnings"]) == (2, 0)
    missing, call = ov["problems"]
    assert (missing["kind"], missing["where"], missing["upstream"]) == (
        "override-missing",
        "connector/worker.py:5",
        CONNECTOR,
    )
    pinned = "overrides Worker.get_finished `def get_finished(self)` of vllm 0.18.1"
    assert pinned in missing["message"]
    assert "vllm 0.20.0 has no get_finished on Worker" in missing["message"]
    assert (call["kind"], call["where"]) == ("super-missing", "connector/worker.py:6")
    # first break: 0.20.0, and the upstream commit that renamed it
    first = {e["kind"]: e for e in report["first_breaks"]["overrides"].values()}
    assert set(first) == {"override-missing", "super-missing"}
    entry = first["override-missing"]
    assert (entry["version"], entry["after"]) == ("0.20.0", "0.19.0")
    assert [c["sha"] for c in entry["commits"]] == [
        up.commits["Rename Worker.get_finished"]
    ]
    assert "ovr" in res.out.splitlines()[1]
    assert (
        "override connector/worker.py:5 ExtWorker.get_finished: override-missing (error) "
        "from 0.20.0 (after 0.19.0)" in res.out
    )
    assert "overrides of 1 subclasses: 2 errors" in res.err


def test_versions_option_and_cache(world, monkeypatch) -> None:
    _, proj = world
    res, report = run(proj, "--versions", "0.20.0")
    assert [v["version"] for v in report["versions"]] == ["0.20.0"]
    assert "copying vllm-0.20.0.tar.gz" in res.err
    # 0.20.0 alone: 0004 breaks right after the pin
    assert report["first_breaks"]["patches"]["0004-p4.patch"]["after"] == "0.18.1"

    def boom(*_a, **_k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(compat_run, "analyze", boom)
    res, report = run(proj, "--versions", "0.20.0")
    assert res.code == 1, res.text
    assert "copying" not in res.err and "result cached" in res.err
    assert report["versions"][0]["from_cache"] is True

    # A warm cache needs no index (the digest verified at download is recorded).
    monkeypatch.setenv("VMP_INDEX_URL", str(proj.base / "nowhere"))
    releases.clear_index_cache()
    res, _ = run(proj, "--versions", "0.20.0")
    assert res.code == 1 and "index unavailable" in res.err, res.text

    # A changed patch invalidates the cached result.
    path = proj.root / "patches" / "0001-p1.patch"
    path.write_text(path.read_text().replace("a line 10 ours", "a line 10 OURS"))
    with pytest.raises(AssertionError, match="recomputed"):
        proj.run("compat", "--versions", "0.20.0")


def test_an_edited_subclass_invalidates_the_cached_result(world, monkeypatch) -> None:
    _, proj = world
    run(proj, "--versions", "0.20.0")
    (proj.root / "connector" / "other.py").write_text("X = 2\n")  # no subclass: kept
    res, _ = run(proj, "--versions", "0.20.0")
    assert "result cached" in res.err

    def boom(*_a, **_k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(compat_run, "analyze", boom)
    worker = proj.root / "connector" / "worker.py"
    worker.write_text(worker.read_text().replace("get_finished", "get_finished_reqs"))
    with pytest.raises(AssertionError, match="recomputed"):
        proj.run("compat", "--versions", "0.20.0")


def test_sha256_mismatch_is_refused(world) -> None:
    up, proj = world
    data = json.loads((up.index / "vllm" / "json").read_text())
    data["releases"]["0.19.0"][0]["digests"]["sha256"] = "0" * 64
    (up.index / "vllm" / "json").write_text(json.dumps(data))
    releases.clear_index_cache()
    res = proj.run("compat", "--versions", "0.19.0")
    assert res.code == 2
    assert "sha256 mismatch for vllm-0.19.0.tar.gz" in res.err
    assert not list((Path(os.environ["VMP_CACHE_DIR"])).glob("vllm-0.19.0*"))


def test_overlay_imports_resolution(tmp_path) -> None:
    dst = f"{OVERLAY_DST}/sub/mod.py"
    src = tmp_path / "mod.py"
    src.write_text(
        "from ...mooncake_connector import A\n"  # climbs out of ext/: upstream
        "from .. import config\n"  # ext/: ours
        "from ...hashsync.sync import B\n"  # the other overlay: ours
        "import json\n"
        "try:\n"
        "    from vllm.optional import C\n"
        "except ImportError:\n"
        "    C = None\n"
        "def f():\n"
        "    from vllm.v1.request import Request\n"
    )
    overlays = (
        upstream.Overlay("connector", OVERLAY_DST),
        upstream.Overlay("hashsync", OVERLAY_DST.rsplit("/", 1)[0] + "/hashsync"),
    )
    refs, errors = compat.overlay_imports({dst: src}, overlays, "vllm")
    assert errors == []
    got = {(r.module, r.name, r.guarded, r.line) for r in refs}
    assert got == {
        (CONNECTOR[:-3].replace("/", "."), "A", False, 1),
        ("vllm.optional", "C", True, 6),
        ("vllm.v1.request", "Request", False, 10),
    }


def test_defined_names() -> None:
    tree = ast.parse(
        "import os.path\nfrom x import y as z\nA, (B, C) = 1, (2, 3)\nD: int = 4\n"
        "if True:\n    def e(): pass\nelse:\n    class F: pass\n"
        "try:\n    G = 1\nexcept ImportError:\n    H = 2\n"
    )
    names, dynamic = compat_imports.defined_names(tree)
    assert names == {"os", "z", "A", "B", "C", "D", "e", "F", "G", "H"}
    assert not dynamic
    assert compat_imports.defined_names(ast.parse("def __getattr__(n): pass"))[1]
