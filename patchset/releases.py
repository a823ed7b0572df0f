"""Upstream releases on a package index: which versions, their sdists, downloads
(the pinned sdist's too: :func:`fetch`).

The index is read through the PyPI JSON API (``<index>/<name>/json``). Every
sdist is cached in the same directory as the pinned one
(``upstream.cache_dir()``, ``$VMP_CACHE_DIR``), under its own file name, and
only ever after its sha256 matched the digest the index publishes: downloads go
to a temporary name in that directory and are moved into place once verified.
Next to each cached sdist, ``<file>.sha256`` records the index digest it was
verified against, so a warm cache works without the index.

``VMP_INDEX_URL`` replaces ``https://pypi.org/pypi``: an ``http(s)://`` or
``file://`` URL, a local directory laid out like the JSON API
(``<dir>/<name>/json``) or a single JSON file. Download URLs are resolved
relative to the JSON document (mirrors give relative ones), so a local index
may point at sdists next to it and tests never touch the network.

Project-agnostic: nothing here knows about patches or vLLM.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .errors import PatchsetError, ProblemsFound
from .upstream import (
    SOURCE_ENV,
    TIMEOUT_S,
    Manifest,
    Say,
    Sha256Mismatch,
    cache_dir,
    cache_verified,
    cached_sdist,
    copy_url,
    read_within_deadline,
    sha256_file,
)

INDEX_ENV = "VMP_INDEX_URL"
DEFAULT_INDEX = "https://pypi.org/pypi"


class ReleaseError(PatchsetError):
    """The index could not be read, or a release has no usable sdist."""


def index_location(name: str) -> str:
    """Where the index JSON of ``name`` is read from (URL or local path)."""
    base = os.environ.get(INDEX_ENV) or DEFAULT_INDEX
    parsed = urllib.parse.urlparse(base)
    if parsed.scheme in ("http", "https"):
        return f"{base.rstrip('/')}/{name}/json"
    path = Path(urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else base)
    return str(path / name / "json" if path.is_dir() else path)


@functools.lru_cache(maxsize=8)
def _index_json(location: str) -> dict:
    try:
        if location.startswith(("http://", "https://")):
            with urllib.request.urlopen(location, timeout=TIMEOUT_S) as resp:
                buf = io.BytesIO()
                read_within_deadline(resp, buf)
                data = buf.getvalue()
        else:
            data = Path(location).read_bytes()
        return json.loads(data)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise ReleaseError(
            f"cannot read the package index {location}: {exc}. Check the network, "
            f"or point {INDEX_ENV} at a reachable index (URL, directory or JSON file)"
        ) from exc


def index(name: str = "vllm") -> dict:
    """The index's JSON for ``name`` (read once per process)."""
    return _index_json(index_location(name))


def clear_index_cache() -> None:
    _index_json.cache_clear()


def _sdists(files: list[dict]) -> list[dict]:
    return [f for f in files if f.get("packagetype") == "sdist" and not f.get("yanked")]


def list_versions(name: str = "vllm", since: str | None = None) -> list[str]:
    """Final releases on the index with an sdist, sorted; only newer than ``since``."""
    releases = index(name).get("releases") or {}
    floor = Version(since) if since else None
    found: list[Version] = []
    for text, files in releases.items():
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if version.is_prerelease or version.is_devrelease or version.local:
            continue
        if floor is not None and version <= floor:
            continue
        if _sdists(files or []):
            found.append(version)
    return [str(v) for v in sorted(found)]


def sdist_info(
    version: str, name: str = "vllm", filename: str | None = None
) -> tuple[str, str, str]:
    """(file name, download URL, sha256) of the release's sdist, from the index.

    ``filename`` picks that file (the pinned one); else the ``.tar.gz``.
    """
    files = (index(name).get("releases") or {}).get(version)
    if files is None:
        raise ReleaseError(
            f"{name} {version} is not on the index {index_location(name)}; "
            f"known final releases: {', '.join(list_versions(name)[-8:]) or 'none'}"
        )
    sdists = _sdists(files)
    if not sdists:
        raise ReleaseError(
            f"{name} {version} has no (unyanked) sdist on {index_location(name)}"
        )
    if filename is not None:
        named = [f for f in sdists if Path(f["filename"]).name == filename]
        if not named:
            raise ReleaseError(
                f"{name} {version} on {index_location(name)} has no sdist {filename} "
                f"(it has {', '.join(f['filename'] for f in sdists)})"
            )
        sdists = named
    # Prefer the .tar.gz the pinned sdist also is.
    sdists.sort(key=lambda f: not f["filename"].endswith(".tar.gz"))
    f = sdists[0]
    # Mirrors give URLs relative to the JSON document.
    url = urllib.parse.urljoin(_as_url(index_location(name)), f["url"])
    sha = (f.get("digests") or {}).get("sha256")
    if not sha:
        raise ReleaseError(
            f"the index gives no sha256 for {f['filename']}; refusing an unverifiable download"
        )
    # the name becomes a path in the cache: never take a folder from the index
    return Path(f["filename"]).name, url, sha.lower()


