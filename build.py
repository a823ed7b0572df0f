#!/usr/bin/env python3
"""Patch-set manager for the pinned vLLM tree.

    python build.py fetch            get and verify the pinned sdist (cached outside the repo)
    python build.py apply [--force]  pristine tree + patches/series + overlay into third_party/vllm
    python build.py status [--json]  applied / changed / pending patches, uncaptured edits
    python build.py export [--force] tree commits -> patches/*.patch + series, overlay copied back
    python build.py check [--json]   CI: series, headers, zero-fuzz apply on the sdist, overlay
    python build.py reset [--force]  back to the pristine tree

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
    from patchset import commands
    from patchset.errors import EXIT_CANNOT_RUN, PatchsetError
    from patchset.project import Project
except ImportError as _exc:  # GitPython or unidiff not installed
    if _exc.name not in ("git", "unidiff"):
        raise
    print(
        f"error: {_exc}. build.py needs GitPython and unidiff: "
        f"{sys.executable} -m pip install GitPython unidiff",
        file=sys.stderr,
    )
    sys.exit(2)


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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "fetch", help="download (pip) and verify the pinned sdist into the cache"
    )
    p = sub.add_parser("apply", help="build the tree: pristine + series + overlay")
    p.add_argument(
        "--force", action="store_true", help="discard edits no patch captures"
    )
    p = sub.add_parser(
        "status", help="which patches are applied, changed, pending; uncaptured edits"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser(
        "export",
        help="write the tree's commits back to patches/ and the overlay folders",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite patch or overlay files changed since apply",
    )
    p = sub.add_parser(
        "check", help="CI check of the series against the pristine sdist"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("reset", help="back to the pristine tree")
    p.add_argument(
        "--force", action="store_true", help="discard edits no patch captures"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    project = Project(args.root.resolve())
    if args.command == "fetch":
        return commands.fetch(project)
    if args.command == "apply":
        return commands.apply(project, force=args.force)
    if args.command == "status":
        return commands.status(project, as_json=args.json)
    if args.command == "export":
        return commands.export_(project, force=args.force)
    if args.command == "check":
        return commands.check(project, as_json=args.json)
    if args.command == "reset":
        return commands.reset(project, force=args.force)
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
