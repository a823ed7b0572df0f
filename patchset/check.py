"""``build.py check``: is the series sound, without touching any tree?

Fast and offline once the sdist is cached: the series is applied in memory
(zero fuzz) to the files it touches, read straight from the tarball in one
pass; nothing is unpacked and git is not needed. Then the overlay's subclasses
of upstream classes are checked against those files (``overrides``): every
override and ``super()`` call must still name an upstream method with a
compatible signature.

``check --release`` (``releasecheck``) builds on this module's readers of an
sdist with the series applied; this module does not import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import confine, overrides, upstream
from .errors import EXIT_CANNOT_RUN, EXIT_OK, EXIT_PROBLEMS
from .exactapply import PatchDoesNotApply, apply_patch, touched_paths
from .headers import backport_reference_problem
from .project import MANIFEST, Project
from .series import Patch, decode
from .tree import load_patches
from .validate import (
    DUPLICATE,
    HEADER,
    MISSING,
    OPTION,
    OUTSIDE,
    PARSE,
    UNLISTED,
    validate_series,
)

# validate's rule -> the kind of problem check reports
_KIND = {
    OPTION: "series",
    OUTSIDE: "series",
    DUPLICATE: "series",
    MISSING: "series",
    UNLISTED: "series",
    PARSE: "parse",
    HEADER: "header",
}


@dataclass
class Problem:
    # series | parse | header | confinement | apply | overlay | override;
    # backport (a warning: a Backport claim that names no upstream change)
    kind: str
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
    warnings: list[Problem] = field(default_factory=list)  # not counted in exit_code
    applied: list[str] = field(default_factory=list)  # validated against the tarball
    unchecked: list[str] = field(default_factory=list)  # after the first failure
    cannot_run: str | None = None
    sdist: str | None = None
    overrides: overrides.Report | None = None

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
            "warnings": [p.to_json() for p in self.warnings],
            "applied_to_pristine": self.applied,
            "unchecked": self.unchecked,
            "overrides": (
                {"summary": self.overrides.summary(), "classes": self.overrides.classes}
                if self.overrides
                else None
            ),
        }


def overlay_python(project: Project) -> list[overrides.OverlaySource]:
    """The overlay's .py files: shown under their repo path, placed at their tree path."""
    return [
        overrides.OverlaySource(project.rel(src), dst, decode(src.read_bytes()))
        for dst, src in sorted(project.overlay_sources().items())
        if dst.endswith(".py")
    ]


def overlay_roots(manifest: upstream.Manifest) -> list[str]:
    """The overlay's placed packages, dotted: names under them are ours, not upstream's."""
    return [ov.dst.replace("/", ".") for ov in manifest.overlays]


class PackagePython:
    """The tarball members to read: every ``.py`` file of the package (what the
    override check places the overlay among) and the paths of ``extra``."""

    def __init__(self, top: str, extra: set[str]) -> None:
        self.prefix, self.extra = top + "/", extra

    def __contains__(self, path: object) -> bool:
        return path in self.extra or (
            isinstance(path, str)
            and path.startswith(self.prefix)
            and path.endswith(".py")
        )


class Release:
    """An sdist's files in memory: its members, the files read, and what the
    patches applied so far made of them (``files``; None: deleted)."""

    def __init__(self, members: set[str], raw: dict[str, bytes]) -> None:
        self.members = members
        self.raw = raw
        self.files: dict[str, str | None] = {}

    def read(self, path: str) -> str | None:
        if path in self.files:
            return self.files[path]
        return decode(self.raw[path]) if path in self.raw else None

    def exists(self, path: str) -> bool:
        if path in self.files:
            return self.files[path] is not None
        return path in self.members

    def python_files(self, top: str) -> dict[str, str | None]:
        """Every ``.py`` file under ``top`` as the patches left it (None: deleted)."""
        paths = {*self.members, *self.files}
        return {
            p: self.read(p)
            for p in paths
            if p.startswith(top + "/") and p.endswith(".py")
        }

    def dir_exists(self, path: str) -> bool:
        prefix = path.rstrip("/") + "/"
        return any(m.startswith(prefix) for m in self.members) or any(
            p.startswith(prefix) and text is not None for p, text in self.files.items()
        )


def overlay_collisions(project: Project, tree: Release) -> list[tuple[str, str]]:
    """(destination, message) for each overlay file that would overwrite a file
    of ``tree``: an upstream file, or a file a patch creates."""
    out = []
    for path, src in sorted(project.overlay_sources().items()):
        if path in tree.members:
            what = "an upstream file"
        elif tree.files.get(path) is not None:
            what = "a file a patch creates"
        else:
            continue
        src_rel = project.rel(src)
        out.append(
            (
                path,
                f"overlay file {src_rel} -> {path} collides: it would overwrite {what}",
            )
        )
    return out


