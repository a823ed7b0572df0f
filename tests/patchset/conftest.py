"""Fixtures: a throw-away project around a small synthetic vLLM sdist.

Nothing here touches the network: the sdist is a tarball built in the test,
handed to ``build.py fetch`` through ``VMP_SDIST_URL``, and the cache lives in
the test's temp dir (``VMP_CACHE_DIR``).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_PY = REPO / "build.py"
sys.path.insert(0, str(REPO))

VERSION = "0.18.1"
TOP = f"vllm-{VERSION}"
OVERLAY_DST = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/ext"
HASHSYNC_DST = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/hashsync"


def numbered(prefix: str, n: int) -> str:
    return "".join(f"{prefix} line {i}\n" for i in range(1, n + 1))


UPSTREAM_FILES = {
    "PKG-INFO": f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n",
    "setup.py": "from setuptools import setup\n\nsetup()\n",
    "pyproject.toml": (
        '[build-system]\nrequires = ["setuptools", "setuptools-scm"]\n\n'
        '[project]\nname = "vllm"\ndynamic = ["version"]\n\n'
        '[tool.setuptools_scm]\nversion_file = "vllm/_version.py"\n'
    ),
    "vllm/__init__.py": '"""vLLM."""\n',
    "vllm/_version.py": f'__version__ = version = "{VERSION}"\n',
    "vllm/config.py": numbered("config", 40),
    "vllm/engine.py": numbered("engine", 30),
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": numbered("base", 20),
    "vllm/no_newline.py": "first\nlast without newline",
    "vllm.egg-info/SOURCES.txt": "setup.py\n",
}


def make_sdist(path: Path, files: dict[str, str]) -> str:
    """Write a deterministic ``vllm-0.18.1.tar.gz``; returns its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = {TOP}
        for name in files:
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                dirs.add(f"{TOP}/" + "/".join(parts[:i]))
        for d in sorted(dirs):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{TOP}/{name}")
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    import gzip

    path.write_bytes(gzip.compress(buf.getvalue(), mtime=0))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_text(sha: str, overlays: list[tuple[str, str]] | None = None) -> str:
    if overlays is None:
        overlays = [("connector", OVERLAY_DST), ("hashsync", HASHSYNC_DST)]
    text = (
        "[upstream]\n"
        'name = "vllm"\n'
        f'version = "{VERSION}"\n'
        f'sdist = "{TOP}.tar.gz"\n'
        f'sha256 = "{sha}"\n'
        'tree = "third_party/vllm"\n'
    )
    for src, dst in overlays:
        text += f'\n[[overlay]]\nsrc = "{src}"\ndst = "{dst}"\n'
    text += (
        '\n[artifacts]\nignore = ["__pycache__/", "*.py[cod]", "*.so", "/build/", '
        '"/.deps/", "/*.egg-info/", "/vllm/_version.py"]\n'
    )
    return text


def udiff(path: str, old: str, new: str, context: int = 3) -> str:
    """A ``diff --git`` style -p1 unified diff of one file."""
    old_lines = old.splitlines(True) if old else []
    new_lines = new.splitlines(True) if new else []
    src = f"a/{path}" if old else "/dev/null"
    dst = f"b/{path}" if new else "/dev/null"
    out = [f"diff --git a/{path} b/{path}\n"]
    if not old:
        out.append("new file mode 100644\n")
    if not new:
        out.append("deleted file mode 100644\n")
    for line in difflib.unified_diff(old_lines, new_lines, src, dst, n=context):
        if line.startswith(("---", "+++")):
            line = line.rstrip() + "\n"
        if not line.endswith("\n"):
            line += "\n\\ No newline at end of file\n"
        out.append(line)
    return "".join(out)


