"""What a compat run compares: the series, the overlay and the pinned release.

``Inputs`` holds everything a release's result depends on besides its sdist
(and keys the cache on it). ``PinnedBase`` is the pinned sdist with the
series applied patch by patch, read lazily: the "before" side of every
comparison. ``TreeState`` is one release's files in memory, as the patches
checked so far leave them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import overrides, releases, upstream
from ..check import overlay_python, tarball_reader
from ..errors import PatchsetError
from ..exactapply import PatchDoesNotApply, apply_patch, touched_paths
from ..project import Project
from ..series import Patch, decode
from ..tree import load_patches
from .imports import ImportRef, overlay_imports

FORMAT = 7  # bump when the analysis changes: cached results are then recomputed

Say = Callable[[str], None]


@dataclass
class Inputs:
    """Everything a version's result depends on, besides the sdist."""

    project: Project
    patches: list[Patch]
    overlay_sources: dict[str, Path]
    imports: list[ImportRef]
    import_errors: list[str]
    override_sources: list[overrides.OverlaySource] = dataclasses.field(
        default_factory=list
    )

    @property
    def manifest(self) -> upstream.Manifest:
        return self.project.manifest

    def key(self, version: str, sdist_sha: str) -> str:
        data = {
            "format": FORMAT,
            "version": version,
            "sdist_sha256": sdist_sha,
            "pinned_sha256": self.manifest.sha256,
            "patches": [[p.name, p.sha256] for p in self.patches],
            "overlay_files": sorted(self.overlay_sources),
            "overlays": [[o.src, o.dst] for o in self.manifest.overlays],
            "imports": sorted(
                {json.dumps([r.module, r.name, r.guarded]) for r in self.imports}
            ),
            "overrides": overrides.fingerprint(
                self.override_sources, self.manifest.name
            ),
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


class PinnedBase:
    """The pinned sdist's touched files with 0..i-1 patches applied (lazily read)."""

    def __init__(self, inputs: Inputs) -> None:
        self.inputs = inputs
        self._before: list[dict[str, str | None]] | None = None
        self._read: Callable[[str], str | None] | None = None

    def before(self, index: int, path: str) -> str | None:
        if self._before is None:
            self._before = self._compute()
        states = self._before
        return states[min(index, len(states) - 1)].get(path)

    def read(self, path: str) -> str | None:
        """Any file of the pinned tree with the whole series applied."""
        if self._before is None:
            self._before = self._compute()
        assert self._read is not None
        return self._read(path)

    def _compute(self) -> list[dict[str, str | None]]:
        manifest = self.inputs.manifest
        sdist = pinned_sdist(manifest, lambda _m: None)
        wanted: set[str] = set()
        for p in self.inputs.patches:
            wanted |= touched_paths(p)
        touched = set(wanted)
        wanted |= overrides.wanted_paths(self.inputs.override_sources, manifest.name)
        members, raw = upstream.read_tarball(sdist, manifest, wanted)
        current: dict[str, str | None] = {
            p: decode(raw[p]) if p in raw else None for p in touched
        }
        states = []
        for patch in self.inputs.patches:
            states.append(dict(current))
            try:
                changes = apply_patch(patch, lambda p: current.get(p))
            except PatchDoesNotApply:
                continue
            for path, change in changes.items():
                current[path] = change.content
        states.append(dict(current))
        self._read = tarball_reader(sdist, manifest, members, raw, current)
        return states


def pinned_sdist(manifest: upstream.Manifest, say: Say) -> Path:
    """The pinned sdist, from the cache or (verified against the pin) the index."""
    path = upstream.verified_cached_sdist(manifest)
    if path is not None:
        return path
    path, sha = releases.fetch_release(manifest.version, say, manifest.name)
    if sha != manifest.sha256:
        raise PatchsetError(
            f"the index's sha256 for {manifest.name} {manifest.version} is {sha}, not the "
            f"pinned {manifest.sha256} (patches/upstream.toml); refusing to compare against it"
        )
    return path


class TreeState:
    """An sdist's files in memory: the member list, read contents, patch results."""

    def __init__(self, members: set[str], raw: dict[str, bytes]) -> None:
        self.members = members
        self.raw = raw
        self.files: dict[str, str | None] = {}

    def read(self, path: str) -> str | None:
        if path in self.files:
            return self.files[path]
        if path in self.raw:
            return decode(self.raw[path])
        if path in self.members:
            raise AssertionError(f"{path} was not read from the tarball")
        return None

    def exists(self, path: str) -> bool:
        if path in self.files:
            return self.files[path] is not None
        return path in self.members

    def dir_exists(self, path: str) -> bool:
        prefix = path.rstrip("/") + "/"
        return any(m.startswith(prefix) for m in self.members) or any(
            p.startswith(prefix) and c is not None for p, c in self.files.items()
        )


def load_inputs(project: Project) -> Inputs:
    """The series (refused when it cannot be loaded), the overlay and its imports."""
    patches = load_patches(project)
    sources = project.overlay_sources()
    refs, errors = overlay_imports(
        sources, project.manifest.overlays, project.manifest.name
    )
    return Inputs(project, patches, sources, refs, errors, overlay_python(project))
