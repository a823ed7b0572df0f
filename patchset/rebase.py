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
   the user resolved and staged, ``--skip`` drops the patch, ``--abort``
   removes the roll. A commit that git finds empty on a clean replay is
   dropped: that patch is already upstream. One the user drops (``--skip``,
   ``git rebase --skip``, a resolution that leaves nothing) is "dropped by
   you": git never drops a commit it stopped at, so every patch the rebase
   stopped at and that is gone at the end counts as the user's.
   The rebase pauses after every commit it replays (clean or resolved), and
   the Python files that step touched are checked (``mergecheck``: ruff's
   F811 and F821, a name defined twice or undefined, and a file that no
   longer parses), counting only what the step's parent did not have. Such a step stops the
   rebase as a conflict does; the user's staged fix is folded into the step's
   commit on ``--continue`` (``--continue --accept`` keeps the step as is).
4. On success the series is exported (``export``) into ``rolls/<VERSION>/``:
   ``upstream.toml`` pinned to the target (sha256 from the index, verified),
   with the build defaults' kernel wheels re-pinned to the target's (their
   sha256 from the index, checked before anything is downloaded: a device
   whose wheel the target lacks stops the roll unless
   ``--without-build-default DEVICE``), ``series`` and the patch files,
   names kept through their trailers. The
   pinned ``patches/`` series and its tree are never touched;
   ``python build.py --patches rolls/<VERSION> status|check|apply`` drive the roll.

Git mechanics live in ``gitrepo``; this module only decides what to run.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path

from . import build_defaults, check, identity, mergecheck, releases, state
from .errors import EXIT_OK, EXIT_PROBLEMS, PatchsetError
from .export import export
from .gitrepo import GitRepo
from .project import MANIFEST, ROLLS, SERIES, Project
from .series import decode, read_series
from .state import REBASE_STATE_FILE, RebaseState
from .tree import PRISTINE_TAG, Say, Tree, load_patches

BASE_TAG = "vmp-rebase/base"  # the pinned sdist, as is (the rebase's upstream)
SERIES_BRANCH = "vmp-rebase/series"  # the pinned series on it (what is rebased)


def roll_project(project: Project, version: str) -> Project:
    return Project(project.root, patches=f"{ROLLS}/{version}")


def roll_tree(tree: str, from_version: str, version: str) -> str:
    """The roll's tree beside the pinned one, named after ``version`` alone:
    third_party/vllm -> third_party/vllm-0.32.0; a roll of a roll,
    third_party/vllm-0.32.0 -> third_party/vllm-0.33.0."""
    base = tree.removesuffix(f"-{from_version}")
    return f"{base}-{version}"


def start(
    project: Project, version: str, say: Say, *, without: Collection[str] = ()
) -> int:
    """Roll the series onto ``version``; ``without``: devices whose build-default
    wheel may be missing on ``version`` (their old pins are kept, unverified)."""
    pinned = project.manifest
    if version == pinned.version:
        raise PatchsetError(f"the series is already pinned to {pinned.name} {version}")
    roll = roll_project(project, version)
    if roll.patches_dir.exists():
        raise PatchsetError(
            f"{roll.rel(roll.patches_dir)} exists: a rebase onto {version} was started "
            f"or finished. Go on: `{project.cmd(f'rebase --continue --onto {version}')}`; "
            f"start over: `{project.cmd(f'rebase --abort --onto {version}')}` (an unfinished "
            f"one), or delete {roll.rel(roll.patches_dir)} (a finished one)."
        )
    patches = load_patches(project)  # refuses a broken series before any download
    tree_rel = roll_tree(pinned.tree, pinned.version, version)
    tree_path = project.root / tree_rel
    for path in (tree_path, tree_path.with_name(tree_path.name + ".git")):
        if path.exists():
            raise PatchsetError(
                f"{project.rel(path)} exists; delete it (it is generated) and run again"
            )
    releases.sdist_info(version, pinned.name)  # the release exists, before its wheels
    pins = _build_default_pins(project, version, without)
    sdist, sha = releases.fetch_release(version, say, pinned.name)
    try:
        _write_manifest(project, roll, version, sdist.name, sha, tree_rel, pins)
        _say_pins(pins, version, say)
        tree = Tree(roll)
        say(
            f"rebase: [1/3] the pinned series ({len(patches)} patches) on "
            f"{pinned.name} {pinned.version}, in a scratch tree"
        )
        tree.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(
            prefix=".rebase-", dir=tree.path.parent
        ) as tmp:
            scratch = Tree(Project(project.root, project.patches, Path(tmp) / "vllm"))
            scratch.create_baseline(releases.fetch(pinned, say), say)
            scratch.apply(patches, force=False, say=lambda m: say(f"  {m}"))
            say(
                f"rebase: [2/3] pristine {pinned.name} {version} in "
                f"{roll.rel(tree.path)}"
            )
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
    RebaseState(
        pinned.version, version, [p.name for p in patches], project.patches
    ).save(tree.git_dir)
    say(
        f"rebase: [3/3] git rebase (3-way) of {len(patches)} patches + overlay onto "
        f"{version}, each step checked"
    )
    tree.repo.rebase_onto(PRISTINE_TAG, BASE_TAG, SERIES_BRANCH, pause_after_each=True)
    return _drive(project, roll, tree, say)


