"""Patch-set manager for the pinned vLLM tree (driven by ``build.py``).

Layout, one concern per module:

- ``gitrepo``: project-agnostic git mechanics (separate git dir, commits,
  format-patch export). Knows nothing about vLLM or about our policies.
- ``series``: quilt ``series`` files and mail-style patch files (header + diff).
- ``headers``: the header policy (Subject, a body saying why, Upstream-Status).
- ``validate``: the series' rules (options, duplicates, missing and unlisted
  files, parse errors, headers), written once for every command.
- ``exactapply``: zero-fuzz, zero-offset hunk validation and application.
- ``upstream``: the manifest (``patches/upstream.toml``), sdist fetch (the
  index's file, no pip), the one verified download every cached file goes
  through (sha256, set-aside), unpacking and reading members straight from the
  tarball.
- ``overlay``: our own new files placed into the tree and copied back.
- ``state``: what ``apply`` recorded in the tree's git dir.
- ``project``: where things are in a project checkout.
- ``tree``: the managed tree: baseline, apply, analysis of edits, reset.
- ``export``: the tree's commits back to patch files, overlay copied back.
- ``status``: what ``build.py status`` reports, as data.
- ``check``: the CI check (static + in-memory zero-fuzz apply on the tarball).
- ``overrides``: the overlay's subclasses of upstream classes against a release.
- ``releasecheck``: ``check --release``, the series and the overlay on newer
  releases (GNU patch's verdict per patch, the overlay's imports).
- ``rebase``: the series carried onto another release by ``git rebase``;
  ``mergecheck`` checks each step's Python files with ruff.
- ``pynames``: what ``overrides`` and ``releasecheck`` read from
  Python source alike (the names a module defines, imports made absolute,
  ``self`` attributes).
- ``rangediff``: a rolled series against the pinned one, patch by patch.
- ``releases``: the package index: versions, sdists and wheels.
- ``build_defaults``: what ``pip install -e`` of the tree builds with (device,
  precompiled kernels' wheel), recorded in the tree by ``apply``, re-pinned
  by ``rebase``.
- ``commands``: the subcommands behind ``build.py`` (printing, exit codes).
"""

import os

# Let GitPython import even when git is missing, so commands that do not need
# git (check) still run and the others can say what is wrong.
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