def patch_text(
    subject: str,
    diff: str,
    body: str = "Because the connector needs a hook here.",
    status: str | None = "Upstream-Status: Pending",
    author: str = "Test Author <author@example.com>",
) -> str:
    head = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
    if author:
        head += f"From: {author}\n"
    if subject is not None:
        head += f"Subject: [PATCH] {subject}\n"
    parts = [p for p in (body, status) if p]
    return (
        head + "\n" + "".join(p + "\n\n" for p in parts).rstrip("\n") + "\n---\n" + diff
    )


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def _load_build():
    spec = importlib.util.spec_from_file_location("build_cli", BUILD_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BUILD = _load_build()


class Project:
    """A temp project dir (patches/, connector/, hashsync/) and its sdist."""

    def __init__(self, base: Path, files: dict[str, str]) -> None:
        self.base = base
        self.root = base / "project"
        self.cache = base / "cache"
        self.source = base / "upstream" / f"{TOP}.tar.gz"
        self.upstream_files = dict(files)
        self.sha = make_sdist(self.source, files)
        (self.root / "patches").mkdir(parents=True)
        (self.root / "patches" / "upstream.toml").write_text(manifest_text(self.sha))
        (self.root / "patches" / "series").write_text("")
        for folder, files_ in {
            "connector": {"__init__.py": "", "store.py": "class Store:\n    pass\n"},
            "hashsync": {
                "__init__.py": "",
                "sub/__init__.py": "",
                "sub/sync.py": "X = 1\n",
            },
        }.items():
            for rel, text in files_.items():
                p = self.root / folder / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)

    @property
    def tree(self) -> Path:
        return self.root / "third_party" / "vllm"

    @property
    def git_dir(self) -> Path:
        return self.root / "third_party" / "vllm.git"

    def run(self, *args: str) -> Result:
        """Run build.py in-process (fast); returns exit code and output."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = _BUILD.main(["--root", str(self.root), *args])
            except SystemExit as exc:  # argparse errors
                code = exc.code
        return Result(code, out.getvalue(), err.getvalue())

    def run_cli(self, *args: str) -> Result:
        """Run build.py as a real subprocess."""
        proc = subprocess.run(
            [sys.executable, str(BUILD_PY), "--root", str(self.root), *args],
            capture_output=True,
            check=False,
            text=True,
            env=os.environ.copy(),
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def git(self, *args: str, check: bool = True) -> str:
        env = {
            **os.environ,
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": "Dev",
            "GIT_AUTHOR_EMAIL": "dev@example.com",
            "GIT_COMMITTER_NAME": "Dev",
            "GIT_COMMITTER_EMAIL": "dev@example.com",
        }
        proc = subprocess.run(
            ["git", f"--git-dir={self.git_dir}", f"--work-tree={self.tree}", *args],
            capture_output=True,
            check=False,
            text=True,
            env=env,
            cwd=self.tree,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"git {args} failed: {proc.stderr}")
        return proc.stdout.strip()

    def head(self) -> str:
        return self.git("rev-parse", "HEAD")

    def commits(self) -> list[str]:
        return self.git("log", "--format=%s", "vmp-pristine..HEAD").splitlines()[::-1]

    def write_patch(self, name: str, text: str) -> None:
        (self.root / "patches" / name).write_text(text)

    def set_series(self, *names: str) -> None:
        (self.root / "patches" / "series").write_text("".join(n + "\n" for n in names))

    def add_patch(self, name: str, text: str) -> None:
        self.write_patch(name, text)
        series = (self.root / "patches" / "series").read_text()
        (self.root / "patches" / "series").write_text(series + name + "\n")

    def edit_patch(self, path: str, new: str, old: str | None = None) -> str:
        """Diff text turning the upstream file (or ``old``) into ``new``."""
        base = self.upstream_files.get(path, "") if old is None else old
        return udiff(path, base, new)

    def snapshot(self, *folders: str) -> dict[str, bytes]:
        """Bytes of every file under the given project folders."""
        out = {}
        for folder in folders:
            for p in sorted((self.root / folder).rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts:
                    out[p.relative_to(self.root).as_posix()] = p.read_bytes()
        return out


@pytest.fixture
def project(tmp_path, monkeypatch) -> Project:
    proj = Project(tmp_path, UPSTREAM_FILES)
    monkeypatch.setenv("VMP_CACHE_DIR", str(proj.cache))
    monkeypatch.setenv("VMP_SDIST_URL", str(proj.source))
    monkeypatch.delenv("VMP_ROOT", raising=False)
    return proj


def replace_line(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)
