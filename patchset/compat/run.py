"""The compat run: each release fetched, analysed (or taken from the cache), then
the first breaks across them.

``analyze`` classifies one release: every patch in order (``applycheck``), the
overlay and its imports (``imports``), the overlay's subclasses of upstream
classes (``overrides``). A release's result is cached
(``<cache>/compat/<version>.json``) under a key of the sdist sha256, the
patches' sha256s, the overlay's import set and the text of the overlay files
that subclass upstream classes (``Inputs.key``), so a second run recomputes
nothing and downloads nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import time
from pathlib import Path

from packaging.version import Version

from .. import overrides, releases, upstream
from ..check import overlay_roots, tarball_reader
from ..exactapply import touched_paths
from ..project import Project
from ..series import decode
from .applycheck import BREAKS, check_patch, conflict_regions, locate_moved_files
from .attribution import UpstreamGit, first_breaks
from .imports import check_imports, check_overlay, locate_moved_names, module_candidates
from .inputs import FORMAT, Inputs, PinnedBase, Say, TreeState, load_inputs
from .report import LEGEND, count_text, imports_text, overlay_text, overrides_text

DEFAULT_JSON = "results/compat.json"


def analyze(
    inputs: Inputs, version: str, sdist: Path, sha: str, base: PinnedBase, say: Say
) -> dict:
    """Classify every patch, the overlay and its imports on one release."""
    manifest = dataclasses.replace(
        inputs.manifest, version=version, sdist=sdist.name, sha256=sha
    )
    top = manifest.name
    wanted: set[str] = set()
    for patch in inputs.patches:
        wanted |= touched_paths(patch)
    modules = {r.module for r in inputs.imports}
    for module in modules:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            wanted.update(module_candidates(".".join(parts[:i])))
    wanted |= overrides.wanted_paths(inputs.override_sources, top)
    say(f"reading {sdist.name} ...")
    members, raw = upstream.read_tarball(sdist, manifest, wanted)
    state = TreeState(members, raw)
    result: dict = {
        "version": version,
        "sdist": {"file": sdist.name, "sha256": sha},
        "members": len(members),
        "patches": [],
    }
    failed: list[tuple[str, set[str]]] = []
    for index, patch in enumerate(inputs.patches):
        files = touched_paths(patch)
        row = check_patch(patch, state)
        earlier = [name for name, touched in failed if touched & files]
        if failed:
            row["after_failed"] = [name for name, _ in failed]
        if earlier:
            row["after_failed_same_files"] = earlier
        if earlier and row["status"] != "exact":
            # Would it apply without the earlier failures? On upstream's files alone:
            alone = check_patch(patch, TreeState(members, raw))
            row["alone_on_target"] = alone["status"]
        if row["status"] in BREAKS:
            failed.append((patch.name, files))
        conflict_regions(row, index, state, base, inputs.manifest.version, version)
        result["patches"].append(row)
    needs_scan = any(
        f["status"] == "missing" for row in result["patches"] for f in row["files"]
    )
    result["overlay"] = check_overlay(
        inputs.manifest.overlays, inputs.overlay_sources, state
    )
    result["imports"] = check_imports(inputs.imports, state)
    if needs_scan or any(i["status"] != "ok" for i in result["imports"]):
        _locate_moved(result, sdist, manifest, state, base)
    result["overrides"] = overrides.check_overrides(
        inputs.override_sources,
        tarball_reader(sdist, manifest, state.members, state.raw, state.files),
        read_pinned=base.read,
        top=top,
        roots=overlay_roots(manifest),
        label=f"{top} {version}",
        pinned_label=f"{top} {inputs.manifest.version} (the pin)",
    ).to_json()
    counts: dict[str, int] = {}
    for row in result["patches"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    result["counts"] = counts
    return result


def _locate_moved(
    result: dict,
    sdist: Path,
    manifest: upstream.Manifest,
    state: TreeState,
    base: PinnedBase,
) -> None:
    """Second pass over the tarball: where did missing files and names go?"""
    top = manifest.name
    py = {m for m in state.members if m.startswith(top + "/") and m.endswith(".py")}
    _, raw = upstream.read_tarball(sdist, manifest, py)
    texts = {p: decode(b) for p, b in raw.items()}
    locate_moved_files(result["patches"], state, base, texts)
    locate_moved_names(result["imports"], state, texts)


def result_cache(version: str) -> Path:
    """Where a release's result is cached (with the key it was computed under)."""
    return upstream.cache_dir() / "compat" / f"{version}.json"


