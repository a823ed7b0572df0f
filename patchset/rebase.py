"""``build.py rebase --onto VERSION``: carry the series to another upstream release.

Electron's roll, with git doing the 3-way merges:

1. The pinned series is built as commits by the normal ``apply`` (zero fuzz,
   ``Patch-Filename:`` trailers, overlay commit last) in a scratch tree.
2. The roll's own tree, ``<tree>-<VERSION>`` (e.g. ``third_party/vllm-0.19.0``
   with its git dir beside it), starts as the pristine target sdist, tagged
   ``vmp-pristine`` like any tree build.py makes.
3. The scratch commits are fetched into it and ``git rebase --onto``-ed from the
   pinned pristine onto the target pristine. A commit that conflicts stops the
   rebase with conflict markers in the roll's tree; ``--continue`` goes on after
   the user resolved and staged, ``--abort`` removes the roll. A commit that
   becomes empty is dropped: that patch is already upstream (reported).
4. On success the series is exported (``export``) into ``rolls/<VERSION>/``:
   ``upstream.toml`` pinned to the target (sha256 from the index, verified),
   ``series`` and the patch files, names kept through their trailers. The
   pinned ``patches/`` series and its tree are never touched;
   ``python build.py --patches rolls/<VERSION> status|check|apply`` drive the roll.

Git mechanics live in ``gitrepo``; this module only decides what to run.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from . import identity, releases, state, upstream
from .errors import EXIT_OK, EXIT_PROBLEMS, PatchsetError
from .export import export
from .project import MANIFEST, SERIES, Project
from .series import read_series
from .tree import PRISTINE_TAG, Say, Tree, load_patches

ROLLS = "rolls"
STATE_FILE = "patchset-rebase.json"
BASE_TAG = "vmp-rebase/base"  # the pinned sdist, as is (the rebase's upstream)
SERIES_BRANCH = "vmp-rebase/series"  # the pinned series on it (what is rebased)


@dataclass
class RebaseState:
    """Kept in the roll's git dir while a rebase is under way."""

    from_version: str
    onto: str
    patches: list[str]  # the pinned series, in order

    def save(self, git_dir: Path) -> None:
        (git_dir / STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, git_dir: Path) -> RebaseState | None:
        path = git_dir / STATE_FILE
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))


def roll_project(project: Project, version: str) -> Project:
    return Project(project.root, patches=f"{ROLLS}/{version}")


def start(project: Project, version: str, say: Say) -> int:
    pinned = project.manifest
    if version == pinned.version:
        raise PatchsetError(f"the series is already pinned to {pinned.name} {version}")
    roll = roll_project(project, version)
    if roll.patches_dir.exists():
        raise PatchsetError(
            f"{roll.rel(roll.patches_dir)} exists: a rebase onto {version} was started "
            f"or finished. Go on: `python build.py rebase --continue --onto {version}`; "
            f"start over: `python build.py rebase --abort --onto {version}` (an unfinished "
            f"one), or delete {roll.rel(roll.patches_dir)} (a finished one)."
        )
    patches = load_patches(project)  # refuses a broken series before any download
    tree_rel = f"{pinned.tree}-{version}"
    tree_path = project.root / tree_rel
    for path in (tree_path, tree_path.with_name(tree_path.name + ".git")):
        if path.exists():
            raise PatchsetError(
                f"{project.rel(path)} exists; delete it (it is generated) and run again"
            )
    sdist, sha = releases.fetch_release(version, say, pinned.name)
    try:
        _write_manifest(project, roll, version, sdist.name, sha, tree_rel)
        tree = Tree(roll)
        say(f"rebase: [1/3] the pinned series ({len(patches)} patches) on {pinned.name} {pinned.version}, in a scratch tree")
        tree.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".rebase-", dir=tree.path.parent) as tmp:
            scratch = Tree(Project(project.root, project.patches, Path(tmp) / "vllm"))
            scratch.create_baseline(upstream.fetch(pinned, say), say)
            scratch.apply(patches, force=False, say=lambda m: say(f"  {m}"))
            say(f"rebase: [2/3] pristine {pinned.name} {version} in {roll.rel(tree.path)}")
            tree.create_baseline(sdist, say)
            tree.repo.fetch_refs(
                scratch.git_dir,
                [
                    f"+refs/heads/main:refs/heads/{SERIES_BRANCH}",
                    f"+refs/tags/{PRISTINE_TAG}:refs/tags/{BASE_TAG}",
                ],
            )
    except BaseException:
        _remove_roll(roll, tree_path)
        raise
    RebaseState(pinned.version, version, [p.name for p in patches]).save(tree.git_dir)
    say(f"rebase: [3/3] git rebase (3-way) of {len(patches)} patches + overlay onto {version}")
    tree.repo.rebase_onto(PRISTINE_TAG, BASE_TAG, SERIES_BRANCH)
    return _after_rebase(project, roll, tree, say)