def continue_(
    project: Project, version: str | None, say: Say, *, accept: bool = False
) -> int:
    roll, tree, st = _in_progress(project, version)
    repo = tree.repo
    unmerged = repo.unmerged_files()
    if unmerged:
        raise PatchsetError(
            "still unresolved (conflict markers, not staged):\n"
            + "\n".join(f"  {roll.rel(tree.path)}/{p}" for p in unmerged)
            + f"\nResolve them, stage them (`{roll.git_cmd()} add <file>`), then run "
            f"`{project.cmd('rebase --continue')}` again."
        )
    paused = repo.rebase_paused()
    if accept and not (paused and st.flagged):
        raise PatchsetError(
            "--accept keeps a step the check after each patch stopped at; the rebase "
            f"is not stopped at one. Go on with `{project.cmd('rebase --continue')}`."
        )
    stopped = repo.rebase_stopped_at()
    if not repo.rebase_in_progress():
        pass  # git finished but the export did not (interrupted): just finish it
    elif paused:
        step = repo.head()
        if _fold_staged_fix(repo, say) and step:
            st.note(st.dropped, _key_of(repo, step))
            st.save(tree.git_dir)
        if accept:
            head = repo.head()
            say(f"rebase: --accept: {_describe(repo, head)} kept as it is")
            st.checked, st.flagged = head, None
            st.save(tree.git_dir)
    elif stopped and repo.index_matches_head():
        # the resolution left nothing of the patch: the user dropped it
        say(
            f"rebase: {_describe(repo, stopped)} is empty after the resolution: "
            "dropped (by you)"
        )
        st.note(st.dropped, _key_of(repo, stopped))
        st.save(tree.git_dir)
        repo.rebase_skip()
    else:
        repo.rebase_continue()
    return _drive(project, roll, tree, say)


def skip(project: Project, version: str | None, say: Say) -> int:
    """Drop the patch the rebase stopped at (a conflict, or the check) and go on."""
    roll, tree, st = _in_progress(project, version)
    repo = tree.repo
    if not repo.rebase_in_progress():
        raise PatchsetError(
            "git's rebase is over, so there is no patch to skip; finish the roll "
            f"with `{project.cmd('rebase --continue')}`"
        )
    if repo.rebase_paused():
        head = repo.head()
        if not st.flagged or head != st.flagged:
            raise PatchsetError(
                "the rebase is not stopped at a patch; go on with "
                f"`{project.cmd('rebase --continue')}`"
            )
        commit = head
    else:
        commit = repo.rebase_stopped_at()
        assert commit is not None
    key, what = _key_of(repo, commit), _describe(repo, commit)
    if key == identity.OVERLAY_TRAILER:
        raise PatchsetError(
            f"{what} holds the overlay, which the roll needs: resolve it and run "
            f"`{project.cmd('rebase --continue')}`"
        )
    if repo.rebase_paused():
        repo.discard_head()  # the step's commit, with any staged fix
        st.checked, st.flagged = repo.head(), None
    else:
        repo.rebase_skip()
    st.note(st.dropped, key)
    st.save(tree.git_dir)
    say(f"rebase: skipped {what}: dropped (by you)")
    return _drive(project, roll, tree, say)


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


