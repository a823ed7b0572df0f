"""``build.py check --release``: the grid over synthetic releases.

Everything is local: three synthetic sdists (0.18.1 = the pin, 0.19.0, 0.20.0)
behind a synthetic PyPI-JSON index (``VMP_INDEX_URL``), and a tmp git repo
whose tags hold the same trees, where the ``git log`` commands the check prints
for a conflict or a missing file are run to see that they name the commit that
caused it.
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

from patchset import releasecheck, releases, upstream
from patchset.overrides import OverlaySource
from patchset.pynames import top_level_names
from patchset.series import parse_patch

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
    "from typing_extensions import override\n\n"
    "from ..mooncake_connector import Worker\n\n\n"
    "class ExtWorker(Worker):\n"
    "    @override\n"
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
    """``check`` with ``args``: the result, and the report its --json run prints."""
    res = proj.run("check", *args)
    data = proj.run("check", *args, "--json")
    assert data.code == res.code, data.text
    return res, json.loads(data.out)


def statuses(report: dict) -> dict[str, list[str]]:
    return {
        v["version"]: [p["status"] for p in v["patches"]] for v in report["versions"]
    }


def problems(res: dict, kind: str) -> list[str]:
    return [p["message"] for p in res["problems"] if p["kind"] == kind]


def shell(repo: Path, command: str) -> str:
    """A ``git ...`` command the check printed, run in the upstream clone."""
    args = command.split()
    assert args[0] == "git", command
    return git(repo, *args[1:])


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
    res, report = run(proj, "--since", "0.18.1")
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
    assert v20["patches"][6]["after_failed_same_files"] == ["0004-p4.patch"]
    fuzz = v19["patches"][2]["files"][0]
    assert fuzz["hunks"][0]["fuzz"] == 1 and "note" not in fuzz
    (collision,) = problems(v19, "overlay")
    assert f"connector/store.py -> {OVERLAY_DST}/store.py collides" in collision
    imports = {(i["module"], i["name"]): i["status"] for i in v20["imports"]}
    assert imports[("vllm.base", "helper")] == "name missing"
    assert imports[("vllm.base", "Thing")] == "ok"
    assert imports[(CONNECTOR[:-3].replace("/", "."), "Hook")] == "ok"  # relative
    assert not any(m.endswith(".ext") or ".ext." in m for m, _ in imports)  # ours
    assert {i["status"] for i in v19["imports"]} == {"ok"}
    assert problems(v20, "import") == [
        "connector/store.py:1: `from vllm.base import helper`: name missing"
    ]

    # The conflict names the hunk (numbered on the pin with 0001 applied) and the
    # git log of its lines on 0.20.0 (pristine numbering), which names the commit
    # that changed them, not the unrelated one that touched the same file.
    hunk = v20["patches"][3]["files"][0]["hunks"][0]
    assert hunk["result"] == "conflict" and hunk["header"].startswith("@@ -14,7 ")
    assert hunk["git_log"] == "git log -L 12,18:vllm/d.py v0.18.1..v0.20.0"
    log = shell(up.repo, hunk["git_log"])
    assert "Rename d line 15" in log and "Unrelated" not in log, log
    assert f"`{hunk['git_log']}`" in problems(v20, "apply")[0]
    # A missing file: the commit that removed it.
    (gone,) = problems(v19, "apply")
    assert gone.startswith("0006-p6.patch: vllm/old/f.py is gone"), gone
    command = gone.split("`")[1]
    assert shell(up.repo, command).split(" ", 1)[1] == (
        "Rework b, c, e; move f to new/; add ext/store.py"
    )

    # The grid: one row per version, codes from the legend; each problem once,
    # from the first release it shows on.
    rows = {
        line.split()[0]: line.split()
        for line in res.out.splitlines()
        if line[:1].isdigit()
    }
    assert rows["0.19.0"][1:11] == [".", "o", "f", ".", "U", "M", ".", "1", ".", "."]
    assert rows["0.20.0"][1:11] == [".", "o", "f", "C", "U", "M", "f*", "1", "1", "2"]
    applies = " ".join(rows["0.20.0"][11:])
    assert (
        applies == "4/7 (1 exact, 1 offset, 2 fuzz, 1 upstream, 1 conflict, 1 missing)"
    )
    assert "  0.19.0: 0006-p6.patch: vllm/old/f.py is gone" in res.out
    assert res.out.count("vllm/old/f.py is gone") == 1
    assert "  0.20.0: 0004-p4.patch: vllm/d.py hunk 1 (@@ -14,7 " in res.out
    assert "[2/2] 0.20.0:" in res.err


def test_grid_reports_an_override_upstream_renamed(world) -> None:
    _, proj = world
    res, report = run(proj, "--since", "0.18.1")
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
    assert (missing["kind"], missing["where"], missing["name"]) == (
        "override-missing",
        "connector/worker.py:8",
        "get_finished",
    )
    assert "(in vllm 0.20.0): our override is never called" in missing["message"]
    assert (call["kind"], call["where"]) == ("super-missing", "connector/worker.py:9")
    assert len(problems(v20, "override")) == 2
    assert "ovr" in res.out.splitlines()[1]
    assert (
        "  0.20.0: override-missing: connector/worker.py:8: ExtWorker.get_finished: "
        in res.out
    )


def test_release_and_versions_options(world, monkeypatch) -> None:
    _, proj = world
    res, report = run(proj, "--release", "0.20.0")
    assert [v["version"] for v in report["versions"]] == ["0.20.0"]
    assert "copying vllm-0.20.0.tar.gz" in res.err
    assert res.code == 1 and "vllm/d.py hunk 1" in res.out
    res, report = run(proj, "--versions", "0.20.0,0.19.0,0.20.0")
    assert [v["version"] for v in report["versions"]] == ["0.19.0", "0.20.0"]
    assert "copying vllm-0.20.0" not in res.err  # cached by the first run

    # A warm cache needs no index (the digest verified at download is recorded).
    monkeypatch.setenv("VMP_INDEX_URL", str(proj.base / "nowhere"))
    releases.clear_index_cache()
    res = proj.run("check", "--release", "0.20.0")
    assert res.code == 1 and "index unavailable" in res.err, res.text


def test_no_newer_release_is_not_a_problem(world) -> None:
    _, proj = world
    res = proj.run("check", "--since", "0.20.0")
    assert res.code == 0, res.text
    assert "check: no vllm release newer than 0.20.0" in res.out


def test_compat_is_the_old_name_of_check_since(world) -> None:
    _, proj = world
    res = proj.run("compat")
    assert res.code == 1, res.text
    assert res.err.splitlines()[0] == (
        "compat is now `check --release V` (or --since V, --versions A,B): "
        "running `python build.py check --since 0.18.1`"
    )
    assert res.out == proj.run("check", "--since", "0.18.1").out
    res = proj.run("compat", "--versions", "0.19.0", "--json")
    assert "running `python build.py check --versions 0.19.0`" in res.err
    assert [v["version"] for v in json.loads(res.out)["versions"]] == ["0.19.0"]


def test_sha256_mismatch_is_refused(world) -> None:
    up, proj = world
    data = json.loads((up.index / "vllm" / "json").read_text())
    data["releases"]["0.19.0"][0]["digests"]["sha256"] = "0" * 64
    (up.index / "vllm" / "json").write_text(json.dumps(data))
    releases.clear_index_cache()
    res = proj.run("check", "--release", "0.19.0")
    assert res.code == 2
    assert "sha256 mismatch for vllm-0.19.0.tar.gz" in res.err
    assert not list((Path(os.environ["VMP_CACHE_DIR"])).glob("vllm-0.19.0*"))


PATH = "vllm/x.py"
PIN = numbered("x", 30)
FIX = change({PATH: PIN}, PATH, "x line 10\n", "x line 10 fixed\n")[PATH]


def verdict(release: str) -> str:
    """GNU patch's verdict on a patch of x.py (PIN -> FIX) on a release's x.py."""
    text = patch_text("Fix x line 10", udiff(PATH, PIN, FIX))
    tree = releasecheck.Release({PATH}, {PATH: release.encode()})
    return releasecheck.check_patch(parse_patch("0001-fix.patch", text.encode()), tree)


def test_a_patch_the_release_has_is_upstream_and_left_as_the_release_has_it() -> None:
    assert verdict(PIN)["status"] == "exact"
    row = verdict(FIX)
    assert row["status"] == "upstream", row
    # the release reworded the line above: the patch neither applies nor reverses
    moved_on = change({PATH: FIX}, PATH, "x line 9\n", "x line nine\n")[PATH]
    assert verdict(moved_on)["status"] == "conflict"
    elsewhere = change({PATH: PIN}, PATH, "x line 10\n", "x line ten\n")[PATH]
    assert verdict(elsewhere)["status"] == "conflict"
    shifted = numbered("new", 4) + PIN
    row = verdict(shifted)
    assert row["status"] == "offset" and row["files"][0]["hunks"][0]["offset"] == 4


def test_release_lines_maps_a_hunk_onto_the_release() -> None:
    old = numbered("a", 10)
    new = numbered("new", 2) + old.replace("a line 5\n", "five\n")
    assert releasecheck.release_lines(old, new, 4, 3) == (6, 8)
    gone = numbered("a", 3) + numbered("a", 10)[len(numbered("a", 6)) :]
    assert releasecheck.release_lines(old, gone, 5, 2) == (3, 4)
    rewritten = numbered("a", 3) + numbered("new", 5) + old[len(numbered("a", 7)) :]
    assert releasecheck.release_lines(old, rewritten, 5, 1) == (4, 8)  # the rewrite


def test_overlay_imports(tmp_path) -> None:
    dst = f"{OVERLAY_DST}/sub/mod.py"
    text = (
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
        "import vllm.v1\n"
    )
    manifest = upstream.Manifest(
        "vllm",
        "0.18.1",
        "vllm-0.18.1.tar.gz",
        "0" * 64,
        "third_party/vllm",
        (
            upstream.Overlay("connector", OVERLAY_DST),
            upstream.Overlay("hashsync", OVERLAY_DST.rsplit("/", 1)[0] + "/hashsync"),
        ),
    )
    source = OverlaySource("connector/sub/mod.py", dst, text)
    assert releasecheck.overlay_imports([source], manifest) == {
        (CONNECTOR[:-3].replace("/", "."), "A"): ["connector/sub/mod.py:1"],
        ("vllm.optional", "C"): ["connector/sub/mod.py:6"],
        ("vllm.v1.request", "Request"): ["connector/sub/mod.py:10"],
        ("vllm.v1", None): ["connector/sub/mod.py:11"],
    }


def test_import_status() -> None:
    tree = releasecheck.Release(
        {"vllm/a.py", "vllm/b/__init__.py", "vllm/b/c.py", "vllm/d.py", "vllm/e.py"},
        {
            "vllm/a.py": b"X = 1\n",
            "vllm/b/__init__.py": b"",
            "vllm/d.py": b"def __getattr__(n): pass\n",
            "vllm/e.py": b"def (\n",
        },
    )
    status = releasecheck.import_status
    assert status("vllm.a", "X", tree) == ("ok", "")
    assert status("vllm.a", "Y", tree) == ("name missing", "")
    assert status("vllm.b", "c", tree) == ("ok", "")  # a submodule
    assert status("vllm.b", None, tree) == ("ok", "")
    assert status("vllm.gone", "X", tree) == ("module missing", "")
    assert status("vllm.d", "Y", tree)[0] == "unverifiable"
    assert status("vllm.e", "Y", tree)[0] == "unverifiable"


def test_top_level_names() -> None:
    tree = ast.parse(
        "import os.path\nfrom x import y as z\nA, (B, C) = 1, (2, 3)\nD: int = 4\n"
        "if True:\n    def e(): pass\nelse:\n    class F: pass\n"
        "try:\n    G = 1\nexcept ImportError:\n    H = 2\n"
    )
    names = top_level_names(tree)
    assert set(names.lines) == {"os", "z", "A", "B", "C", "D", "e", "F", "G", "H"}
    assert not names.dynamic
    assert top_level_names(ast.parse("def __getattr__(n): pass")).dynamic
