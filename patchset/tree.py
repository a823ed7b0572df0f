"""The managed tree: pristine baseline, one commit per patch, then the overlay.

Layout (``tree`` from the manifest, e.g. ``third_party/vllm``)::

    third_party/vllm/        the work tree: pristine sdist + patches + overlay
    third_party/vllm.git/    its git dir (never inside the tree, so vLLM's
                             setuptools-scm finds no .git and reports the
                             sdist's own version)
        info/exclude         build artifacts (pip install -e, kernels): ignored
        patchset-state.json  which commit is which patch (and its sha256)

History on top of the tag ``vmp-pristine`` (the unpacked sdist, as is):
one commit per series patch, message = the patch header, then one
``vmp-overlay`` commit holding the overlay files.

Edits "no patch captures" are: uncommitted changes outside the overlay,
commits that are not a recorded patch commit, and overlay files edited in
the tree whose content differs from the repo's copy (``export`` copies them
back). Ignored build artifacts never count.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import identity, overlay, releases, state, upstream
from .confine import PathsOutsideTree, disk_violations, project_violations
from .errors import PatchsetError, ProblemsFound
from .exactapply import FileResult, PatchDoesNotApply, PatchLeavesTree, apply_patch
from .gitrepo import GitRepo
from .project import Project
from .series import DEFAULT_AUTHOR, Patch, decode
from .validate import validate_series

PRISTINE_TAG = "vmp-pristine"
OVERLAY_SUBJECT = "vmp-overlay"
TOOL_AUTHOR = ("build.py", "build.py@localhost")

Say = Callable[[str], None]


@dataclass(frozen=True)
class Edit:
    """A file changed in the tree that no patch (or overlay copy) holds."""

    path: str
    why: str


class UncapturedEdits(ProblemsFound):
    def __init__(self, project: Project, edits: list[Edit], action: str) -> None:
        self.edits = edits
        listing = "\n".join(f"  {e.path}  ({e.why})" for e in edits[:50])
        more = f"\n  ... and {len(edits) - 50} more" if len(edits) > 50 else ""
        super().__init__(
            f"refusing to {action}: {project.rel(project.tree)} holds edits that no "
            f"patch captures:\n{listing}{more}\n"
            "Keep them: commit them in the tree "
            f"(`{project.git_cmd()} add -A && {project.git_cmd()} commit`, with a "
            "message that says why and has an Upstream-Status: line) and run "
            f"`{project.cmd('export')}`. Discard them: run again with --force."
        )


class OverlayCollision(ProblemsFound):
    pass


@dataclass
class OverlayFile:
    path: str  # tree-relative
    tree: bytes | None
    placed: bytes | None
    repo: bytes | None

    @property
    def tree_edited(self) -> bool:
        return self.tree != self.placed

    @property
    def in_sync(self) -> bool:
        return self.tree == self.repo


@dataclass
class Analysis:
    """Where the tree stands relative to its recorded state."""

    state: state.State
    chain: list[str]  # first-parent commits pristine..HEAD, oldest first
    on_pristine: bool
    uncaptured: list[Edit] = field(default_factory=list)
    unknown_commits: list[tuple[str, str]] = field(default_factory=list)
    overlay_files: list[OverlayFile] = field(default_factory=list)
    overlay_paths: set[str] = field(
        default_factory=set
    )  # tree paths the overlay manages
    ids: identity.ChainIdentity = field(default_factory=identity.ChainIdentity)

    @property
    def overlay_placed(self) -> bool:
        return self.ids.overlay is not None

    @property
    def overlay_in_sync(self) -> bool:
        return self.overlay_placed and all(f.in_sync for f in self.overlay_files)

    @property
    def overlay_needs_copy_back(self) -> list[str]:
        return [f.path for f in self.overlay_files if f.tree_edited and not f.in_sync]

    @property
    def overlay_repo_changed(self) -> list[str]:
        return [
            f.path for f in self.overlay_files if not f.tree_edited and not f.in_sync
        ]


class Tree:
    def __init__(self, project: Project) -> None:
        self.project = project
        self.path = project.tree
        self.git_dir = project.git_dir
        self.repo = GitRepo(self.git_dir, self.path)

    # -- layout -------------------------------------------------------------

    def present(self) -> bool:
        return self.path.is_dir()

    def check_layout(self) -> None:
        """Refuse layouts build.py did not make (a tree without its git dir, ...)."""
        rel = self.project.rel
        if (self.path / ".git").exists():
            raise PatchsetError(
                f"{rel(self.path)}/.git exists: a .git inside the tree makes vLLM's "
                "setuptools-scm report a dev version instead of the pinned one. build.py "
                f"keeps the tree's git dir at {rel(self.git_dir)}; remove "
                f"{rel(self.path)}/.git (or the whole tree) and run `{self.project.cmd('apply')}`"
            )
        if self.present() and not self.repo.exists():
            raise PatchsetError(
                f"{rel(self.path)} exists but its git dir {rel(self.git_dir)} does not, "
                f"so build.py cannot tell what was changed in it. Move {rel(self.path)} "
                f"away (or delete it) and run `{self.project.cmd('apply')}`"
            )
        if self.present() and state.load(self.git_dir) is None:
            raise PatchsetError(
                f"{rel(self.git_dir)} has no {state.STATE_FILE}: it was not made by "
                f"build.py. Delete {rel(self.path)} and {rel(self.git_dir)} and run "
                f"`{self.project.cmd('apply')}`"
            )

    def load_state(self) -> state.State:
        st = state.load(self.git_dir)
        if st is None:
            raise PatchsetError(
                f"{self.project.rel(self.git_dir)} has no build.py state"
            )
        return st

    def create_baseline(self, sdist: Path, say: Say) -> state.State:
        """Unpack the sdist into the tree and commit it as the pristine baseline."""
        manifest = self.project.manifest
        rel = self.project.rel
        if self.git_dir.exists():
            say(f"removing stale git dir {rel(self.git_dir)} (its tree is gone)")
            shutil.rmtree(self.git_dir)
        say(f"unpacking {sdist.name} into {rel(self.path)}")
        upstream.unpack(sdist, manifest, self.path)
        self.repo = GitRepo(self.git_dir, self.path)
        self.repo.init()
        self.repo.write_exclude(
            list(manifest.artifacts),
            "Build artifacts inside the tree (pip install -e, precompiled kernels).\n"
            "Written by build.py from patches/upstream.toml [artifacts] ignore:\n"
            "they are never edits, and reset keeps them.",
        )
        self.repo.add_all()
        # The sdist's own .gitignore hides some shipped files from `add -A`;
        # track every sdist file except the build artifacts we ignore.
        self.repo.add_paths(sorted(self.repo.untracked_not_excluded()))
        commit = self.repo.commit(
            f"{PRISTINE_TAG}: {manifest.name} {manifest.version} sdist\n\n"
            f"Unpacked from {manifest.sdist} (sha256 {manifest.sha256}).\n",
            TOOL_AUTHOR,
        )
        self.repo.tag(PRISTINE_TAG, commit)
        untracked = self._sdist_files_ignored(sdist)
        if untracked:
            shown = ", ".join(untracked[:5]) + (" ..." if len(untracked) > 5 else "")
            say(
                f"note: {len(untracked)} sdist files match the build-artifact ignore "
                f"rules and are not tracked: {shown}"
            )
        st = state.State(sdist_sha256=manifest.sha256, pristine=commit)
        state.save(self.git_dir, st)
        say(f"baseline committed and tagged {PRISTINE_TAG} ({commit[:12]})")
        return st

    def _sdist_files_ignored(self, sdist: Path) -> list[str]:
        tracked = set(self.repo.tracked_files("HEAD"))
        members, _ = upstream.read_tarball(sdist, self.project.manifest, set())
        return sorted(members - tracked)

    # -- analysis -----------------------------------------------------------

    def analyse(self) -> Analysis:
        st = self.load_state()
        overlays = self.project.manifest.overlays
        pristine = self.repo.rev_parse(PRISTINE_TAG) or st.pristine
        head = self.repo.head()
        on_pristine = head is not None and self.repo.is_ancestor(pristine, head)
        chain = self.repo.first_parent_commits(pristine) if on_pristine else []
        ids = identity.identify(
            chain,
            self.repo.messages(pristine) if chain else {},
            {p.name: p.commit for p in st.patches},
            st.overlay_commit,
        )
        result = Analysis(st, chain, on_pristine, ids=ids)
        if not on_pristine:
            result.uncaptured.append(
                Edit("(HEAD)", f"HEAD is not based on the {PRISTINE_TAG} tag")
            )
        # Overlay-managed paths: files under the overlay folders that are not
        # tree files (upstream or patch-made) as of the commit before the overlay.
        placed_rev = ids.overlay
        base_rev = f"{placed_rev}^" if placed_rev else "HEAD"
        base_files: set[str] = set()
        placed_paths: set[str] = set()
        for ov in overlays:
            if head is not None:
                base_files.update(self.repo.tracked_files(base_rev, ov.dst))
            if placed_rev:
                placed_paths.update(self.repo.tracked_files(placed_rev, ov.dst))
        placed_paths -= base_files
        sources = self.project.overlay_sources()
        in_tree = {
            p for p in overlay.tree_files(self.path, overlays) if p not in base_files
        }
        result.overlay_paths = (set(sources) | in_tree | placed_paths) - base_files

        for entry in self.repo.status():
            if entry.path in result.overlay_paths:
                continue
            why = (
                "untracked file"
                if entry.untracked
                else f"uncommitted change ({entry.code.strip()})"
            )
            result.uncaptured.append(Edit(entry.path, why))
        amended = {c: n for n, c in ids.amended.items()}
        recorded = {p.commit for p in st.patches}
        for commit in chain:
            if commit in amended:
                result.uncaptured.append(
                    Edit(
                        amended[commit],
                        f"the patch's commit was changed in the tree (now {commit[:12]}: "
                        "amend, fixup or rebase); run export to write it back",
                    )
                )
                continue
            if commit == ids.overlay:
                # amended or rebased, it is still the overlay commit: but it may
                # hold overlay files only
                for path in self.repo.changed_files(commit):
                    if path not in result.overlay_paths:
                        result.uncaptured.append(
                            Edit(
                                path,
                                f"changed in the overlay commit {commit[:12]}, which holds "
                                "overlay files only: move it into a patch's commit",
                            )
                        )
                continue
            if commit in recorded:
                continue
            subject = self.repo.subject(commit)
            result.unknown_commits.append((commit, subject))
            if self.repo.parent_count(commit) > 1:
                result.uncaptured.append(
                    Edit("(merge)", f"merge commit {commit[:12]} {subject!r}")
                )
            for path in self.repo.changed_files(commit):
                if path not in result.overlay_paths:
                    result.uncaptured.append(
                        Edit(
                            path,
                            f"commit {commit[:12]} {subject!r} is not from a series patch",
                        )
                    )
        for path in sorted(result.overlay_paths):
            item = OverlayFile(
                path,
                tree=overlay.read(self.path / path),
                placed=self.repo.file_at(placed_rev, path)
                if path in placed_paths
                else None,
                repo=overlay.read(sources[path]) if path in sources else None,
            )
            result.overlay_files.append(item)
            if item.tree_edited and not item.in_sync:
                result.uncaptured.append(
                    Edit(
                        path,
                        "overlay file edited in the tree, not copied back (run export)",
                    )
                )
        return result

    # -- apply --------------------------------------------------------------

    def apply(self, patches: list[Patch], *, force: bool, say: Say) -> None:
        """Bring the tree to pristine + patches + overlay; see module docstring."""
        manifest = self.project.manifest
        st = self.load_state()
        if st.sdist_sha256 != manifest.sha256:
            analysis = self.analyse()
            if analysis.uncaptured and not force:
                raise UncapturedEdits(
                    self.project, analysis.uncaptured, "rebuild the tree"
                )
            say(
                f"the tree was unpacked from another sdist (sha256 {st.sdist_sha256[:12]}...); "
                "rebuilding it from the pinned one"
            )
            shutil.rmtree(self.path)
            shutil.rmtree(self.git_dir)
            st = self.create_baseline(releases.fetch(manifest, say), say)

        analysis = self.analyse()
        st = analysis.state
        wanted = [(p.name, p.sha256) for p in patches]
        recorded = [(p.name, p.sha256) for p in st.patches]
        if (
            wanted == recorded
            and st.version == state.VERSION
            and analysis.chain == st.commits()
            and analysis.overlay_in_sync
            and not analysis.uncaptured
        ):
            say(
                f"{self.project.rel(self.path)} is up to date: {len(patches)} patches "
                "applied, overlay in place; nothing changed"
            )
            return
        if analysis.uncaptured:
            if not force:
                raise UncapturedEdits(self.project, analysis.uncaptured, "apply")
            say(f"--force: discarding {len(analysis.uncaptured)} uncaptured edits")

        keep = 0
        while (
            st.version == state.VERSION  # older trees lack the identity trailers
            and keep < len(wanted)
            and keep < len(recorded)
            and wanted[keep] == recorded[keep]
            and keep < len(analysis.chain)
            and analysis.chain[keep] == st.patches[keep].commit
        ):
            keep += 1
        base = st.patches[keep - 1].commit if keep else st.pristine
        self.repo.reset_hard(base)
        st.patches = st.patches[:keep]
        st.overlay_commit = None
        st.version = state.VERSION
        state.save(self.git_dir, st)
        total = len(patches)
        for i, patch in enumerate(patches):
            if i < keep:
                say(f"[{i + 1}/{total}] {patch.name} already applied")
                continue
            say(f"[{i + 1}/{total}] applying {patch.name}")
            try:
                commit = self._apply_one(patch)
            except PatchDoesNotApply as exc:
                last = (
                    st.patches[-1].name
                    if st.patches
                    else f"the pristine tree ({PRISTINE_TAG})"
                )
                exc.set_note(
                    f"the tree is left at the last good patch, {last}; nothing of "
                    f"{patch.name} was written. Refresh the patch against that tree, then "
                    f"run `{self.project.cmd('apply')}` again"
                )
                raise
            st.patches.append(_applied(patch, commit))
            state.save(self.git_dir, st)
        self._place_overlay(st, say)

    def _apply_one(self, patch: Patch) -> str:
        def read(path: str) -> str | None:
            file = self.path / path
            return decode(file.read_bytes()) if file.is_file() else None

        results = apply_patch(patch, read)
        # the check on disk, right before writing: no symlink there leads out
        outside = disk_violations(self.path, patch, sorted(results))
        if outside:
            raise PatchLeavesTree(patch.name, outside, self.project.rel(self.path))
        for result in results.values():
            self._write(result)
        if results:
            self.repo.add_paths(sorted(results))
        header = patch.header
        message = header.commit_message()
        if not header.subject:
            message = Path(patch.name).stem + (
                f"\n\n{header.body}\n" if header.body else "\n"
            )
        return self.repo.commit(
            identity.tag_patch_message(message, patch.name),
            header.author or DEFAULT_AUTHOR,
            allow_empty=True,
        )

    def _write(self, result: FileResult) -> None:
        file = self.path / result.path
        if result.content is None:
            file.unlink()
            return
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(result.content.encode("utf-8", "surrogateescape"))
        if result.executable is not None:
            file.chmod(0o755 if result.executable else 0o644)

    def _place_overlay(self, st: state.State, say: Say) -> None:
        sources = self.project.overlay_sources()
        collisions = []
        for path in sorted(sources):
            target = self.path / path
            if target.exists() or target.is_symlink():
                if self.repo.file_at(st.pristine, path) is not None:
                    origin = "an upstream file of the pristine tree"
                elif self.repo.file_at("HEAD", path) is not None:
                    origin = "a file created by a patch"
                else:
                    origin = "an untracked or ignored file in the tree"
                collisions.append(
                    f"  {self.project.rel(sources[path])} -> {path}: {origin}"
                )
        if collisions:
            raise OverlayCollision(
                "refusing to place the overlay: overlay files must not overwrite files of "
                "the tree:\n" + "\n".join(collisions) + "\nRename the overlay file, or "
                "change the tree's file with a patch instead."
            )
        for path, src in sorted(sources.items()):
            overlay.copy_file(src, self.path / path)
        if sources:
            self.repo.add_paths(sorted(sources))
        folders = ", ".join(
            f"{ov.src}/ -> {ov.dst}/" for ov in self.project.manifest.overlays
        )
        st.overlay_commit = self.repo.commit(
            identity.tag_overlay_message(
                f"{OVERLAY_SUBJECT}\n\nOverlay files placed by build.py apply: "
                f"{folders or 'none'}.\n"
            ),
            TOOL_AUTHOR,
            allow_empty=True,
        )
        state.save(self.git_dir, st)
        say(f"overlay: placed {len(sources)} files ({folders or 'no overlay folders'})")

    # -- reset --------------------------------------------------------------

    def reset(self, *, force: bool, say: Say) -> None:
        analysis = self.analyse()
        if analysis.uncaptured and not force:
            raise UncapturedEdits(self.project, analysis.uncaptured, "reset")
        st = analysis.state
        self.repo.reset_hard(st.pristine)
        st.patches = []
        st.overlay_commit = None
        state.save(self.git_dir, st)
        say(
            f"reset {self.project.rel(self.path)} to {PRISTINE_TAG} (the pristine sdist); "
            "ignored build artifacts were kept"
        )


def _applied(patch: Patch, commit: str) -> state.AppliedPatch:
    return state.AppliedPatch(patch.name, patch.sha256, commit, patch.title)


def load_patches(project: Project) -> list[Patch]:
    """The series' patches, read and parsed; refuses a series that cannot be loaded."""
    report = validate_series(project)
    problems = [p.message for p in report.loading_problems]
    if problems:
        raise ProblemsFound(
            f"{project.rel(project.series_path)} is not usable:\n"
            + "\n".join(f"  {p}" for p in problems)
            + f"\nFix {project.rel(project.series_path)} (run `{project.cmd('check')}` "
            "for all problems)."
        )
    patches = report.patches
    outside = project_violations(project, patches)
    if outside:
        raise PathsOutsideTree(
            "apply",
            outside,
            project.rel(project.tree),
            "Nothing was written. Fix those patches (or the overlay) and run "
            f"`{project.cmd('apply')}` again; `{project.cmd('check')}` lists them all.",
        )
    return patches
