#!/usr/bin/env python3
"""Patch-set manager for the pinned vLLM tree.

    python build.py fetch            get (the index's file, no pip) and verify the pinned sdist
    python build.py apply [--force]  pristine tree + patches/series + overlay into third_party/vllm
    python build.py status [--json]  applied / changed / pending patches, uncaptured edits
    python build.py export [--force] tree commits -> patches/*.patch + series, overlay copied back
    python build.py check [--json]   CI: series, headers, zero-fuzz apply on the sdist, overlay,
                                     and the overlay's overrides of upstream methods
    python build.py check --release V | --since V | --versions A,B [--json]
                                     the series (GNU patch's verdict per patch), the overlay,
                                     its imports and overrides on newer releases
    python build.py reset [--force]  back to the pristine tree
    python build.py compat [...]     the old name of check --since (default: the pin)
    python build.py rebase --onto V [--without-build-default DEVICE]
                                     3-way rebase of the series onto release V -> rolls/V/
    python build.py rebase --continue [--accept] | --skip | --abort
    python build.py range-diff [--patches rolls/V] [--against DIR] [--expected] [--json]
                                     the rolled series against the pinned one, patch by
                                     patch: same / changed (interdiff) / only in one;
                                     --expected: fail unless the deltas are the reviewed
                                     ones (rolls/V/range-diff.expected)
    python build.py --patches rolls/V COMMAND   any command on a rolled series
    python build.py --vllm V COMMAND            any command on supported release V's series
                                                (its folder in releases.toml)

Exit codes: 0 ok, 1 problems found, 2 could not run.
The project root is this file's directory, or --root / $VMP_ROOT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    from patchset import commands, release_index
    from patchset.errors import EXIT_CANNOT_RUN, PatchsetError
    from patchset.project import PATCHES, Project
except ImportError as _exc:  # GitPython or unidiff not installed
    if _exc.name not in ("git", "unidiff"):
        raise
    print(
        f"error: {_exc}. build.py needs GitPython and unidiff: "
        f"{sys.executable} -m pip install GitPython unidiff",
        file=sys.stderr,
    )
    sys.exit(2)


def release_version(text: str) -> str:
    """An upstream release version (argparse type): refused here, with exit code 2,
    rather than as a traceback deep in a command."""
    from packaging.version import InvalidVersion, Version

    try:
        Version(text)
    except InvalidVersion:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a release version (like 0.19.0)"
        ) from None
    return text.strip()


def release_versions(text: str) -> str:
    """Comma-separated release versions (argparse type)."""
    for v in text.split(","):
        if v.strip():
            release_version(v.strip())
    return text


EXIT_CODES = "Exit codes: 0 ok, 1 {one}, 2 could not run ({two})."
# Each subcommand's help page: what it does, what it downloads, its exit codes.
PAGES = {
    "fetch": (
        "Download the pinned vLLM sdist named in <patches>/upstream.toml from the "
        "package index (the index's file, not pip) into the cache ($VMP_CACHE_DIR, "
        "else ~/.cache/vllm-mooncake-patches) and verify its sha256. Downloads: that "
        "one file, unless it is cached and verified already.",
        "(never)",
        "no network, the index has no such file, or a sha256 mismatch",
    ),
    "apply": (
        "Build the tree (third_party/vllm, git-ignored; its git dir beside it): the "
        "pristine sdist, each patch of <patches>/series as one commit (zero fuzz), "
        "then the overlay (connector/ -> the tree) as one commit; record this "
        "machine's build defaults (device, precompiled-kernel wheel) for `pip install "
        "-e`. Refuses a tree holding edits no patch captures unless --force. "
        "Downloads: the pinned sdist, if not cached (as fetch).",
        "a patch does not apply, a series line is refused, or the tree holds "
        "uncaptured edits",
        "no series, a bad manifest, git missing, the sdist cannot be fetched",
    ),
    "status": (
        "Say which patches are applied, amended, changed, pending or missing, the "
        "overlay's sync, removed or reordered patches and uncaptured edits. "
        "Downloads nothing.",
        "the tree is not in sync with the series",
        "no series, a bad manifest, a tree build.py did not make",
    ),
    "export": (
        "Write the tree's commits back to <patches>/ (one file each, named by the "
        "commit's Patch-Filename trailer) and rewrite series; copy overlay files "
        "edited in the tree back to the project. Refuses uncommitted edits, merge "
        "commits and series lines naming files outside the folder. Downloads "
        "nothing.",
        "refused (the reason says what to do first)",
        "no series, a bad manifest, git missing",
    ),
    "check": (
        "CI's check, with no tree and no git: the series file, every patch header, "
        "paths leaving the tree, the overlay, the overridden upstream methods, and "
        "the series applied in memory with zero fuzz to the cached pinned sdist. "
        "Downloads nothing (run fetch first). With --release, --since or --versions: "
        "newer releases instead, as a grid: GNU patch's verdict on each patch "
        "(exact, offset, fuzz, already upstream, conflict, missing file; a "
        "conflicting hunk with the `git log -L` command that shows upstream's "
        "changes of its lines), overlay files colliding with upstream ones, vLLM "
        "names the overlay imports that are gone, the overrides. Downloads: the "
        "index's list of releases, each release's sdist and the pinned sdist "
        "(cached; sha256 from the index or the pin).",
        "a problem found (each one named, with what to do)",
        "no series, a bad manifest, the sdist not cached, a bad version, the index "
        "cannot be read",
    ),
    "reset": (
        "Put the tree back to the pristine sdist (tag vmp-pristine). Refuses a tree "
        "holding edits no patch captures unless --force. Downloads: the pinned "
        "sdist, if no tree exists yet and it is not cached.",
        "refused (uncaptured edits)",
        "a bad manifest, git missing, a tree build.py did not make",
    ),
    "compat": (
        "The old name of `check --since` (by default every release newer than the "
        "pin), `check --release` and `check --versions`: says so, then runs it. "
        "Downloads: as check --release.",
        "some release breaks the series",
        "no series, a bad version, the index cannot be read",
    ),
    "rebase": (
        "Carry the series onto another release: a 3-way git rebase of the patches "
        "and the overlay in a new tree, each step checked, writing the rolled series "
        "to rolls/<VERSION>/; stops at a conflict or a wrong merge with what to do "
        "(--continue, --skip, --abort). Downloads: the index's entry for VERSION "
        "(sdist sha256, build-default wheels' sha256) and its sdist.",
        "stopped at a conflict or a wrong merge (the message says what to do)",
        "the release does not exist, a build-default wheel is missing, no rebase "
        "under way (--continue), a bad version",
    ),
    "range-diff": (
        "Compare a rolled series with the pinned one, patch by patch: same, changed "
        "(with the interdiff), only in one of them. Downloads nothing.",
        "(never: differences are reported, not failed)",
        "a folder that is not a patch folder",
    ),
}


def subcommand(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand with its help page (PAGES)."""
    text, one, two = PAGES[name]
    return sub.add_parser(
        name,
        help=help,
        description=text,
        epilog=EXIT_CODES.format(one=one, two=two),
    )