def continue_(project: Project, version: str | None, say: Say) -> int:
    roll, tree, _ = _in_progress(project, version)
    repo = tree.repo
    unmerged = repo.unmerged_files()
    if unmerged:
        raise PatchsetError(
            "still unresolved (conflict markers, not staged):\n"
            + "\n".join(f"  {roll.rel(tree.path)}/{p}" for p in unmerged)
            + f"\nResolve them, stage them (`{roll.git_cmd()} add <file>`), then run "
            f"`python build.py rebase --continue` again."
        )
    stopped = repo.rebase_stopped_at()
    if not repo.rebase_in_progress():
        pass  # git finished but the export did not (interrupted): just finish it
    elif stopped and repo.index_matches_head():
        # the resolution left nothing of the patch: it is upstream now
        say(f"rebase: {_describe(repo, stopped)} is empty after the resolution: dropped")
        repo.rebase_skip()
    else:
        repo.rebase_continue()
    return _after_rebase(project, roll, tree, say)


def abort(project: Project, version: str | None, say: Say) -> int:
    roll, tree, st = _in_progress(project, version)
    tree.repo.rebase_abort()
    _remove_roll(roll, tree.path)
    say(
        f"rebase onto {st.onto} aborted: removed {roll.rel(tree.path)}, its git dir and "
        f"{roll.rel(roll.patches_dir)}; the pinned series ({project.rel(project.patches_dir)}) "
        "was never touched"
    )
    return EXIT_OK


# -- internals --------------------------------------------------------------


def _after_rebase(project: Project, roll: Project, tree: Tree, say: Say) -> int:
    repo = tree.repo
    st = RebaseState.load(tree.git_dir)
    assert st is not None
    if repo.rebase_in_progress():
        stopped = repo.rebase_stopped_at()
        what = _describe(repo, stopped) if stopped else "a commit"
        unmerged = repo.unmerged_files()
        files = "\n".join(f"  {roll.rel(tree.path)}/{p}" for p in unmerged) or "  (none)"
        say(
            f"rebase: stopped: {what} does not apply to {project.manifest.name} {st.onto}.\n"
            f"Conflicting files (markers <<<<<<< ======= >>>>>>> in them):\n{files}\n"
            "To go on:\n"
            f"  1. edit those files in {roll.rel(tree.path)} so the patch does what it did on "
            f"{st.from_version} (`{roll.git_cmd()} diff` shows the conflict; "
            f"`{roll.git_cmd()} show REBASE_HEAD` the original patch)\n"
            f"  2. `{roll.git_cmd()} add <file>` for each\n"
            "  3. `python build.py rebase --continue` (an empty result drops the patch)\n"
            "Give up: `python build.py rebase --abort`."
        )
        return EXIT_PROBLEMS
    repo.set_branch("main")
    tree_state = tree.load_state()
    chain = repo.first_parent_commits(tree_state.pristine)
    messages = repo.messages(tree_state.pristine)
    tree_state.patches = []
    tree_state.overlay_commit = None
    for commit in chain:
        message = messages[commit]
        name = identity.patch_name_of(message)
        if identity.is_overlay(message):
            tree_state.overlay_commit = commit
        elif name:
            tree_state.patches.append(state.AppliedPatch(name, "", commit, repo.subject(commit)))
    state.save(tree.git_dir, tree_state)
    kept = [p.name for p in tree_state.patches]
    dropped = [n for n in st.patches if n not in kept]
    export(tree, force=True, say=lambda m: say(f"  {m}"))
    repo.delete_refs([f"refs/heads/{SERIES_BRANCH}", f"refs/tags/{BASE_TAG}"])
    (tree.git_dir / STATE_FILE).unlink()
    say(
        f"rebase: done: {len(kept)} of {len(st.patches)} patches carried onto "
        f"{project.manifest.name} {st.onto}"
        + (f"; dropped as already upstream: {', '.join(dropped)}" if dropped else "")
        + f".\nThe new series: {roll.rel(roll.patches_dir)}/ (upstream.toml pinned to "
        f"{st.onto} with its sha256); its tree: {roll.rel(tree.path)}.\n"
        f"Use it: `python build.py --patches {roll.patches} status|check|apply`. "
        f"The {st.from_version} series in {project.rel(project.patches_dir)}/ is unchanged."
    )
    return EXIT_OK


