"""Which upstream commits broke a patch, an import or an override.

Given a vLLM clone with release tags ``v<version>`` (``--upstream-git``),
each break is traced to the commits between the last release it worked on and
the first it broke on: ``git log -L`` over a failed hunk's lines, the
deletion or rename of a missing file (``--diff-filter=DR``), the pickaxe
(``-S``) for a vanished import, and ``-G`` over the ``def`` line of an
upstream method an override lost. The git mechanics are ``gitrepo``'s; this
module only decides what to ask.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import PatchsetError
from ..gitrepo import GitError, GitRepo
from .applycheck import BREAKS
from .imports import IMPORT_BREAKS, module_candidates
from .inputs import Inputs

# override problems whose upstream def line changed: git names the commits (-G)
OVERRIDE_ATTRIBUTED = (
    "override-missing",
    "super-missing",
    "signature",
    "super-call",
    "shadowed",
)


class UpstreamGit:
    """A vLLM clone with release tags ``v<version>``; names the commits that broke things."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.repo = GitRepo.discover(path)
        except GitError as exc:
            raise PatchsetError(
                f"--upstream-git {path} is not a git repository"
            ) from exc

    def tag(self, version: str) -> str | None:
        """The tag of a release (``v0.19.0``, or ``0.19.0``), or None."""
        for name in (f"v{version}", version):
            if self.repo.rev_parse(name) is not None:
                return name
        return None


def first_breaks(
    results: list[dict], inputs: Inputs, git: UpstreamGit | None, pinned: str
) -> dict:
    """Per patch (and per broken import): the first release it breaks on, and why.

    "After" is the release before it in the list (the pin for the first), so
    the commits named are those between the last good and the first bad one.
    """
    out: dict = {"patches": {}, "imports": {}, "overrides": {}}
    versions = [r["version"] for r in results]
    for patch in inputs.patches:
        for i, res in enumerate(results):
            row = next(r for r in res["patches"] if r["name"] == patch.name)
            if row["status"] in BREAKS:
                prev = versions[i - 1] if i else pinned
                out["patches"][patch.name] = _patch_break(
                    row, prev, res["version"], git
                )
                break
    keys = sorted(
        {(i["module"], i["name"]) for r in results for i in r["imports"]}, key=str
    )
    for module, name in keys:
        for i, res in enumerate(results):
            row = next(
                (
                    x
                    for x in res["imports"]
                    if (x["module"], x["name"]) == (module, name)
                ),
                None,
            )
            if row is not None and row["status"] in IMPORT_BREAKS:
                prev = versions[i - 1] if i else pinned
                label = f"{module}.{name}" if name else module
                out["imports"][label] = _import_break(row, prev, res["version"], git)
                break
    # each override problem: the first release that has it
    for i, res in enumerate(results):
        for problem in (res.get("overrides") or {}).get("problems", []):
            label = _override_label(problem)
            if label in out["overrides"]:
                continue
            prev = versions[i - 1] if i else pinned
            entry = {"version": res["version"], "after": prev, **problem}
            if git and problem["upstream"] and problem["kind"] in OVERRIDE_ATTRIBUTED:
                # the upstream def's line: renamed, removed, added or re-signed there
                entry["commits"] = _attribute(
                    git,
                    prev,
                    res["version"],
                    git.repo.commits_changing_lines_matching,
                    rf"def {problem['name']}\(",
                    problem["upstream"],
                )
            out["overrides"][label] = entry
    return out


def _override_label(problem: dict) -> str:
    """Stable across releases (unlike the message, which names the release)."""
    subject = ".".join(x for x in (problem["cls"], problem["method"]) if x)
    fields = (
        problem["file"],
        subject,
        problem["kind"],
        problem["severity"],
        problem["name"],
    )
    return " ".join(str(x) for x in fields if x)


def _patch_break(row: dict, prev: str, version: str, git: UpstreamGit | None) -> dict:
    entry: dict = {
        "version": version,
        "after": prev,
        "status": row["status"],
        "causes": [],
    }
    for f in row["files"]:
        if f["status"] == "missing":
            cause = {"file": f["path"], "moved_to": f.get("moved_to")}
            if git:
                cause["commits"] = _attribute(
                    git, prev, version, git.repo.commits_removing, [f["path"]]
                )
            entry["causes"].append(cause)
            continue
        if f["status"] != "conflict":
            continue
        for h in f.get("hunks") or [
            {"index": None, "header": None, "result": "failed"}
        ]:
            if h["result"] != "failed":
                continue
            change = h.get("upstream_change") or {}
            cause = {
                "file": f["path"],
                "hunk": h["index"],
                "hunk_header": h["header"],
                "upstream_change": change.get("diff"),
                "note": f.get("note"),
            }
            if git and change:
                start, end = change["target_range"]
                if end < start:  # the region is gone: take its neighbours
                    start, end = max(1, start - 1), start + 1
                cause["commits"] = _attribute(
                    git,
                    prev,
                    version,
                    git.repo.commits_changing_lines,
                    f["path"],
                    start,
                    end,
                )
            entry["causes"].append(cause)
    if row.get("after_failed_same_files"):
        entry["after_failed_same_files"] = row["after_failed_same_files"]
        entry["alone_on_target"] = row.get("alone_on_target")
    return entry


def _import_break(row: dict, prev: str, version: str, git: UpstreamGit | None) -> dict:
    entry = {
        "version": version,
        "after": prev,
        "status": row["status"],
        "used_at": row.get("used_at"),
        "defined_in": row.get("defined_in"),
        "candidates": row.get("candidates"),
    }
    if git:
        if row["status"] == "name missing":
            find, args = git.repo.commits_changing_count, (row["name"], row["file"])
        else:
            find, args = git.repo.commits_removing, (module_candidates(row["module"]),)
        entry["commits"] = _attribute(git, prev, version, find, *args)
    return entry


def _attribute(
    git: UpstreamGit, prev: str, version: str, find: Callable, *args
) -> list[dict] | str:
    """``find(old_tag, new_tag, *args)``'s commits, or why it could not run."""
    a, b = git.tag(prev), git.tag(version)
    if a is None or b is None:
        return f"no tag v{prev if a is None else version} in {git.path}"
    try:
        return [{"sha": sha, "subject": subject} for sha, subject in find(a, b, *args)]
    except PatchsetError as exc:
        return str(exc)