def releases_asked(p: argparse.ArgumentParser) -> None:
    """check's options: --json, and the newer releases to check the series on."""
    p.add_argument("--json", action="store_true", help="machine-readable output")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--release", metavar="V", type=release_version, help="a release, e.g. 0.19.0"
    )
    which.add_argument(
        "--since",
        metavar="V",
        type=release_version,
        help="every final release on the index newer than V",
    )
    which.add_argument(
        "--versions",
        metavar="A,B",
        type=release_versions,
        help="comma-separated releases, e.g. 0.19.0,0.23.0",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="build.py",
        description="Manage the patch series over the pinned vLLM sdist.",
        epilog="Exit codes: 0 ok, 1 problems found, 2 could not run.",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(os.environ.get("VMP_ROOT") or Path(__file__).resolve().parent),
        help="project root holding patches/ (default: $VMP_ROOT or this file's directory)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--patches",
        metavar="DIR",
        help="folder (under the root) holding upstream.toml, series and the patches: "
        "patches (default) or a rolled series, rolls/<version>",
    )
    which.add_argument(
        "--vllm",
        metavar="VERSION",
        help="a supported release (releases.toml): its patch folder, e.g. --vllm "
        "0.32.0 for rolls/0.32.0",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subcommand(
        sub,
        "fetch",
        "download the pinned sdist (the index's file, no pip) and verify it "
        "into the cache",
    )
    p = subcommand(sub, "apply", "build the tree: pristine + series + overlay")
    p.add_argument(
        "--force", action="store_true", help="discard edits no patch captures"
    )
    p = subcommand(
        sub, "status", "which patches are applied, changed, pending; uncaptured edits"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = subcommand(
        sub,
        "export",
        "write the tree's commits back to patches/ and the overlay folders",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite patch or overlay files changed since apply",
    )
    p = subcommand(
        sub, "check", "CI check of the series against the pristine sdist, or newer ones"
    )
    releases_asked(p)
    p = subcommand(sub, "reset", "back to the pristine tree")
    p.add_argument(
        "--force", action="store_true", help="discard edits no patch captures"
    )
    releases_asked(subcommand(sub, "compat", "the old name of check --since"))
    p = subcommand(
        sub,
        "rebase",
        "carry the series onto another release (3-way; stops at conflicts)",
    )
    p.add_argument(
        "--onto",
        metavar="VERSION",
        type=release_version,
        help="the upstream release, e.g. 0.19.0",
    )
    step = p.add_mutually_exclusive_group()
    step.add_argument(
        "--continue",
        dest="cont",
        action="store_true",
        help="go on after resolving and staging a conflict",
    )
    step.add_argument(
        "--skip",
        action="store_true",
        help="drop the patch the rebase stopped at (reported as dropped) and go on",
    )
    step.add_argument(
        "--abort",
        action="store_true",
        help="give up: remove the roll's tree and folder",
    )
    p.add_argument(
        "--without-build-default",
        dest="without",
        action="append",
        choices=["cpu", "cuda"],
        default=[],
        metavar="DEVICE",
        help="roll even though the target has no build-default wheel for DEVICE "
        "(cpu or cuda; repeatable): its old pins are kept, marked verified = false",
    )
    p.add_argument(
        "--accept",
        action="store_true",
        help="with --continue: keep a step the check after each patch stopped at, as it is",
    )
    p = subcommand(
        sub,
        "range-diff",
        "a rolled series against the pinned one, patch by patch: same, changed "
        "(with the interdiff), only in one of them",
    )
    p.add_argument(
        "--patches",
        dest="roll",
        metavar="DIR",
        help="the rolled series, e.g. rolls/0.19.0 (default: the global --patches, "
        "else the only folder under rolls/)",
    )
    p.add_argument(
        "--against",
        metavar="DIR",
        help="the series to compare with (default: patches, the pinned one; with "
        "--expected, the release releases.toml names as the roll's `against`)",
    )
    p.add_argument(
        "--expected",
        action="store_true",
        help="compare the result with the deltas reviewed so far, "
        "<roll>/range-diff.expected: exit 1 on any difference, showing it",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    root = args.root.resolve()
    patches = args.patches or (
        release_index.patches_of(root, args.vllm) if args.vllm else PATCHES
    )
    project = Project(root, patches=patches.strip("/"))
    if args.command == "fetch":
        return commands.fetch(project)
    if args.command == "apply":
        return commands.apply(project, force=args.force)
    if args.command == "status":
        return commands.status(project, as_json=args.json)
    if args.command == "export":
        return commands.export_(project, force=args.force)
    if args.command == "compat":  # the old name of check --since
        if not (args.release or args.since or args.versions):
            args.since = project.manifest.version
        asked = [
            ("release", args.release),
            ("since", args.since),
            ("versions", args.versions),
        ]
        flag, value = next((f, v) for f, v in asked if v)
        print(
            "compat is now `check --release V` (or --since V, --versions A,B): "
            f"running `{project.cmd(f'check --{flag} {value}')}`",
            file=sys.stderr,
        )
    if args.command in ("check", "compat"):
        return commands.check(
            project,
            as_json=args.json,
            release=args.release,
            since=args.since,
            versions=args.versions,
        )
    if args.command == "reset":
        return commands.reset(project, force=args.force)
    if args.command == "rebase":
        return commands.rebase(
            project,
            onto=args.onto,
            cont=args.cont,
            abort=args.abort,
            accept=args.accept,
            skip=args.skip,
            without=args.without,
        )
    if args.command == "range-diff":
        if args.roll:
            project = Project(root, patches=args.roll.strip("/"))
        against = args.against or (
            release_index.against_of(root, project.patches)
            if args.expected
            else PATCHES
        )
        return commands.range_diff(
            project,
            against=against.strip("/"),
            as_json=args.json,
            expected=args.expected,
        )
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except PatchsetError as exc:
        if getattr(args, "json", False):
            print(
                json.dumps(
                    {"ok": False, "exit_code": exc.exit_code, "error": str(exc)},
                    indent=2,
                )
            )
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main())