def _describe(repo, commit: str) -> str:
    message = repo.messages(f"{commit}^", commit).get(commit, "")
    name = identity.patch_name_of(message)
    subject = repo.subject(commit)
    if identity.is_overlay(message):
        return f"the overlay commit ({subject})"
    return f"patch {name} ({subject})" if name else f"commit {commit[:12]} ({subject})"


def _in_progress(project: Project, version: str | None) -> tuple[Project, Tree, RebaseState]:
    rolls = project.root / ROLLS
    if version:
        candidates = [version]
    elif rolls.is_dir():
        candidates = sorted(p.name for p in rolls.iterdir())
    else:
        candidates = []
    found = []
    for v in candidates:
        roll = roll_project(project, v)
        if not (roll.patches_dir / MANIFEST).is_file():
            continue
        tree = Tree(roll)
        st = RebaseState.load(tree.git_dir)
        if st is not None:
            found.append((roll, tree, st))
    if not found:
        where = f"onto {version}" if version else f"under {ROLLS}/"
        raise PatchsetError(
            f"no rebase {where} is under way; start one with "
            "`python build.py rebase --onto VERSION`"
        )
    if len(found) > 1:
        raise PatchsetError(
            "more than one rebase is under way ("
            + ", ".join(st.onto for _, _, st in found)
            + "); say which with --onto VERSION"
        )
    return found[0]


def _write_manifest(
    project: Project, roll: Project, version: str, sdist: str, sha: str, tree: str
) -> None:
    """The pinned manifest with [upstream] re-pinned; comments and the rest kept."""
    text = (project.patches_dir / MANIFEST).read_text(encoding="utf-8")
    values = {"version": version, "sdist": sdist, "sha256": sha, "tree": tree}
    for key, value in values.items():
        text, n = re.subn(
            rf'^{key}\s*=\s*"[^"]*"', f'{key} = "{value}"', text, count=1, flags=re.MULTILINE
        )
        if n != 1:
            raise PatchsetError(f"{project.rel(project.patches_dir / MANIFEST)}: no {key} = line")
    roll.patches_dir.mkdir(parents=True)
    (roll.patches_dir / MANIFEST).write_text(
        f"# Rolled by `build.py rebase --onto {version}` from the "
        f"{project.manifest.version} series.\n" + text,
        encoding="utf-8",
    )
    header = read_series(project.series_path).header
    (roll.patches_dir / SERIES).write_text("\n".join(header) + "\n" if header else "")


def _remove_roll(roll: Project, tree_path: Path) -> None:
    """The roll's tree, its git dir (beside it) and rolls/<version>: nothing else."""
    for path in (tree_path, tree_path.with_name(tree_path.name + ".git"), roll.patches_dir):
        if path.exists():
            shutil.rmtree(path)
    rolls = roll.patches_dir.parent
    if rolls.is_dir() and not any(rolls.iterdir()):
        rolls.rmdir()