def _drive(project: Project, roll: Project, tree: Tree, say: Say) -> int:
    """Take the rebase from where git stopped to its end, checking every step.

    At a pause (a commit was just replayed) the step is checked unless it
    already was; a step with findings, or a conflict, stops with what to do.
    """
    repo = tree.repo
    st = RebaseState.load(tree.git_dir)
    assert st is not None
    pristine = tree.load_state().pristine
    while repo.rebase_in_progress():
        if not repo.rebase_paused():
            stopped = repo.rebase_stopped_at()
            st.note(st.stopped_at, _key_of(repo, stopped) if stopped else None)
            st.save(tree.git_dir)
            _say_conflict(project, roll, tree, st, say)
            return EXIT_PROBLEMS
        head = repo.head()
        assert head is not None
        unstaged = _unstaged(repo)
        if head not in (st.checked, pristine):
            findings = _check_step(repo, head)
            if findings:
                st.flagged = head
                st.note(st.stopped_at, _key_of(repo, head))
                st.save(tree.git_dir)
                _say_flagged(project, roll, tree, st, head, findings, unstaged, say)
                return EXIT_PROBLEMS
            st.checked, st.flagged = head, None
            st.save(tree.git_dir)
        if unstaged:
            raise PatchsetError(
                f"{roll.rel(tree.path)} has edits that are not staged:\n"
                + "\n".join(f"  {roll.rel(tree.path)}/{p}" for p in unstaged)
                + f"\nStage them (`{roll.git_cmd()} add <file>`) to fold them into "
                f"{_describe(repo, head)}, or drop them (`{roll.git_cmd()} checkout -- "
                f"<file>`); then run `{project.cmd('rebase --continue')}`."
            )
        repo.rebase_continue()
    return _finish(project, roll, tree, say)


def _check_step(repo: GitRepo, head: str) -> list[mergecheck.Finding]:
    """``mergecheck`` on every .py file the replayed commit ``head`` touched."""
    findings: list[mergecheck.Finding] = []
    for path in repo.changed_files(head):
        new = repo.file_at(head, path) if path.endswith(".py") else None
        if new is None:  # not Python, or deleted by the step
            continue
        findings += mergecheck.check_step(
            path, decode(new), new_base=_text(repo.file_at(f"{head}^", path))
        )
    return findings


def _step_key(message: str) -> str | None:
    if identity.is_overlay(message):
        return identity.OVERLAY_TRAILER
    return identity.patch_name_of(message)


def _key_of(repo: GitRepo, commit: str) -> str | None:
    """The series step (patch name, or the overlay) a commit is."""
    return _step_key(repo.message(commit))


def _text(data: bytes | None) -> str | None:
    return None if data is None else decode(data)


def _unstaged(repo: GitRepo) -> list[str]:
    """Tracked files with edits in the work tree that are not staged."""
    return sorted(e.path for e in repo.status() if not e.untracked and e.code[1] != " ")


def _fold_staged_fix(repo: GitRepo, say: Say) -> bool:
    """At a pause: the staged fix goes into the step's commit, or drops an
    emptied one (True: the step was dropped)."""
    if repo.index_matches_head():
        return False
    head = repo.head()
    assert head is not None
    what = _describe(repo, head)
    if repo.index_matches(f"{head}^"):
        repo.drop_head()
        say(f"rebase: {what} is empty after the fix: dropped (by you)")
        return True
    repo.amend_head()
    say(f"rebase: the staged fix is now part of {what}")
    return False


def _say_conflict(
    project: Project, roll: Project, tree: Tree, st: RebaseState, say: Say
) -> None:
    repo = tree.repo
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
        f"  3. `{project.cmd('rebase --continue')}` (an empty result drops the patch)\n"
        f"Drop the patch (not needed on {st.onto}): `{project.cmd('rebase --skip')}`.\n"
        f"Give up: `{project.cmd('rebase --abort')}`."
    )


def _say_flagged(
    project: Project,
    roll: Project,
    tree: Tree,
    st: RebaseState,
    head: str,
    findings: list[mergecheck.Finding],
    unstaged: list[str],
    say: Say,
) -> None:
    where = roll.rel(tree.path)
    lines = "\n".join(f"  {where}/{f.describe()}" for f in findings)
    pending = (
        "Edited but not staged (the check reads the commit, so stage them):\n"
        + "\n".join(f"  {where}/{p}" for p in unstaged)
        + "\n"
        if unstaged
        else ""
    )
    say(
        f"rebase: stopped after {_describe(tree.repo, head)}: git merged it onto "
        f"{project.manifest.name} {st.onto} without a conflict, but the result is wrong:\n"
        f"{lines}\n{pending}"
        "To go on:\n"
        f"  1. edit those files in {where} so the patch does what it did on "
        f"{st.from_version} (`{roll.git_cmd()} show HEAD` shows the step as merged)\n"
        f"  2. `{roll.git_cmd()} add <file>` for each\n"
        f"  3. `{project.cmd('rebase --continue')}` (the fix goes into the patch; a fix "
        "that leaves nothing of it drops the patch)\n"
        "If the code is right as it is (say, the name is inherited now): "
        f"`{project.cmd('rebase --continue --accept')}`.\n"
        f"Drop the patch (not needed on {st.onto}): `{project.cmd('rebase --skip')}`.\n"
        f"Give up: `{project.cmd('rebase --abort')}`."
    )