class SeriesOnSdist(Release):
    """An sdist with a series applied in memory, patch by patch, with zero fuzz (a
    patch that does not apply is left out): the touched files before each patch
    (``states[i]``: the first i patches applied), any file of the whole result
    (``read``)."""

    def __init__(
        self, sdist: Path, manifest: upstream.Manifest, patches: list[Patch]
    ) -> None:
        touched = set().union(*map(touched_paths, patches))
        wanted = PackagePython(manifest.name, touched)
        super().__init__(*upstream.read_tarball(sdist, manifest, wanted))
        current = {p: self.read(p) for p in touched}
        self.patches = patches
        self.states = [dict(current)]
        for patch in patches:
            try:
                changes = apply_patch(patch, current.get)
            except PatchDoesNotApply:
                changes = {}
            current.update((path, c.content) for path, c in changes.items())
            self.states.append(dict(current))
        self.files.update(current)

    def added_by(self, name: str) -> str | None:
        """The patch that adds ``def name(`` to a file the pristine release lacks it
        in, else None."""
        for path in self.states[0]:
            has = [f"def {name}(" in (state.get(path) or "") for state in self.states]
            if not has[0] and True in has:
                return self.patches[has.index(True) - 1].name
        return None


def check_overrides(
    project: Project,
    sources: list[overrides.OverlaySource],
    files: dict[str, str | None],
    result: CheckResult,
    against: Project | None = None,
    against_role: str = "the pin",
) -> None:
    """The overlay's subclasses of upstream classes among ``files``; on a
    roll, also against ``against``'s (default: the pin's; its sdist with its series
    applied): a method ours overrides there must be an override in the roll's
    release too, super() or not."""
    manifest = project.manifest
    pinned, pinned_label = None, None
    pin = against or Project(project.root)
    if pin.patches != project.patches and (pin.patches_dir / MANIFEST).is_file():
        sdist = upstream.verified_cached_sdist(pin.manifest)
        if sdist is None:
            result.warnings.append(
                Problem(
                    "override",
                    f"{against_role}'s sdist ({pin.manifest.sdist}) is not cached: "
                    f"the roll's overrides were not compared with {against_role}'s; run "
                    f"`{pin.cmd('fetch')}`",
                )
            )
        else:
            pinned = SeriesOnSdist(sdist, pin.manifest, load_patches(pin))
            pinned_label = (
                f"{pin.manifest.name} {pin.manifest.version} ({against_role})"
            )
    report = overrides.check_overrides(
        sources,
        files,
        read_pinned=pinned.read if pinned else None,
        top=manifest.name,
        roots=overlay_roots(manifest),
        label=f"{manifest.name} {manifest.version}",
        pinned_label=pinned_label,
    )
    result.overrides = report
    for p in report.problems:
        problem = Problem("override", f"{p.kind}: {p.describe()}", detail=p.to_json())
        added_by = (
            pinned.added_by(p.name)
            if pinned and p.kind == "override-missing" and p.name
            else None
        )
        if added_by is not None:
            # a hook the pin's own series adds: the roll may do without its patch
            problem.message += (
                f" ({against_role} has it only through {added_by}, which this roll does not "
                "carry: if the release no longer needs that patch, the override is "
                "unused there, as intended)"
            )
            result.warnings.append(problem)
        elif p.severity == overrides.ERROR:
            result.problems.append(problem)
        else:
            result.warnings.append(problem)


def run_check(
    project: Project, against: Project | None = None, against_role: str = "the pin"
) -> CheckResult:
    """Everything ``check`` checks; a roll's overrides are compared with ``against``'s
    (default: the pin's)."""
    result = CheckResult()
    manifest = project.manifest
    report = validate_series(project)
    for p in report.problems:
        result.problems.append(Problem(_KIND[p.code], p.message, p.patch))
    patches = report.patches
    for patch in patches:
        claim = backport_reference_problem(patch)
        if claim:
            result.warnings.append(
                Problem("backport", f"{patch.name}: {claim}", patch.name)
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
            f"be checked against it; run `{project.cmd('fetch')}`"
        )
        return result
    actual = upstream.sha256_file(sdist)
    if actual != manifest.sha256:
        result.cannot_run = (
            f"the cached {sdist} has sha256 {actual}, not the pinned {manifest.sha256}; "
            f"run `{project.cmd('fetch')}`"
        )
        return result

    touched: set[str] = set().union(*map(touched_paths, patches))
    python = overlay_python(project)
    wanted = PackagePython(manifest.name, touched)
    tree = Release(*upstream.read_tarball(sdist, manifest, wanted))
    for i, patch in enumerate(patches):
        if any(v.patch == patch.name for v in refused):  # reported above
            result.unchecked = [p.name for p in patches[i + 1 :]]
            break
        try:
            changes = apply_patch(patch, tree.read)
        except PatchDoesNotApply as exc:
            if not patch.parse_error:  # already reported as a parse problem
                result.problems.append(
                    Problem("apply", exc.describe(), patch.name, exc.to_json())
                )
            result.unchecked = [p.name for p in patches[i + 1 :]]
            break
        tree.files.update((path, c.content) for path, c in changes.items())
        result.applied.append(patch.name)

    for _, message in overlay_collisions(project, tree):
        result.problems.append(Problem("overlay", message))
    files = tree.python_files(manifest.name)
    check_overrides(project, python, files, result, against, against_role)
    return result
