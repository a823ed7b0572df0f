"""The index of supported releases, ``releases.toml`` at the project root (its
comments say what each key means): read by build.py (``--vllm V``) and by
harness/vllm_series.py, which scripts/setup.sh and scripts/test.sh run with the
system's python3 before any virtualenv exists, so this module needs the standard
library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

import tomllib

from .errors import PatchsetError

RELEASES = "releases.toml"
MANIFEST = "upstream.toml"  # in each patch folder: what its series pins
TESTED, CHECKED = "tested", "checked"
FINAL_RELEASE = re.compile(r"\d+\.\d+\.\d+")  # supported releases are final ones


@dataclass(frozen=True)
class Release:
    """One table of releases.toml."""

    version: str
    patches: str  # its patch folder, relative to the root
    status: str  # TESTED or CHECKED
    pinned: bool = False
    requirements: str | None = None  # TESTED only
    venv: str | None = None  # TESTED only
    # CHECKED only: the release whose series this one is verified against
    # (`build.py range-diff --expected`: the deltas in <patches>/range-diff.expected)
    against: str | None = None


def read(root: Path) -> dict[str, Release]:
    """releases.toml of ``root``, checked: every key known, one pinned release (a
    tested one), a tested release names its requirements and virtualenv, and each
    patch folder's upstream.toml pins the version its table names."""
    try:
        tables = tomllib.loads((root / RELEASES).read_text()).get("release", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PatchsetError(
            f"{RELEASES}: cannot read the release index: {exc}"
        ) from exc
    known = {f.name for f in fields(Release)} - {"version"}
    index: dict[str, Release] = {}
    for version, table in tables.items():
        try:
            if not FINAL_RELEASE.fullmatch(version):
                raise ValueError("not a final release version (like 0.32.0)")
            if unknown := set(table) - known:
                raise ValueError(f"unknown keys {sorted(unknown)}")
            release = Release(version, **table)
            if release.status not in (TESTED, CHECKED):
                raise ValueError(
                    f"status {release.status!r} is not {TESTED!r} or {CHECKED!r}"
                )
            if release.status == TESTED and not (release.requirements and release.venv):
                raise ValueError("a tested release names its requirements and venv")
            if release.against is not None and release.against not in tables:
                raise ValueError(f"against {release.against!r}: not a release here")
            manifest = root / release.patches / MANIFEST
            pins = tomllib.loads(manifest.read_text())["upstream"]["version"]
            if pins != version:
                raise ValueError(f"{release.patches}/{MANIFEST} pins vLLM {pins}")
        except (TypeError, ValueError, OSError, KeyError) as exc:
            raise PatchsetError(f'{RELEASES}, [release."{version}"]: {exc}') from exc
        index[version] = release
    pinned = [r.version for r in index.values() if r.pinned]
    if len(pinned) != 1 or index[pinned[0]].status != TESTED:
        raise PatchsetError(
            f"{RELEASES}: exactly one release is pinned = true, a tested one "
            f"(pinned: {pinned})"
        )
    return index


def patches_of(root: Path, version: str) -> str:
    """The patch folder of supported release ``version`` (build.py --vllm)."""
    index = read(root)
    if version not in index:
        raise PatchsetError(
            f"vLLM {version} is not in {RELEASES} (supported: {', '.join(index)}); "
            "name a roll's folder with --patches until it has a table there"
        )
    return index[version].patches


def against_of(root: Path, patches: str) -> str:
    """The patch folder the release of folder ``patches`` is verified against
    (its ``against``), for ``build.py range-diff --expected``."""
    index = read(root)
    for release in index.values():
        if release.patches == patches and release.against is not None:
            return index[release.against].patches
    raise PatchsetError(
        f"{RELEASES} names no release that {patches}/ is verified against "
        "(`against`): say it with --against"
    )
