"""``build.py check``: is the series sound, without touching any tree?

Fast and offline once the sdist is cached: the series is applied in memory
(zero fuzz) to the files it touches, read straight from the tarball in one
pass; nothing is unpacked and git is not needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import confine, upstream
from .errors import EXIT_CANNOT_RUN, EXIT_OK, EXIT_PROBLEMS
from .exactapply import PatchDoesNotApply, apply_patch, touched_paths
from .headers import header_problems
from .project import Project
from .series import Patch, decode, read_patch


@dataclass
class Problem:
    kind: str  # series | parse | header | confinement | apply | overlay
    message: str
    patch: str | None = None
    detail: dict | None = None

    def to_json(self) -> dict:
        out = {"kind": self.kind, "message": self.message, "patch": self.patch}
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass
class CheckResult:
    problems: list[Problem] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # validated against the tarball
    unchecked: list[str] = field(default_factory=list)  # after the first failure
    cannot_run: str | None = None
    sdist: str | None = None

    @property
    def exit_code(self) -> int:
        if self.cannot_run:
            return EXIT_CANNOT_RUN
        return EXIT_PROBLEMS if self.problems else EXIT_OK

    def to_json(self) -> dict:
        return {
            "ok": self.exit_code == EXIT_OK,
            "exit_code": self.exit_code,
            "cannot_run": self.cannot_run,
            "sdist": self.sdist,
            "problems": [p.to_json() for p in self.problems],
            "applied_to_pristine": self.applied,
            "unchecked": self.unchecked,
        }


def run_check(project: Project) -> CheckResult:
    result = CheckResult()
    manifest = project.manifest
    series = project.series()
    for msg in series.problems:
        result.problems.append(Problem("series", msg))

    patches: list[Patch] = []
    seen: set[str] = set()
    for entry in series.entries:
        if entry.name in seen:
            result.problems.append(
                Problem(
                    "series",
                    f"series line {entry.line}: {entry.name} is listed twice",
                    entry.name,
                )
            )
            continue
        seen.add(entry.name)
        path = project.patch_path(entry.name)
        if not path.is_file():
            result.problems.append(
                Problem(
                    "series",
                    f"series line {entry.line}: {entry.name} is listed but "
                    f"{project.rel(path)} does not exist",
                    entry.name,
                )
            )
            continue
        patch = read_patch(path, entry.name)
        patches.append(patch)
        if patch.parse_error:
            result.problems.append(
                Problem("parse", f"{entry.name}: {patch.parse_error}", entry.name)
            )
        for msg in header_problems(patch):
            result.problems.append(
                Problem("header", f"{entry.name}: {msg}", entry.name)
            )
    for name in project.patch_files_on_disk():
        if name not in seen:
            result.problems.append(
                Problem(
                    "series",
                    f"patches/{name} is not listed in patches/series (add it, or delete it)",
                    name,
                )
            )

    # Every path of every patch (and of the overlay) must stay inside the tree.
    tree = project.rel(project.tree)
    refused = confine.project_violations(project, patches, on_disk=False)
    for v in refused:
        patch_name = v.patch if v.line is not None else None
        result.problems.append(
            Problem("confinement", v.message(tree), patch_name, v.to_json(tree))
        )

    sdist = upstream.cached_sdist(manifest)
    result.sdist = str(sdist)
    if not sdist.is_file():
        result.cannot_run = (
            f"the {manifest.sdist} sdist is not cached at {sdist}, so the series cannot "
            "be checked against it; run `python build.py fetch`"
        )
        return result
    actual = upstream.sha256_file(sdist)
    if actual != manifest.sha256:
        result.cannot_run = (
            f"the cached {sdist} has sha256 {actual}, not the pinned {manifest.sha256}; "
            "run `python build.py fetch`"
        )
        return result

    wanted: set[str] = set()
    for patch in patches:
        wanted |= touched_paths(patch)
    members, raw = upstream.read_tarball(sdist, manifest, wanted)
    files: dict[str, str | None] = {}

    def read(path: str) -> str | None:
        if path in files:
            return files[path]
        return decode(raw[path]) if path in raw else None

    for i, patch in enumerate(patches):
        if any(v.patch == patch.name for v in refused):  # reported above
            result.unchecked = [p.name for p in patches[i + 1 :]]
            break
        try:
            changes = apply_patch(patch, read)
        except PatchDoesNotApply as exc:
            if not patch.parse_error:  # already reported as a parse problem
                result.problems.append(
                    Problem("apply", exc.describe(), patch.name, exc.to_json())
                )
            result.unchecked = [p.name for p in patches[i + 1 :]]
            break
        for path, change in changes.items():
            files[path] = change.content
        result.applied.append(patch.name)

    sources = project.overlay_sources()
    for path in sorted(sources):
        src = project.rel(sources[path])
        if path in members:
            result.problems.append(
                Problem(
                    "overlay",
                    f"overlay file {src} -> {path} would overwrite an upstream file",
                )
            )
        elif files.get(path) is not None:
            result.problems.append(
                Problem(
                    "overlay",
                    f"overlay file {src} -> {path} would overwrite a file a patch creates",
                )
            )
    return result
