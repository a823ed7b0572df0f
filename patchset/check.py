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

from collections.abc import Callable
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


def tarball_reader(
    sdist: Path,
    manifest: upstream.Manifest,
    members: set[str],
    raw: dict[str, bytes],
    patched: dict[str, str | None],
) -> Callable[[str], str | None]:
    """Upstream files as the series leaves them: patched ones first, then the tarball's.

    A member not read in the first pass is fetched in one more pass over the
    tarball, which then reads every ``.py`` file of the package at once (upstream
    bases in modules the overlay does not import).
    """
    more: dict[str, bytes] | None = None

    def read(path: str) -> str | None:
        nonlocal more
        if path in patched:
            return patched[path]
        if path in raw:
            return decode(raw[path])
        if path not in members:
            return None
        if more is None:
            prefix = manifest.name + "/"
            wanted = {m for m in members if m.startswith(prefix) and m.endswith(".py")}
            _, more = upstream.read_tarball(sdist, manifest, wanted | {path})
        return decode(more[path]) if path in more else None

    return read


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


class SeriesOnSdist:
    """An sdist with a series applied in memory, patch by patch, with zero fuzz (a
    patch that does not apply is left out): the touched files before each patch
    (``states[i]``: the first i patches applied), any file of the whole result
    (``read``)."""

    def __init__(
        self,
        sdist: Path,
        manifest: upstream.Manifest,
        patches: list[Patch],
        wanted: set[str],
    ) -> None:
        touched = set().union(*map(touched_paths, patches))
        members, raw = upstream.read_tarball(sdist, manifest, touched | wanted)
        current = {p: decode(raw[p]) if p in raw else None for p in touched}
        self.patches = patches
        self.states = [dict(current)]
        for patch in patches:
            try:
                changes = apply_patch(patch, current.get)
            except PatchDoesNotApply:
                changes = {}
            current.update((path, c.content) for path, c in changes.items())
            self.states.append(dict(current))
        self.read = tarball_reader(sdist, manifest, members, raw, current)

    def added_by(self, path: str, name: str) -> str | None:
        """The patch that adds ``def name(`` to ``path`` (the pristine file lacks
        it), else None."""
        has = [f"def {name}(" in (state.get(path) or "") for state in self.states]
        if has[0] or True not in has:
            return None
        return self.patches[has.index(True) - 1].name


def check_overrides(
    project: Project,
    sources: list[overrides.OverlaySource],
    read: Callable[[str], str | None],
    result: CheckResult,
    against: Project | None = None,
    against_role: str = "the pin",
) -> None:
    """The overlay's subclasses of upstream classes against ``read``'s upstream; on a
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
            wanted = overrides.wanted_paths(sources, manifest.name)
            pinned = SeriesOnSdist(sdist, pin.manifest, load_patches(pin), wanted)
            pinned_label = (
                f"{pin.manifest.name} {pin.manifest.version} ({against_role})"
            )
    report = overrides.check_overrides(
        sources,
        read,
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
            pinned.added_by(p.upstream, p.name)
            if pinned and p.kind == "override-missing" and p.upstream and p.name
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

    wanted: set[str] = set()
    for patch in patches:
        wanted |= touched_paths(patch)
    python = overlay_python(project)
    wanted |= overrides.wanted_paths(python, manifest.name)
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
    read_upstream = tarball_reader(sdist, manifest, tree.members, tree.raw, tree.files)
    check_overrides(project, python, read_upstream, result, against, against_role)
    return result
