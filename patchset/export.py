"""Export (refresh): the tree's commits back to ``patches/`` and the overlay folders.

Each commit between the pristine tag and HEAD (the overlay commit aside)
becomes ``NNNN-slug.patch`` through ``git format-patch`` with deterministic
options, normalised by ``series.canonical_patch``. Overlay paths are left
out of the patches; overlay files are copied back to their repo folders
instead. Files are only rewritten when their bytes change, so apply followed
by export is a no-op on a clean series.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import identity, overlay, state
from .confine import PathsOutsideTree, violations
from .errors import ProblemsFound
from .project import PatchOutsideFolder
from .series import (
    canonical_patch,
    parse_patch,
    patch_file_name,
    render_series,
    sha256_bytes,
)
from .tree import Analysis, Say, Tree


@dataclass
class ExportResult:
    written: list[str] = field(default_factory=list)  # patch files whose bytes changed
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    series_changed: bool = False
    overlay_copied: list[str] = field(default_factory=list)
    overlay_removed: list[str] = field(default_factory=list)
    # newer in the repo: not copied back
    overlay_kept: list[str] = field(default_factory=list)


def export(tree: Tree, *, force: bool, say: Say) -> ExportResult:
    project = tree.project
    overlays = project.manifest.overlays
    outside = [
        f"  series line {e.line}: {e.name} {why}"
        for e in project.series().entries
        if (why := project.patch_name_problem(e.name)) is not None
    ]
    if outside:
        raise PatchOutsideFolder(
            f"refusing to export: {project.rel(project.series_path)} names files "
            f"outside {project.patches}/:\n" + "\n".join(outside) + "\nNothing was "
            "written or removed. List each patch by its file name in the folder."
        )
    if tree.repo.rebase_in_progress():
        raise ProblemsFound(
            f"refusing to export: a git rebase is under way in {project.rel(tree.path)}; "
            f"finish it (`{project.git_cmd()} rebase --continue`) or abort it "
            f"(`{project.git_cmd()} rebase --abort`), then export"
        )
    analysis = tree.analyse()
    st = analysis.state
    if not analysis.on_pristine:
        raise ProblemsFound(
            f"refusing to export: HEAD of {project.rel(tree.path)} is not based on the "
            "pristine tag; check the tree's history with "
            f"`{project.git_cmd()} log --oneline`"
        )
    dirty = [e for e in tree.repo.status() if e.path not in analysis.overlay_paths]
    if dirty:
        listing = "\n".join(
            f"  {e.path}  ({'untracked' if e.untracked else e.code.strip()})"
            for e in dirty
        )
        raise ProblemsFound(
            f"refusing to export: {project.rel(tree.path)} has uncommitted edits:\n{listing}\n"
            "export writes patches from commits only. Commit them in the tree first: "
            f"`{project.git_cmd()} add -A && {project.git_cmd()} commit` (subject, a body "
            "saying why, an Upstream-Status: line), or amend the commit of the patch they "
            f"belong to; then run `{project.cmd('export')}` again."
        )
    merges = [c for c in analysis.chain if tree.repo.parent_count(c) > 1]
    if merges:
        raise ProblemsFound(
            "refusing to export: merge commits cannot become patches: "
            + ", ".join(c[:12] for c in merges)
        )

    old_series = project.series()
    if not force:
        stale = _stale_inputs(tree, analysis, old_series.names)
        if stale:
            raise ProblemsFound(
                "refusing to export: patches/ or the overlay folders hold changes the "
                "tree does not have; export would overwrite or drop them:\n"
                + "\n".join(f"  {s}" for s in stale)
                + f"\nRun `{project.cmd('apply')}` first (to build them into the tree), or "
                f"`{project.cmd('export --force')}` to overwrite them."
            )

    result = ExportResult()
    exclude = sorted(analysis.overlay_paths)
    new_entries: list[state.AppliedPatch] = []
    contents: dict[str, bytes] = {}
    ids = analysis.ids
    # A commit keeps the file its Patch-Filename trailer names (amend, fixup,
    # reword and reordering keep it); a new commit, or a hand-written patch
    # without the NNNN- prefix, gets the next free number.
    numbers = [
        _number(n)
        for n in [*old_series.names, *ids.patch_of.values()]
        if _PATCH_NAME.match(n)
    ]
    next_number = max([n for n in numbers if n is not None], default=0) + 1
    for commit in analysis.chain:
        if commit == ids.overlay:
            continue
        raw = tree.repo.format_patch(commit, exclude)
        if not raw.strip():
            say(
                f"export: commit {commit[:12]} only touches overlay files; no patch for it"
            )
            continue
        data = canonical_patch(identity.strip_trailer(raw))
        patch = parse_patch("", data)
        name = ids.patch_of.get(commit)
        if name is None or name in contents or not _PATCH_NAME.match(name):
            name = patch_file_name(next_number, patch.header.subject or "patch")
            next_number += 1
        contents[name] = data
        new_entries.append(state.AppliedPatch(name, patch.sha256, commit, patch.title))

    outside = [v for n, d in contents.items() for v in violations(parse_patch(n, d))]
    if outside:
        commits = ", ".join(f"{e.name} = commit {e.commit[:12]}" for e in new_entries)
        raise PathsOutsideTree(
            "export",
            outside,
            project.rel(tree.path),
            f"Nothing was written. The patches come from tree commits ({commits}): "
            f"fix those commits (`{project.git_cmd()} rebase -i`), then export again.",
        )
    for i, (name, data) in enumerate(contents.items(), 1):
        path = project.patch_path(name)
        if path.is_file() and path.read_bytes() == data:
            result.unchanged.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            result.written.append(name)
        say(
            f"[{i}/{len(contents)}] {'unchanged' if name in result.unchanged else 'wrote'} {name}"
        )
    for name in old_series.names:
        if name not in contents and project.patch_path(name).is_file():
            project.patch_path(name).unlink()
            result.removed.append(name)
    new_names = list(contents)
    if new_names != old_series.names or not project.series_path.exists():
        project.series_path.write_text(
            render_series(new_names, old_series.header), encoding="utf-8"
        )
        result.series_changed = True

    if analysis.overlay_placed:
        for item in analysis.overlay_files:
            if item.in_sync:
                continue
            dest = overlay.repo_path(project.root, overlays, item.path)
            if not item.tree_edited and not force:
                # newer in the repo than in the tree: keep it (apply places it)
                result.overlay_kept.append(project.rel(dest))
                continue
            if item.tree is not None:
                overlay.copy_file(tree.path / item.path, dest)
                result.overlay_copied.append(project.rel(dest))
            elif item.placed is not None and dest.is_file():
                dest.unlink()
                result.overlay_removed.append(project.rel(dest))
    else:
        say(
            "export: the overlay is not placed in the tree (apply did not finish); overlay folders left as they are"
        )

    st.patches = new_entries
    st.overlay_commit = ids.overlay
    _tag_commits(tree, analysis, st, say)
    state.save(tree.git_dir, st)
    say(
        f"export: {len(result.written)} patch files written, {len(result.unchanged)} unchanged, "
        f"{len(result.removed)} removed; series {'updated' if result.series_changed else 'unchanged'}; "
        f"overlay: {len(result.overlay_copied)} files copied back, {len(result.overlay_removed)} removed"
        + (
            f", {len(result.overlay_kept)} newer in the repo kept "
            "(run apply to place them)"
            if result.overlay_kept
            else ""
        )
    )
    return result


def _tag_commits(tree: Tree, analysis: Analysis, st: state.State, say: Say) -> None:
    """Give every exported commit the trailer naming its patch file (and the overlay
    commit its own), so later amends, fixups and reorders keep their patch.
    Only messages change: trees, authors and the work tree stay as they are."""
    messages = tree.repo.messages(st.pristine)
    new_messages: dict[str, str] = {}
    for entry in st.patches:
        message = messages[entry.commit]
        if identity.patch_name_of(message) != entry.name:
            new_messages[entry.commit] = identity.tag_patch_message(
                identity.untag(message), entry.name
            )
    overlay_commit = st.overlay_commit
    if overlay_commit and not identity.is_overlay(messages[overlay_commit]):
        new_messages[overlay_commit] = identity.tag_overlay_message(
            messages[overlay_commit]
        )
    if not new_messages:
        return
    first = min(analysis.chain.index(c) for c in new_messages)
    mapping = tree.repo.reword(
        analysis.chain[first - 1] if first else st.pristine,
        analysis.chain[first:],
        new_messages,
    )
    for entry in st.patches:
        entry.commit = mapping.get(entry.commit, entry.commit)
    if overlay_commit:
        st.overlay_commit = mapping.get(overlay_commit, overlay_commit)
    say(
        f"export: {len(new_messages)} tree commits now carry their "
        f"{identity.PATCH_TRAILER}: trailer (messages only; files unchanged)"
    )


# a trailer names a file in patches/: nothing else (no folder, no ..) is taken from it
_PATCH_NAME = re.compile(r"^\d{4}-[A-Za-z0-9._-]+\.(?:patch|diff)$")


def _number(name: str) -> int | None:
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _stale_inputs(tree: Tree, analysis: Analysis, series_names: list[str]) -> list[str]:
    """Series patches and overlay files that are newer in the repo than in the tree."""
    project = tree.project
    applied = {
        p.name: p
        for p in analysis.state.patches
        if p.commit in analysis.chain or p.name in analysis.ids.amended
    }
    stale = []
    for name in series_names:
        path = project.patch_path(name)
        rec = applied.get(name)
        if rec is None:
            stale.append(
                f"patches/{name}: in the series but not applied (would be dropped)"
            )
        elif path.is_file() and sha256_bytes(path.read_bytes()) != rec.sha256:
            stale.append(f"patches/{name}: changed since it was applied")
    # An overlay file changed only in the repo is left alone by export (it is
    # not copied back); one changed on both sides would lose the repo's edit.
    for item in analysis.overlay_files if analysis.overlay_placed else []:
        if (
            item.tree_edited
            and item.repo is not None
            and item.repo != item.placed
            and not item.in_sync
        ):
            repo_file = overlay.repo_path(
                project.root, project.manifest.overlays, item.path
            )
            stale.append(
                f"{project.rel(repo_file)}: changed both in the repo and in the tree"
            )
    return stale