def _normalized(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 503/427)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_files(version: str, name: str) -> dict[str, str]:
    """{file name: sha256} of the release's (unyanked) wheels on the index.

    Empty when the release, or any wheel of it, is not there. Only files whose
    name is ``name``'s own (an index location that is a single JSON file
    answers for every name) and that carry a sha256 digest count: a pin
    needs one.
    """
    files = (index(name).get("releases") or {}).get(version) or []
    out: dict[str, str] = {}
    for f in files:
        filename = Path(f.get("filename") or "").name
        sha = (f.get("digests") or {}).get("sha256")
        if (
            f.get("packagetype") == "bdist_wheel"
            and not f.get("yanked")
            and filename.endswith(".whl")
            and _normalized(filename.split("-", 1)[0]) == _normalized(name)
            and sha
        ):
            out[filename] = sha.lower()
    return out


def _as_url(location: str) -> str:
    if location.startswith(("http://", "https://")):
        return location
    return Path(location).resolve().as_uri()


def _recorded_sha(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def fetch_release(
    version: str, say: Say = print, name: str = "vllm"
) -> tuple[Path, str]:
    """The verified sdist of ``name`` ``version`` in the cache, and its sha256.

    A cached file is reused when its sha256 equals the index digest (or, with
    the index unreachable, the digest recorded when it was verified).
    """
    try:
        filename, url, sha = sdist_info(version, name)
    except ReleaseError as exc:
        filename = f"{name}-{version}.tar.gz"
        target = cache_dir() / filename
        recorded = _recorded_sha(target)
        if target.is_file() and recorded.is_file():
            sha = recorded.read_text().strip()
            if sha256_file(target) == sha:
                say(f"index unavailable ({exc}); using {target} (sha256 recorded)")
                return target, sha
        raise
    target = cache_dir() / filename
    if cache_verified(
        target,
        sha,
        lambda dest: download(url, dest, say),
        lambda _, actual: ReleaseError(
            f"sha256 mismatch for {filename} from {url}:\n"
            f"  expected (index): {sha}\n  actual:           {actual}\n"
            "refusing it; nothing was cached"
        ),
        lambda aside, _: say(
            f"cached {target} does not match the index sha256; moved it aside to "
            f"{aside} (kept to look at) and fetching it again"
        ),
    ):
        say(f"{filename} cached (sha256 verified)")
    else:
        say(f"{filename} verified (sha256 {sha[:12]}...) and cached")
    _recorded_sha(target).write_text(sha + "\n")
    return target, sha


def download(url: str, dest: Path, say: Say) -> str:
    """Copy ``url`` (http(s), file:// or a path) to ``dest``; no checks; return it."""
    try:
        return copy_url(url, dest, say)
    except OSError as exc:
        raise ReleaseError(f"could not download {url}: {exc}") from exc


# -- the pinned sdist --------------------------------------------------------


def fetch(manifest: Manifest, say: Say = print) -> Path:
    """Make sure the verified sdist is in the cache; return its path."""
    target, pin = cached_sdist(manifest), manifest.sha256
    if cache_verified(
        target,
        pin,
        lambda dest: _download(manifest, dest, say),
        lambda origin, actual: Sha256Mismatch(target, pin, actual, origin),
        lambda aside, actual: say(
            f"fetch: cached {target} has sha256 {actual}, not {pin}; "
            f"moved it aside to {aside} (kept to look at) and fetching again"
        ),
    ):
        say(
            f"fetch: {target.name} is cached at {target} (sha256 verified); no download"
        )
    else:
        say(f"fetch: verified sha256 {pin}; cached at {target}")
    return target


def _download(manifest: Manifest, dest: Path, say: Say) -> str:
    """The sdist into dest (no pip, nothing built); where it came from.

    From ``$VMP_SDIST_URL``, else the index's file, whose digest must be the
    pin before anything is downloaded.
    """
    source = os.environ.get(SOURCE_ENV)
    if source:
        say(f"fetch: copying {manifest.sdist} from {source} ({SOURCE_ENV})")
        try:
            return copy_url(source, dest, lambda _: None)
        except OSError as exc:
            raise PatchsetError(
                f"could not get the sdist from {source} ({SOURCE_ENV}): {exc}"
            ) from exc
    _, url, sha = sdist_info(manifest.version, manifest.name, filename=manifest.sdist)
    if sha != manifest.sha256:
        raise ProblemsFound(
            f"the package index ({index_location(manifest.name)}) gives "
            f"sha256 {sha} for {manifest.sdist}, not the pinned {manifest.sha256} "
            "(patches/upstream.toml); refusing it, nothing was downloaded. If "
            "upstream really re-released the sdist, review the change and update "
            "sha256 in patches/upstream.toml"
        )
    say(f"fetch: downloading {manifest.sdist} from {url}")
    return download(url, dest, say)
