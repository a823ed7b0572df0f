"""``build.py compat``: how the series and the overlay fare on newer upstream releases.

For every upstream version asked for, the verified sdist (``releases``) is read
straight from the tarball (nothing is unpacked) and the series is applied to
it in memory, in order, each patch on the state the earlier ones left; each
patch gets one status (``exact``, ``offset``, ``fuzz``, ``upstream``,
``conflict``, ``missing``), a failed hunk is shown with upstream's change of
its region, a missing file with its likely new path. A patch checked after an
earlier one failed on the same files says so. Then the overlay: does each
destination's parent still exist, does an overlay file collide with an
upstream one, and does every vLLM name the overlay imports still exist in the
patched target tree. Last, the overlay's subclasses of upstream classes
(``overrides``): does every method that overrides an upstream one in the
pinned release still exist in the target, with a compatible signature, and
does every ``super()`` call still land; is a method of ours now also defined
upstream. Given a vLLM git clone, each first break is traced to the upstream
commits that caused it.

One module per job:

- ``inputs``: what is compared (series, overlay, the pinned release with the
  series applied) and the cache key;
- ``applycheck``: one patch against a release's files, and why a hunk fails
  or where a missing file went;
- ``imports``: the overlay's destinations and its imports from vLLM;
- ``attribution``: the upstream commits behind each first break (git);
- ``run``: one release analysed, every release run or taken from the cache,
  the JSON report;
- ``report``: the grid and the details for people, the exit code.
"""

from __future__ import annotations

from .attribution import UpstreamGit, first_breaks
from .imports import ImportRef, overlay_imports
from .inputs import FORMAT, Inputs, PinnedBase, load_inputs
from .report import LEGEND, exit_code, problems_found, render
from .run import DEFAULT_JSON, analyze, default_json, resolve_versions, run_compat

__all__ = [
    "DEFAULT_JSON",
    "FORMAT",
    "LEGEND",
    "ImportRef",
    "Inputs",
    "PinnedBase",
    "UpstreamGit",
    "analyze",
    "default_json",
    "exit_code",
    "first_breaks",
    "load_inputs",
    "overlay_imports",
    "problems_found",
    "render",
    "resolve_versions",
    "run_compat",
]