def _finish(project: Project, roll: Project, tree: Tree, say: Say) -> int:
    """git is done: record the new chain, export the roll, drop the rebase's refs."""
    repo = tree.repo
    st = RebaseState.load(tree.git_dir)
    assert st is not None
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
            tree_state.patches.append(
                state.AppliedPatch(name, "", commit, repo.subject(commit))
            )
    state.save(tree.git_dir, tree_state)
    kept = [p.name for p in tree_state.patches]
    missing = [n for n in st.patches if n not in kept]
    # git drops a commit by itself only when it is empty on a clean replay;
    # one it stopped at (or build.py dropped) went because the user said so.
    by_user = [n for n in missing if n in st.dropped or n in st.stopped_at]
    upstream_ = [n for n in missing if n not in by_user]
    export(tree, force=True, say=lambda m: say(f"  {m}"))
    repo.delete_refs([f"refs/heads/{SERIES_BRANCH}", f"refs/tags/{BASE_TAG}"])
    (tree.git_dir / REBASE_STATE_FILE).unlink()
    dropped = ""
    if upstream_:
        dropped += (
            f"  dropped as already upstream: {', '.join(upstream_)} (empty when git "
            "replayed it cleanly)\n"
        )
    if by_user:
        dropped += (
            f"  dropped by you: {', '.join(by_user)} (skipped, or resolved to "
            "nothing)\n"
        )
    say(
        f"rebase: done: {len(kept)} of {len(st.patches)} patches carried onto "
        f"{project.manifest.name} {st.onto}.\n{dropped}"
        f"The new series: {roll.rel(roll.patches_dir)}/ (upstream.toml pinned to "
        f"{st.onto} with its sha256); its tree: {roll.rel(tree.path)}.\n"
        f"Use it: `python build.py --patches {roll.patches} status|check|apply`. "
        f"The {st.from_version} series in {st.from_patches}/ is unchanged. It becomes "
        f'a supported release with a [release."{st.onto}"] table in releases.toml '
        '(status "checked", or "tested" with its requirements and virtualenv).'
    )
    return _check_roll_overrides(project, roll, say)


def _check_roll_overrides(project: Project, roll: Project, say: Say) -> int:
    """The rolled overlay's subclasses against the new release, compared with the
    release the series came from: a merge can be clean while an override of ours
    no longer overrides anything, or an abstract method is left undefined."""
    result = check.run_check(
        roll, against=project, against_role="the series it came from"
    )
    problems = [p for p in result.problems if p.kind == "override"]
    for p in result.warnings:
        if p.kind == "override":
            say(f"warning [override]: {p.message}")
    if not problems:
        return EXIT_OK
    for p in problems:
        say(f"problem [override]: {p.message}")
    say(
        f"rebase: the roll is written, but {len(problems)} override problem(s) remain "
        f"on {roll.manifest.name} {roll.manifest.version}: port the connector (or the "
        f"roll's patches), then `{roll.cmd('check')}` re-checks."
    )
    return EXIT_PROBLEMS


def _describe(repo, commit: str) -> str:
    message = repo.message(commit)
    name = identity.patch_name_of(message)
    subject = repo.subject(commit)
    if identity.is_overlay(message):
        return f"the overlay commit ({subject})"
    return f"patch {name} ({subject})" if name else f"commit {commit[:12]} ({subject})"


def _in_progress(
    project: Project, version: str | None
) -> tuple[Project, Tree, RebaseState]:
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
            f"`{project.cmd('rebase --onto VERSION')}`"
        )
    if len(found) > 1:
        raise PatchsetError(
            "more than one rebase is under way ("
            + ", ".join(st.onto for _, _, st in found)
            + "); say which with --onto VERSION"
        )
    return found[0]


def _manifest_rel(project: Project) -> Path:
    return Path(project.patches) / MANIFEST


