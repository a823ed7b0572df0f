"""The pinned upstream: manifest, sdist cache, sha256 check, unpacking.

The sdist is cached OUTSIDE the work tree, in ``$VMP_CACHE_DIR`` or
``${XDG_CACHE_HOME:-~/.cache}/vllm-mooncake-patches/sdist/``. A cached file is
only ever one whose sha256 matched the manifest: downloads go to a temporary
name and are moved into place after verification. A cached file that no
longer matches is moved aside (``<name>.corrupt-<sha256 prefix>``), never
deleted, so what was wrong with it can still be looked at.

The sdist is the package index's own file (``releases.fetch`` downloads it: the
URL and digest from the index's JSON, as ``check --release`` downloads releases), never built or
unpacked by pip: pip would build the sdist's metadata, which needs torch.
``VMP_SDIST_URL`` (a local path, ``file://`` or ``http(s)://`` URL) replaces
the index; tests use it, or a local ``VMP_INDEX_URL``, with a synthetic
tarball, so they never touch the network.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import tomllib

from .errors import PatchsetError, ProblemsFound

CACHE_ENV = "VMP_CACHE_DIR"
SOURCE_ENV = "VMP_SDIST_URL"
TIMEOUT_S = 120  # seconds any network wait may take
DOWNLOAD_DEADLINE_S = 1800  # a whole download (one read may add TIMEOUT_S)

Say = Callable[[str], None]

# Written to the tree's git dir ``info/exclude`` when the manifest has no
# ``[artifacts] ignore``: what ``pip install -e`` and precompiled kernels
# put inside the tree. Never counted as edits; kept by reset.
DEFAULT_ARTIFACTS = [
    "__pycache__/",
    "*.py[cod]",
    "*.so",
    "/build/",
    "/dist/",
    "/.deps/",
    "/*.egg-info/",
]


@dataclass(frozen=True)
class Overlay:
    src: str  # folder in the repo
    dst: str  # folder inside the tree, relative to its root


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    sdist: str
    sha256: str
    tree: str
    overlays: tuple[Overlay, ...] = ()
    artifacts: tuple[str, ...] = tuple(DEFAULT_ARTIFACTS)
    path: Path | None = field(default=None, compare=False)

    @property
    def top_dir(self) -> str:
        """The single top directory of the sdist (``vllm-0.18.1``)."""
        return f"{self.name}-{self.version}"


class Sha256Mismatch(ProblemsFound):
    def __init__(self, path: Path, expected: str, actual: str, origin: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"sha256 mismatch for {path.name} from {origin}:\n"
            f"  expected (patches/upstream.toml): {expected}\n"
            f"  actual:                           {actual}\n"
            "refusing it; the file was not cached. If upstream really re-released "
            "the sdist, review the change and update sha256 in patches/upstream.toml"
        )


def load_manifest(path: Path) -> Manifest:
    """Read and validate ``patches/upstream.toml``; errors name the key."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise PatchsetError(f"manifest {path} not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PatchsetError(f"manifest {path} is not valid TOML: {exc}") from exc
    up = data.get("upstream")
    if not isinstance(up, dict):
        raise PatchsetError(f"manifest {path}: missing [upstream] table")
    values = {}
    for key in ("name", "version", "sdist", "sha256", "tree"):
        value = up.get(key)
        if not isinstance(value, str) or not value:
            raise PatchsetError(
                f"manifest {path}: [upstream] {key} must be a non-empty string"
            )
        values[key] = value
    sha = values["sha256"].lower()
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise PatchsetError(
            f"manifest {path}: [upstream] sha256 is not a 64-digit hex sha256"
        )
    values["sha256"] = sha
    _require_relative(path, "[upstream] tree", values["tree"])
    overlays = []
    for i, item in enumerate(data.get("overlay", [])):
        if not isinstance(item, dict) or not all(
            isinstance(item.get(k), str) and item.get(k) for k in ("src", "dst")
        ):
            raise PatchsetError(
                f"manifest {path}: [[overlay]] #{i + 1} needs src and dst strings"
            )
        _require_relative(path, f"[[overlay]] #{i + 1} src", item["src"])
        _require_relative(path, f"[[overlay]] #{i + 1} dst", item["dst"])
        overlays.append(Overlay(item["src"].strip("/"), item["dst"].strip("/")))
    artifacts = data.get("artifacts", {}).get("ignore", DEFAULT_ARTIFACTS)
    if not isinstance(artifacts, list) or not all(
        isinstance(a, str) for a in artifacts
    ):
        raise PatchsetError(
            f"manifest {path}: [artifacts] ignore must be a list of strings"
        )
    return Manifest(
        overlays=tuple(overlays), artifacts=tuple(artifacts), path=path, **values
    )


def _require_relative(path: Path, what: str, value: str) -> None:
    p = PurePosixPath(value)
    if p.is_absolute() or ".." in p.parts:
        raise PatchsetError(
            f"manifest {path}: {what} must be a relative path inside the project"
        )


