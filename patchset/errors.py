"""Errors carry the exit code the CLI should return.

Exit codes: 0 ok, 1 problems found, 2 could not run.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_CANNOT_RUN = 2


class PatchsetError(Exception):
    """The command could not run (bad manifest, git missing, no sdist, ...)."""

    exit_code = EXIT_CANNOT_RUN


class ProblemsFound(PatchsetError):
    """The command ran and found problems (mismatch, dirty tree, ...)."""

    exit_code = EXIT_PROBLEMS