def _build_default_pins(
    project: Project, version: str, without: Collection[str]
) -> list[build_defaults.Repin]:
    """The build-default wheels of ``version`` for every device the series has
    defaults for (sha256 from the index); refuses when one has no wheel there."""
    where = _manifest_rel(project).as_posix()
    policy = build_defaults.load_policy(project.root, where)
    if policy is None:
        if without:
            raise PatchsetError(
                f"--without-build-default: {where} has no [build_defaults] to roll"
            )
        return []
    pins, missing = build_defaults.repin(
        policy, version, lambda name, v: releases.wheel_files(v, name), without
    )
    if missing:
        old = project.manifest.version
        lines = [
            f"  [build_defaults.{p.device}] pins {p.old.requirement}: the index "
            f"({releases.index_location(p.old.name)}) has no {p.requirement} wheel "
            f"for {', '.join(sorted(p.old.arches()))}"
            for p in missing
        ]
        flags = " ".join(f"--without-build-default {p.device}" for p in missing)
        raise PatchsetError(
            f"refusing to roll onto {project.manifest.name} {version}: {where} has "
            "build defaults (precompiled kernels for `pip install -e`) that this "
            "release cannot re-pin:\n"
            + "\n".join(lines)
            + f"\nThe roll's tree would build with the {old} kernels. Wait until the "
            "wheel is published, or roll without it: "
            f"`{project.cmd(f'rebase --onto {version} {flags}')}` (its table then keeps the {old} pins, marked "
            "verified = false)."
        )
    return pins


def _say_pins(pins: list[build_defaults.Repin], version: str, say: Say) -> None:
    for pin in pins:
        if pin.repinned:
            gone = (
                f"; no wheel for {', '.join(pin.missing_arches)}"
                if pin.missing_arches
                else ""
            )
            say(
                f"rebase: build defaults [{pin.device}]: {pin.requirement}, "
                f"{len(pin.sha256)} wheels pinned by their sha256 on the index{gone}"
            )
        else:
            say(
                f"rebase: build defaults [{pin.device}]: NOT re-pinned "
                f"(--without-build-default {pin.device}): keeps {pin.old.requirement}, "
                f"marked verified = false; a {pin.device} build of the roll uses the "
                f"{pin.old.version} kernels on {version}"
            )


def _write_manifest(
    project: Project,
    roll: Project,
    version: str,
    sdist: str,
    sha: str,
    tree: str,
    pins: list[build_defaults.Repin],
) -> None:
    """The pinned manifest re-pinned ([upstream], build-default wheels); comments
    and the rest kept."""
    text = (project.patches_dir / MANIFEST).read_text(encoding="utf-8")
    values = {"version": version, "sdist": sdist, "sha256": sha, "tree": tree}
    for key, value in values.items():
        text, n = re.subn(
            rf'^{key}\s*=\s*"[^"]*"',
            f'{key} = "{value}"',
            text,
            count=1,
            flags=re.MULTILINE,
        )
        if n != 1:
            raise PatchsetError(
                f"{project.rel(project.patches_dir / MANIFEST)}: no {key} = line"
            )
    text = build_defaults.repinned_text(text, version, pins)
    text = re.sub(r"\A# Rolled by [^\n]*\n", "", text)  # a roll of a roll: say it once
    roll.patches_dir.mkdir(parents=True)
    (roll.patches_dir / MANIFEST).write_text(
        f"# Rolled by `build.py rebase --onto {version}` from the "
        f"{project.manifest.version} series ({project.patches}/).\n" + text,
        encoding="utf-8",
    )
    # Read back: the roll must pin exactly what was decided.
    policy = build_defaults.load_policy(roll.root, _manifest_rel(roll))
    for pin in pins:
        got = policy.wheels.get(pin.device) if policy else None
        want = pin.sha256 if pin.repinned else pin.old.sha256
        if got is None or got.requirement != pin.requirement or got.sha256 != want:
            raise PatchsetError(
                f"could not re-pin [build_defaults.{pin.device}] in "
                f"{roll.rel(roll.patches_dir / MANIFEST)}: write {pin.requirement} and "
                "its sha256 lines by hand"
            )
    header = read_series(project.series_path).header
    (roll.patches_dir / SERIES).write_text("\n".join(header) + "\n" if header else "")


def _remove_roll(roll: Project, tree_path: Path) -> None:
    """The roll's tree, its git dir (beside it) and rolls/<version>: nothing else."""
    for path in (
        tree_path,
        tree_path.with_name(tree_path.name + ".git"),
        roll.patches_dir,
    ):
        if path.exists():
            shutil.rmtree(path)
    rolls = roll.patches_dir.parent
    if rolls.is_dir() and not any(rolls.iterdir()):
        rolls.rmdir()
