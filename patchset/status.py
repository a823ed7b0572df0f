"""``build.py status``: how the tree relates to the series and the overlay folders."""

from __future__ import annotations

from . import upstream
from .confine import project_violations
from .project import Project
from .series import Patch, sha256_bytes
from .state import RebaseState
from .tree import Tree
from .validate import MISSING, validate_series


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
    report = validate_series(project)
    series_problems = [p.message for p in report.loading_problems if p.code != MISSING]
    patches = {p.name: p for p in report.patches}
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
            "build": project.cmd("apply"),  # the command that builds it
            "git_dir": project.rel(tree.git_dir),
            "present": tree.present(),
        },
        "series_problems": series_problems,  # a missing file shows in its row
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
        # leaving the tree: refused
        "confinement": _confinement(project, report.patches),
        "in_sync": False,
    }
    if not tree.present():
        out["patches"] = [
            {"name": e.name, "state": "pending", "subject": _subject(patches, e.name)}
            for e in report.entries
        ]
        return out

    tree.check_layout()
    rebase = RebaseState.load(tree.git_dir)
    if rebase is not None:  # a roll under way: its series is written when it ends
        source = Project(project.root, rebase.from_patches)
        out["rebase"] = {
            "from_version": rebase.from_version,
            "from_patches": rebase.from_patches,
            "onto": rebase.onto,
            "patches": len(rebase.patches),
            "stopped_at": rebase.stopped_at,
            "dropped": rebase.dropped,
            "go_on": source.cmd(f"rebase --continue --onto {rebase.onto}"),
            "give_up": source.cmd(f"rebase --abort --onto {rebase.onto}"),
        }
        return out
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
    for entry in report.entries:
        if project.patch_name_problem(entry.name) is not None:
            continue  # not read: named in series_problems
        path = project.patch_path(entry.name)
        rec = applied.get(entry.name)
        row = {"name": entry.name, "subject": _subject(patches, entry.name)}
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
    listed = [e.name for e in report.entries]
    names = set(listed)
    out["removed"] = [
        {"name": p.name, "commit": p.commit, "subject": p.subject}
        for p in applied.values()
        if p.name not in names
    ]
    applied_order = [
        p.name for p in st.patches if p.name in applied and p.name in names
    ]
    out["out_of_order"] = applied_order != [n for n in listed if n in applied]
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
        not series_problems
        and all(r["state"] == "applied" for r in rows)
        and not out["removed"]
        and not out["out_of_order"]
        and analysis.overlay_in_sync
        and not analysis.uncaptured
        and not out["confinement"]
        and out["tree"]["built_from_pinned_sdist"]
    )
    return out


def _confinement(project: Project, patches: list[Patch]) -> list[dict]:
    """Paths of the series' patches and the overlay that confinement refuses."""
    tree = project.rel(project.tree)
    return [v.to_json(tree) for v in project_violations(project, patches)]


def _subject(patches: dict[str, Patch], name: str) -> str | None:
    patch = patches.get(name)
    return patch.title if patch else None