def run_compat(
    project: Project,
    versions: list[str],
    *,
    upstream_git: Path | None = None,
    use_cache: bool = True,
    say: Say,
) -> dict:
    """The JSON report of the series and the overlay on each of ``versions``.

    Each release is fetched (verified) and analysed, or its cached result
    reused; then the first break of every patch, import and override across
    the releases, traced to upstream commits when ``upstream_git`` is a clone.
    """
    inputs = load_inputs(project)
    git = UpstreamGit(upstream_git) if upstream_git else None
    base = PinnedBase(inputs)
    pinned = project.manifest.version
    results = []
    started = time.monotonic()
    used_at: dict[tuple[str, str | None], list[str]] = {}
    for ref in inputs.imports:
        used_at.setdefault(ref.target, []).append(f"{ref.file}:{ref.line}")
    for n, version in enumerate(versions, 1):
        prefix = f"[{n}/{len(versions)}] {version}:"
        t0 = time.monotonic()
        sdist, sha = releases.fetch_release(
            version, lambda m, p=prefix: say(f"{p} {m}"), project.manifest.name
        )
        key = inputs.key(version, sha)
        cache = result_cache(version)
        cached = _load_cached(cache, key) if use_cache else None
        if cached is not None:
            say(f"{prefix} result cached (same sdist, patches and overlay imports)")
            cached["from_cache"] = True
            results.append(cached)
            continue
        res = analyze(
            inputs, version, sdist, sha, base, lambda m, p=prefix: say(f"{p} {m}")
        )
        res["key"] = key
        res["seconds"] = round(time.monotonic() - t0, 2)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "result": res}, indent=1))
        tmp.replace(cache)
        res["from_cache"] = False
        say(
            f"{prefix} {len(inputs.patches)} patches: {count_text(res['counts'])}; "
            f"{overlay_text(res)}; {imports_text(res)}; {overrides_text(res)} "
            f"({res['seconds']} s)"
        )
        results.append(res)
    for res in results:  # where the overlay uses each name (not part of the key)
        for row in res["imports"]:
            row["used_at"] = used_at.get((row["module"], row["name"]), [])
    breaks = first_breaks(results, inputs, git, pinned)
    return {
        "tool": "build.py compat",
        "format": FORMAT,
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "seconds": round(time.monotonic() - started, 1),
        "pinned": {
            "name": project.manifest.name,
            "version": pinned,
            "sha256": project.manifest.sha256,
        },
        "upstream_git": str(upstream_git) if upstream_git else None,
        "series": [
            {
                "name": p.name,
                "sha256": p.sha256,
                "subject": p.title,
                "files": sorted(touched_paths(p)),
            }
            for p in inputs.patches
        ],
        "overlay_imports": [dataclasses.asdict(r) for r in inputs.imports],
        "overlay_import_errors": inputs.import_errors,
        "legend": LEGEND,
        "versions": results,
        "first_breaks": breaks,
    }


def _load_cached(path: Path, key: str) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get("result") if data.get("key") == key else None


def resolve_versions(
    project: Project, versions: str | None, since: str | None
) -> list[str]:
    name = project.manifest.name
    if versions:
        wanted = [v.strip() for v in versions.split(",") if v.strip()]
        for v in wanted:
            Version(v)  # refuse garbage early
        return sorted(dict.fromkeys(wanted), key=Version)
    return releases.list_versions(name, since or project.manifest.version)


def default_json(project: Project) -> Path:
    return project.root / DEFAULT_JSON
