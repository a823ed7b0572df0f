"""The subcommands behind ``build.py``: run, print, return an exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import build_defaults, releasecheck, releases
from .check import run_check
from .errors import EXIT_OK, EXIT_PROBLEMS, PatchsetError
from .export import export
from .gitrepo import git_version
from .project import MANIFEST, Project
from .status import compute_status
from .tree import Tree, load_patches


def say(message: str) -> None:
    print(message, flush=True)


def fetch(project: Project) -> int:
    releases.fetch(project.manifest, say)
    return EXIT_OK


def apply(project: Project, *, force: bool) -> int:
    git_version()
    tree = Tree(project)
    tree.check_layout()
    patches = load_patches(project)  # refuse a broken series before touching the tree
    if not tree.present():
        tree.create_baseline(releases.fetch(project.manifest, say), say)
    tree.apply(patches, force=force, say=say)
    # what `pip install -e <tree>` builds with (device, precompiled kernels)
    build_defaults.record(
        project.root,
        tree.path,
        project.git_dir,
        say,
        Path(project.patches) / MANIFEST,
        release=project.manifest.version,
    )
    return EXIT_OK


def reset(project: Project, *, force: bool) -> int:
    git_version()
    tree = Tree(project)
    tree.check_layout()
    if not tree.present():
        tree.create_baseline(releases.fetch(project.manifest, say), say)
        say(f"{project.rel(tree.path)} is the pristine tree")
        return EXIT_OK
    tree.reset(force=force, say=say)
    return EXIT_OK


def export_(project: Project, *, force: bool) -> int:
    git_version()
    tree = Tree(project)
    tree.check_layout()
    if not tree.present():
        say(
            f"{project.rel(tree.path)} does not exist; run `{project.cmd('apply')}` first"
        )
        return EXIT_PROBLEMS
    export(tree, force=force, say=say)
    return EXIT_OK


def status(project: Project, *, as_json: bool) -> int:
    if (project.tree).is_dir():
        git_version()
    data = compute_status(project)
    code = EXIT_OK if data["in_sync"] else EXIT_PROBLEMS
    if as_json:
        print(json.dumps({**data, "exit_code": code}, indent=2))
    else:
        print(render_status(data))
    return code


def check(
    project: Project,
    *,
    as_json: bool,
    release: str | None = None,
    since: str | None = None,
    versions: str | None = None,
) -> int:
    if release or since or versions:
        report = releasecheck.run(
            project,
            release=release,
            since=since,
            versions=versions,
            say=lambda m: print(m, file=sys.stderr, flush=True),
        )
        print(json.dumps(report, indent=1) if as_json else releasecheck.render(report))
        return report["exit_code"]
    result = run_check(project)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return result.exit_code
    for problem in result.problems:
        print(f"problem [{problem.kind}]: {problem.message}")
    for warning in result.warnings:
        print(f"warning [{warning.kind}]: {warning.message}")
    if result.unchecked:
        print(
            f"not checked (after the first patch that does not apply): {', '.join(result.unchecked)}"
        )
    if result.cannot_run:
        print(f"error: {result.cannot_run}", file=sys.stderr)
    elif result.problems:
        print(f"check: {len(result.problems)} problems")
    else:
        print(
            f"check: ok: {len(result.applied)} patches apply to the pristine "
            f"{project.manifest.name} {project.manifest.version} with zero fuzz; "
            "headers, series and overlay are fine"
        )
    if result.overrides is not None and not result.cannot_run:
        print(f"overrides: {result.overrides.summary()}")
    return result.exit_code


def rebase(
    project: Project,
    *,
    onto: str | None,
    cont: bool,
    abort: bool,
    accept: bool = False,
    skip: bool = False,
    without: list[str] | None = None,
) -> int:
    from . import rebase as rebase_

    if accept and not cont:
        raise PatchsetError("--accept only goes with --continue")
    if without and (cont or abort or skip):
        raise PatchsetError(
            "--without-build-default goes with starting a rebase (--onto VERSION)"
        )
    git_version()
    if cont:
        return rebase_.continue_(project, onto, say, accept=accept)
    if abort:
        return rebase_.abort(project, onto, say)
    if skip:
        return rebase_.skip(project, onto, say)
    if not onto:
        raise PatchsetError(
            "rebase needs --onto VERSION (or --continue / --skip / --abort)"
        )
    return rebase_.start(project, onto, say, without=without or ())


def range_diff(
    project: Project, *, against: str, as_json: bool, expected: bool = False
) -> int:
    from . import rangediff

    if as_json and expected:
        raise PatchsetError("--expected compares the text report: leave out --json")
    roll, pinned, entries = rangediff.run(project, against)
    if as_json:
        print(json.dumps(rangediff.to_json(roll, pinned, entries), indent=2))
        return EXIT_OK
    text = rangediff.render(roll, pinned, entries)
    if not expected:
        print(text)
        return EXIT_OK
    path = roll.patches_dir / rangediff.EXPECTED
    write = f"`{roll.cmd(f'range-diff --against {against}')} > {roll.rel(path)}`"
    if not path.is_file():
        raise PatchsetError(
            f"{roll.rel(path)} does not exist: review the range-diff, then write it: "
            f"{write}"
        )
    diff = rangediff.unexpected(path.read_text(), text, roll.rel(path))
    if not diff:
        print(f"range-diff: {roll.patches} against {against}: the expected deltas")
        return EXIT_OK
    print("\n".join(diff))
    print(
        f"range-diff: the deltas of {roll.patches} against {against} are not the "
        f"expected ones ({roll.rel(path)}): review the difference above; if it is "
        f"right, write them: {write}"
    )
    return EXIT_PROBLEMS


_HINTS = {
    "changed": "patch file changed since it was applied: run apply",
    "pending": "not applied: run apply",
    "amended": "its commit was changed in the tree (amend, fixup, rebase): run export",
    "missing": "listed in the series but the file does not exist",
    "applied, file missing": "applied, but the file is gone from patches/",
}


def render_status(data: dict) -> str:
    up, tree = data["upstream"], data["tree"]
    lines = [
        f"upstream: {up['name']} {up['version']}, sdist {up['sdist']} ({up['sdist_state']})",
    ]
    if not tree["present"]:
        lines.append(f"tree:     {tree['path']} is not there: run `{tree['build']}`")
    else:
        note = (
            ""
            if tree.get("built_from_pinned_sdist", True)
            else " (built from another sdist: run apply)"
        )
        lines.append(
            f"tree:     {tree['path']} (git dir {tree['git_dir']}), HEAD {(tree.get('head') or '')[:12]}{note}"
        )
    for problem in data["series_problems"]:
        lines.append(f"series:   {problem}")
    rows = data["patches"]
    rb = data.get("rebase")
    if rb:
        lines.append(
            f"rebase:   under way: the {rb['from_version']} series ({rb['from_patches']}/, "
            f"{rb['patches']} patches) is being carried onto {rb['onto']}; this "
            "folder's series is written when the rebase ends. Go on: "
            f"`{rb['go_on']}`; give up: `{rb['give_up']}`"
        )
        return "\n".join(lines)
    applied = sum(1 for r in rows if r["state"] == "applied")
    lines.append(f"patches:  {applied} of {len(rows)} applied")
    for r in rows:
        hint = _HINTS.get(r["state"])
        lines.append(
            f"  {r['state']:<8} {r['name']}  {r.get('subject') or ''}"
            + (f"  ({hint})" if hint else "")
        )
    for r in data["removed"]:
        lines.append(
            f"  removed  {r['name']}  (applied, no longer in the series: run apply)"
        )
    if data["out_of_order"]:
        lines.append("  the applied order differs from the series: run apply")
    ov = data["overlay"]
    if tree["present"]:
        if not ov["placed"]:
            lines.append("overlay:  not placed (run apply)")
        elif ov["in_sync"]:
            lines.append("overlay:  in sync with the repo folders")
        else:
            if ov["repo_changed"]:
                lines.append(
                    f"overlay:  changed in the repo, not yet in the tree (run apply): {', '.join(ov['repo_changed'])}"
                )
            if ov["tree_edited"]:
                lines.append(
                    f"overlay:  edited in the tree, not copied back (run export): {', '.join(ov['tree_edited'])}"
                )
    if data.get("confinement"):
        lines.append("paths leaving the tree (apply refuses them; fix and run check):")
        lines += [f"  {v['message']}" for v in data["confinement"]]
    if data["uncaptured"]:
        lines.append("uncaptured edits (no patch holds them):")
        lines += [f"  {e['path']}  ({e['why']})" for e in data["uncaptured"]]
    elif tree["present"]:
        lines.append("uncaptured edits: none")
    lines.append("status: in sync" if data["in_sync"] else "status: out of sync")
    return "\n".join(lines)
