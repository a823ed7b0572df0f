"""The pinned upstream: manifest, sdist cache, sha256 check, unpacking.

The sdist is cached OUTSIDE the work tree, in ``$VMP_CACHE_DIR`` or
``${XDG_CACHE_HOME:-~/.cache}/vllm-mooncake-patches/sdist/``. A cached file is
only ever one whose sha256 matched the manifest: downloads go to a temporary
name and are moved into place after verification. A cached file that no
longer matches is moved aside (``<name>.corrupt-<sha256 prefix>``), never
deleted, so what was wrong with it can still be looked at.

The sdist is the package index's own file (``releases``: the URL and digest
from the index's JSON, as ``compat`` downloads releases), never built or
unpacked by pip: pip would build the sdist's metadata, which needs torch.
``VMP_SDIST_URL`` (a local path, ``file://`` or ``http(s)://`` URL) replaces
the index; tests use it, or a local ``VMP_INDEX_URL``, with a synthetic
tarball, so they never touch the network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import tomllib

from .errors import PatchsetError, ProblemsFound

CACHE_ENV = "VMP_CACHE_DIR"
SOURCE_ENV = "VMP_SDIST_URL"

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
    if path.is_file() and sha256_file(path) == manifest.sha256:
        return path
    return None


def fetch(manifest: Manifest, say: Callable[[str], None] = print) -> Path:
    """Make sure the verified sdist is in the cache; return its path."""
    target = cached_sdist(manifest)
    if target.is_file():
        actual = sha256_file(target)
        if actual == manifest.sha256:
            say(
                f"fetch: {target.name} is cached at {target} (sha256 verified); no download"
            )
            return target
        aside = set_aside(target, actual)
        say(
            f"fetch: cached {target} has sha256 {actual}, not {manifest.sha256}; "
            f"moved it aside to {aside} (kept to look at) and fetching again"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        tmpdir = Path(tmp)
        source = os.environ.get(SOURCE_ENV)
        if source:
            say(f"fetch: copying {manifest.sdist} from {source} ({SOURCE_ENV})")
            got = _copy_source(source, tmpdir / manifest.sdist)
            origin = source
        else:
            got, origin = _index_download(manifest, tmpdir, say)
        actual = sha256_file(got)
        if actual != manifest.sha256:
            raise Sha256Mismatch(got, manifest.sha256, actual, origin)
        os.replace(got, target)
    say(f"fetch: verified sha256 {manifest.sha256}; cached at {target}")
    return target


def _copy_source(source: str, dest: Path) -> Path:
    parsed = urllib.parse.urlparse(source)
    try:
        if parsed.scheme in ("http", "https"):
            with (
                urllib.request.urlopen(source, timeout=120) as resp,
                dest.open("wb") as f,
            ):
                shutil.copyfileobj(resp, f)
        else:
            path = Path(
                urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else source
            )
            shutil.copyfile(path, dest)
    except OSError as exc:
        raise PatchsetError(
            f"could not get the sdist from {source} ({SOURCE_ENV}): {exc}"
        ) from exc
    return dest


def set_aside(path: Path, actual: str) -> Path:
    """Move a cached file that failed its sha256 check out of the way, keeping it.

    It stays in the same folder as ``<name>.corrupt-<first 12 digits of its
    sha256>``, where nothing reads it, so the evidence survives the re-fetch.
    """
    aside = path.with_name(f"{path.name}.corrupt-{actual[:12]}")
    os.replace(path, aside)
    return aside


def _index_download(
    manifest: Manifest, dest: Path, say: Callable[[str], None]
) -> tuple[Path, str]:
    """The index's sdist file into dest (no pip, nothing built); (path, URL).

    The index's digest must be the pin before anything is downloaded.
    """
    from . import releases  # releases reads this module's cache settings

    _, url, sha = releases.sdist_info(
        manifest.version, manifest.name, filename=manifest.sdist
    )
    if sha != manifest.sha256:
        raise ProblemsFound(
            f"the package index ({releases.index_location(manifest.name)}) gives "
            f"sha256 {sha} for {manifest.sdist}, not the pinned {manifest.sha256} "
            "(patches/upstream.toml); refusing it, nothing was downloaded. If "
            "upstream really re-released the sdist, review the change and update "
            "sha256 in patches/upstream.toml"
        )
    say(f"fetch: downloading {manifest.sdist} from {url}")
    got = dest / manifest.sdist
    releases.download(url, got, say)
    return got, url


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
    sdist: Path, manifest: Manifest, wanted: set[str]
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