# -- cache and fetch --------------------------------------------------------


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-mooncake-patches" / "sdist"


def cached_sdist(manifest: Manifest) -> Path:
    return cache_dir() / manifest.sdist


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verified_cached_sdist(manifest: Manifest) -> Path | None:
    """The cached sdist if present and its sha256 matches, else None."""
    path = cached_sdist(manifest)
    return path if path.is_file() and sha256_file(path) == manifest.sha256 else None


def reuse_cached(path: Path, sha256: str, moved: Callable[[Path, str], None]) -> bool:
    """Whether ``path`` has that sha256; a bad file there is set aside, ``moved`` told."""
    if not path.is_file():
        return False
    actual = sha256_file(path)
    if actual == sha256:
        return True
    aside = path.with_name(f"{path.name}.corrupt-{actual[:12]}")
    os.replace(path, aside)
    moved(aside, actual)
    return False


def cache_verified(
    target: Path,
    sha256: str,
    get: Callable[[Path], str],
    mismatch: Callable[[str, str], Exception],
    moved: Callable[[Path, str], None],
) -> bool:
    """Make sure ``target`` has that sha256; True if it had (:func:`reuse_cached`).

    Else ``get(tmp)`` writes the file to a temporary name next to it and returns
    where it came from; it is moved into place once verified, else
    ``mismatch(where it came from, its sha256)`` is raised.
    """
    if reuse_cached(target, sha256, moved):
        return True
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        got = Path(tmp) / target.name
        origin = get(got)
        actual = sha256_file(got)
        if actual != sha256:
            raise mismatch(origin, actual)
        os.replace(got, target)
    return False


def read_within_deadline(resp: http.client.HTTPResponse, out: BinaryIO) -> None:
    """Copy an HTTP response to ``out`` as it comes; TimeoutError once the whole of
    it took longer than DOWNLOAD_DEADLINE_S."""
    deadline = time.monotonic() + DOWNLOAD_DEADLINE_S
    while chunk := resp.read1(1 << 20):
        out.write(chunk)
        if time.monotonic() > deadline:
            raise TimeoutError(f"not finished after {DOWNLOAD_DEADLINE_S} s (stopped)")


def copy_url(source: str, dest: Path, say: Say) -> str:
    """Copy ``source`` (http(s) or file:// URL, or a path) to ``dest``; return it."""
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme in ("http", "https"):
        with urllib.request.urlopen(source, timeout=TIMEOUT_S) as resp:
            size = resp.headers.get("Content-Length")
            mb = (
                f"{int(size) / 1e6:.0f} MB"
                if size and size.isdigit()
                else "size unknown"
            )
            say(f"downloading {dest.name} ({mb}) ...")
            with dest.open("wb") as f:
                read_within_deadline(resp, f)
    else:
        path = Path(
            urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else source
        )
        say(f"copying {dest.name} from {path} ...")
        shutil.copyfile(path, dest)
    return source


# -- the tarball ------------------------------------------------------------


def _member_path(manifest: Manifest, name: str) -> str | None:
    """Tree-relative path of a tar member, or None for the top dir itself."""
    parts = PurePosixPath(name).parts
    if not parts or parts[0] != manifest.top_dir:
        raise PatchsetError(
            f"{manifest.sdist}: member {name!r} is not under {manifest.top_dir}/; "
            "is this the right sdist?"
        )
    rest = parts[1:]
    return "/".join(rest) if rest else None


def read_tarball(
    sdist: Path, manifest: Manifest, wanted: Container[str]
) -> tuple[set[str], dict[str, bytes]]:
    """One pass over the tarball: all member file paths, and the wanted files' bytes."""
    members: set[str] = set()
    contents: dict[str, bytes] = {}
    try:
        with tarfile.open(sdist, "r:*") as tar:
            for info in tar:
                path = _member_path(manifest, info.name)
                if path is None or info.isdir():
                    continue
                members.add(path)
                if path in wanted and info.isfile():
                    f = tar.extractfile(info)
                    if f is not None:
                        contents[path] = f.read()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise _unreadable(sdist, exc) from exc
    return members, contents


def _unreadable(sdist: Path, exc: Exception) -> PatchsetError:
    return PatchsetError(
        f"cannot read {sdist}: {exc}. Delete it and run `python build.py fetch`"
    )


def unpack(sdist: Path, manifest: Manifest, dest: Path) -> None:
    """Unpack the sdist into dest, dropping its single top directory."""
    if dest.exists():
        raise PatchsetError(f"{dest} already exists; refusing to unpack over it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".unpack-", dir=dest.parent) as tmp:
        try:
            with tarfile.open(sdist, "r:*") as tar:
                for info in tar.getmembers():
                    _member_path(manifest, info.name)  # validates the layout
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise _unreadable(sdist, exc) from exc
        top = Path(tmp) / manifest.top_dir
        if not top.is_dir():
            raise PatchsetError(f"{sdist} has no top directory {manifest.top_dir}/")
        os.replace(top, dest)
