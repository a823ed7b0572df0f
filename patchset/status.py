"""``build.py status``: how the tree relates to the series and the overlay folders."""

from __future__ import annotations

from . import upstream
from .confine import project_violations
from .project import Project
from .series import read_patch, sha256_bytes
from .tree import Tree


def compute_status(project: Project) -> dict:
    """Everything status reports, as plain data (also the --json output)."""
    manifest = project.manifest
    cached = upstream.cached_sdist(manifest)
    if cached.is_file():
        sdist_state = (
            "verified"
            if upstream.sha256_file(cached) == manifest.sha256
            else "sha256 mismatch"
        )
    else:
        sdist_state = "not cached"
    tree = Tree(project)
    series = project.series()
    out: dict = {
        "upstream": {
            "name": manifest.name,
            "version": manifest.version,
            "sdist": str(cached),
            "sdist_state": sdist_state,
            "sha256": manifest.sha256,
        },
        "tree": {
            "path": project.rel(tree.path),
            "git_dir": project.rel(tree.git_dir),
            "present": tree.present(),
        },
        "series_problems": list(series.problems),
        "patches": [],
        "removed": [],
        "out_of_order": False,
        "overlay": {
            "placed": False,
            "in_sync": False,
            "repo_changed": [],
            "tree_edited": [],
        },
        "uncaptured": [],
        "confinement": _confinement(project),  # paths leaving the tree: refused
        "in_sync": False,
    }
    if not tree.present():
        out["patches"] = [
            {"name": e.name, "state": "pending", "subject": _subject(project, e.name)}
            for e in series.entries
        ]
        return out

    tree.check_layout()
    analysis = tree.analyse()
    st = analysis.state
    out["tree"].update(
        {
            "pristine": st.pristine,
            "head": tree.repo.head(),
            "built_from_pinned_sdist": st.sdist_sha256 == manifest.sha256,
        }
    )
    amended = analysis.ids.amended  # patch name -> its rewritten commit
    applied = {
        p.name: p for p in st.patches if p.commit in analysis.chain or p.name in amended
    }
    rows = []
    for entry in series.entries:
        path = project.patch_path(entry.name)
        rec = applied.get(entry.name)
        row = {"name": entry.name, "subject": _subject(project, entry.name)}
        if not path.is_file():
            row["state"] = "missing" if rec is None else "applied, file missing"
        elif rec is None:
            row["state"] = "pending"
        elif sha256_bytes(path.read_bytes()) != rec.sha256:
            row["commit"] = amended.get(entry.name, rec.commit)
            row["state"] = "changed"
        elif entry.name in amended:
            row["commit"] = amended[entry.name]
            row["state"] = "amended"
        else:
            row["commit"] = rec.commit
            row["state"] = "applied"
        rows.append(row)
    out["patches"] = rows
    names = set(series.names)
    out["removed"] = [
        {"name": p.name, "commit": p.commit, "subject": p.subject}
        for p in applied.values()
        if p.name not in names
    ]
    applied_order = [
        p.name for p in st.patches if p.name in applied and p.name in names
    ]
    out["out_of_order"] = applied_order != [n for n in series.names if n in applied]
    out["overlay"] = {
        "placed": analysis.overlay_placed,
        "in_sync": analysis.overlay_in_sync,
        "repo_changed": analysis.overlay_repo_changed
        if analysis.overlay_placed
        else [],
        "tree_edited": analysis.overlay_needs_copy_back,
    }
    out["uncaptured"] = [{"path": e.path, "why": e.why} for e in analysis.uncaptured]
    out["in_sync"] = (
        not series.problems
        and all(r["state"] == "applied" for r in rows)
        and not out["removed"]
        and not out["out_of_order"]
        and analysis.overlay_in_sync
        and not analysis.uncaptured
        and not out["confinement"]
        and out["tree"]["built_from_pinned_sdist"]
    )
    return out


def _confinement(project: Project) -> list[dict]:
    """Paths of the series' patches and the overlay that leave the tree."""
    names = dict.fromkeys(project.series().names)
    paths = {n: project.patch_path(n) for n in names}
    patches = [read_patch(p, n) for n, p in paths.items() if p.is_file()]
    tree = project.rel(project.tree)
    return [v.to_json(tree) for v in project_violations(project, patches)]


def _subject(project: Project, name: str) -> str | None:
    path = project.patch_path(name)
    if not path.is_file():
        return None
    return read_patch(path, name).title
