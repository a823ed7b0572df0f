"""``build.py check --release V``: the series and the overlay on a newer release.

The releases asked for (``--release V``; ``--since V``: every final release on
the index newer than V; ``--versions A,B``) are downloaded from the index,
verified and cached like the pinned sdist, and read straight from the tarball.
On each one:

- every patch, in order, on what the earlier ones left, gets GNU ``patch``'s
  verdict: ``exact``, ``offset``, ``fuzz`` (patch's default fuzz of 2),
  ``upstream`` (it reverse-applies: the release has the change), ``conflict``
  or ``missing`` (a file it changes is gone). A failed hunk comes with the
  ``git log -L`` command that shows, in a vLLM clone, upstream's commits that
  changed its lines;
- no overlay file may overwrite an upstream file or a file a patch creates,
  and every overlay destination's parent folder must exist;
- every vLLM module and name the overlay imports must exist;
- the overlay's subclasses of upstream classes are checked as ``check`` checks
  them (``overrides``), compared with the pin.

A conflict, a missing file, an overlay problem, a missing import and an
override error are problems (exit 1). The report is a dict (``--json``) that
``render`` turns into a grid, one row per release.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from packaging.version import Version

from . import overrides, releases, upstream
from .check import (
    PackagePython,
    Release,
    SeriesOnSdist,
    overlay_collisions,
    overlay_python,
    overlay_roots,
)
from .errors import EXIT_OK, EXIT_PROBLEMS, PatchsetError
from .exactapply import (
    PatchDoesNotApply,
    PatchLeavesTree,
    _hunk_header,
    apply_patch,
    file_paths,
    touched_paths,
)
from .project import Project
from .pynames import absolute_module, module_candidates, package_of, top_level_names
from .series import Patch, decode, split_lines
from .tree import load_patches

Say = Callable[[str], None]

# a patch's (and a file's) status -> its grid code, in increasing severity
CODES = {
    "exact": ".",
    "offset": "o",
    "fuzz": "f",
    "upstream": "U",
    "conflict": "C",
    "missing": "M",
}
BREAKS = ("conflict", "missing")
APPLIES = ("exact", "offset", "fuzz")
LEGEND = """\
patches: . exact  o offset  f fuzz  U already upstream (reverse-applies)  C conflict
         M a file it changes is gone  * checked after an earlier patch failed on its files
ovl, imp, ovr: how many overlay, import and override problems (. none);
         imp ? some name cannot be verified; ovr w override warnings only"""
_HUNK_SAID = re.compile(
    r"^Hunk #(?P<n>\d+) (?P<how>succeeded|FAILED|ignored) at (?P<line>\d+)"
    r"(?: with fuzz (?P<fuzz>\d+))?(?: \(offset (?P<offset>-?\d+) lines?\))?",
    re.MULTILINE,
)


# -- one patch on a release ----------------------------------------------------


def gnu_patch(diff: str, path: str, text: str, *args: str) -> tuple[bool, str, str]:
    """GNU ``patch -p1 <args>`` of one file's diff on ``text``, in a temporary
    folder: whether it applied, what it said, the file it left."""
    exe = shutil.which("patch")
    if exe is None:
        raise PatchsetError(
            "GNU patch is not installed (check --release classifies hunks with it): "
            "install it (apt-get install patch)"
        )
    with tempfile.TemporaryDirectory(prefix="vmp-check-") as tmp:
        target = Path(tmp, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text.encode("utf-8", "surrogateescape"))
        proc = subprocess.run(
            [exe, "-p1", "-f", "--no-backup-if-mismatch", *args],
            input=diff.encode("utf-8", "surrogateescape"),
            cwd=tmp,
            capture_output=True,
            check=False,
            timeout=120,
        )
        left = decode(target.read_bytes()) if target.is_file() else ""
    return proc.returncode == 0, decode(proc.stdout + proc.stderr), left


def _hunks(pf, said: str) -> list[dict]:
    """Each hunk's result (exact, offset, fuzz, conflict) as GNU patch reported it:
    it says nothing of a hunk that applies where the diff says."""
    found = {int(m["n"]): m for m in _HUNK_SAID.finditer(said)}
    rows = []
    for i, hunk in enumerate(pf, 1):
        row = {"index": i, "header": _hunk_header(hunk), "result": "exact"}
        if m := found.get(i):
            offset, fuzz = int(m["offset"] or 0), int(m["fuzz"] or 0)
            result = "fuzz" if fuzz else "offset" if offset else "exact"
            if m["how"] != "succeeded":
                result = "conflict"
            row.update(result=result, line=int(m["line"]), offset=offset, fuzz=fuzz)
        rows.append(row)
    return rows


def check_file(pf, read: Callable[[str], str | None]) -> tuple[dict, str | None]:
    """One file of a patch: its row, and the file it leaves (fuzz allowed; for a
    conflict, with the hunks that apply)."""
    src, dst = file_paths(pf)
    row: dict = {"path": dst or src}
    current = read(src or dst)
    if src is None:  # the patch creates the file
        new = "".join(ln.value for h in pf for ln in h if ln.line_type in ("+", " "))
        if current is None:
            return {**row, "status": "exact"}, new
        if current == new:
            return {**row, "status": "upstream"}, current
        note = "the patch creates this file, and the release has another one there"
        return {**row, "status": "conflict", "note": note}, current
    if current is None:
        return {**row, "status": "missing"}, None
    diff = str(pf) if str(pf).endswith("\n") else str(pf) + "\n"
    ok, said, left = gnu_patch(diff, src, current, "-F2")
    hunks = _hunks(pf, said)
    worst = max((h["result"] for h in hunks), key=list(CODES).index, default="exact")
    status = worst if ok else "conflict"
    if status in ("fuzz", "conflict"):
        if gnu_patch(diff, src, current, "-R", "-F0", "--dry-run")[0]:
            return {**row, "status": "upstream"}, current
        if not ok and worst != "conflict":  # patch refused the file as a whole
            row["note"] = said.strip()[-400:]
    return {**row, "status": status, "hunks": hunks}, None if dst is None else left


def check_patch(patch: Patch, tree: Release) -> dict:
    """One patch's row on ``tree``, whose files it leaves as it applied them."""
    row: dict = {"name": patch.name, "files": []}
    try:
        changes = apply_patch(patch, tree.read)
    except PatchLeavesTree as exc:  # never hand such paths to GNU patch
        return {**row, "status": "conflict", "note": exc.describe()}
    except PatchDoesNotApply as exc:
        refused = exc.reason
    else:
        tree.files.update((path, c.content) for path, c in changes.items())
        row["files"] = [{"path": path, "status": "exact"} for path in changes]
        return {**row, "status": "exact"}
    if patch.parse_error:
        return {
            **row,
            "status": "conflict",
            "note": f"it does not parse: {patch.parse_error}",
        }
    left: dict[str, str | None] = {}
    for pf in patch.files:
        src, dst = file_paths(pf)
        file_row, left[dst or src] = check_file(
            pf, lambda p: left[p] if p in left else tree.read(p)
        )
        row["files"].append(file_row)
    tree.files.update(left)
    statuses = [f["status"] for f in row["files"]]
    row["status"] = max(statuses, key=list(CODES).index)
    if row["status"] == "exact":  # patch takes what exactapply refused
        row.update(status="offset", note=f"exactapply refused it: {refused}")
    elif row["status"] == "upstream" and len(set(statuses)) > 1:
        row["note"] = (
            f"{statuses.count('upstream')} of {len(statuses)} files already have the change"
        )
    return row


@functools.lru_cache(maxsize=16)
def _opcodes(old: str, new: str) -> list[tuple[str, int, int, int, int]]:
    lines = split_lines(old), split_lines(new)
    return difflib.SequenceMatcher(None, *lines, autojunk=False).get_opcodes()


def release_lines(old: str, new: str, start: int, count: int) -> tuple[int, int]:
    """Lines ``start``..``start+count-1`` (1-based) of ``old`` as a range of ``new``:
    the lines they became, with the whole of any change that touches them; if
    they are gone, the two lines around where they were."""
    lo, hi = start - 1, start - 1 + max(count, 1)
    span = []
    for tag, i1, i2, j1, j2 in _opcodes(old, new):
        if (i1 < hi and i2 > lo) or (i1 == i2 and lo < i1 < hi):
            equal = tag == "equal"
            span += [j1 + max(i1, lo) - i1 if equal else j1]
            span += [j1 + min(i2, hi) - i1 if equal else j2]
    size = len(split_lines(new))
    a, b = (min(span), max(span)) if span else (size, size)
    if b > a:
        return a + 1, b
    return max(a, 1), max(min(a + 1, size), 1)  # gone: the lines around


def patch_problems(row: dict, before: dict, tree: Release, revs: str) -> list[dict]:
    """A broken patch's problems, each failed hunk with its ``git log -L``."""
    name, out = row["name"], []
    if row["status"] in BREAKS and not row["files"]:
        out.append(_problem("apply", name, f"{name}: {row['note']}"))
    for f in row["files"]:
        path = f["path"]
        failed = [h for h in f.get("hunks", []) if h["result"] == "conflict"]
        if f["status"] == "missing":
            out.append(
                _problem(
                    "apply",
                    f"{name} {path}",
                    f"{name}: {path} is gone; the commit that removed or moved it: "
                    f"`git log --oneline --diff-filter=D {revs} -- {path}`",
                )
            )
        elif f["status"] == "conflict" and not failed:
            out.append(
                _problem("apply", f"{name} {path}", f"{name}: {path}: {f['note']}")
            )
        for h in failed:
            m = re.match(r"@@ -(\d+)(?:,(\d+))?", h["header"])
            count = 1 if m[2] is None else int(m[2])
            new = decode(tree.raw.get(path, b""))
            a, b = release_lines(before.get(path) or "", new, int(m[1]), count)
            h["git_log"] = f"git log -L {a},{b}:{path} {revs}"
            out.append(
                _problem(
                    "apply",
                    f"{name} {path} hunk {h['index']}",
                    f"{name}: {path} hunk {h['index']} ({h['header']}) does not apply; "
                    f"upstream's changes of its lines: `{h['git_log']}`",
                )
            )
    return out


def _problem(kind: str, key: str, message: str) -> dict:
    """``key`` names the problem alike on every release (``render`` shows the first)."""
    return {"kind": kind, "key": key, "message": message}


# -- the overlay's imports -----------------------------------------------------


def overlay_imports(
    sources: list[overrides.OverlaySource], manifest: upstream.Manifest
) -> dict[tuple[str, str | None], list[str]]:
    """(module, name) -> where the overlay imports it from upstream (``file:line``).

    ``import m`` has no name. Relative imports count when they climb out of the
    overlay; imports of the overlay's own modules do not. A file that does not
    parse is left to the override check, which reports it."""
    top, own = manifest.name, overlay_roots(manifest)
    found: dict[tuple[str, str | None], list[str]] = {}
    for src in sources:
        try:
            tree = ast.parse(src.text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = absolute_module(node.module, node.level, package_of(src.dst))
                pairs = [(module, a.name) for a in node.names] if module else []
            else:
                continue
            for module, name in pairs:
                ours = any(module == o or module.startswith(o + ".") for o in own)
                if (module == top or module.startswith(top + ".")) and not ours:
                    found.setdefault((module, name), []).append(
                        f"{src.path}:{node.lineno}"
                    )
    return found


def import_status(module: str, name: str | None, tree: Release) -> tuple[str, str]:
    """(ok | module missing | name missing | unverifiable, why it is unverifiable)."""
    if name and any(tree.exists(p) for p in module_candidates(f"{module}.{name}")):
        return "ok", ""  # a submodule
    path = next((p for p in module_candidates(module) if tree.exists(p)), None)
    if path is None:
        return "module missing", ""
    if name is None or name == "*":
        return "ok", ""
    try:
        names = top_level_names(ast.parse(tree.read(path) or ""))
    except SyntaxError:
        return "unverifiable", f"{path} does not parse"
    if name in names.lines:
        return "ok", ""
    if names.dynamic:
        return (
            "unverifiable",
            f"{path} defines names dynamically (* import, __getattr__)",
        )
    return "name missing", ""


# -- a release, and the run ----------------------------------------------------


@dataclasses.dataclass
class Inputs:
    """What every release is checked with: the series, the overlay, the pin."""

    project: Project
    patches: list[Patch]
    sources: list[overrides.OverlaySource]
    imports: dict[tuple[str, str | None], list[str]]
    wanted: set[str]  # the files read from each release's tarball
    pinned: SeriesOnSdist


def check_release(inputs: Inputs, version: str, say: Say) -> dict:
    """Everything this module checks, on one release."""
    project, pin = inputs.project, inputs.project.manifest
    sdist, sha = releases.fetch_release(version, say, pin.name)
    manifest = dataclasses.replace(pin, version=version, sdist=sdist.name, sha256=sha)
    wanted = PackagePython(pin.name, inputs.wanted)
    tree = Release(*upstream.read_tarball(sdist, manifest, wanted))
    revs = f"v{pin.version}..v{version}"
    rows, problems, warnings = [], [], []
    failed: dict[str, set[str]] = {}
    for i, patch in enumerate(inputs.patches):
        row = check_patch(patch, tree)
        touched = touched_paths(patch)
        if earlier := [n for n, files in failed.items() if files & touched]:
            row["after_failed_same_files"] = earlier
        if row["status"] in BREAKS:
            failed[patch.name] = touched
        problems += patch_problems(row, inputs.pinned.states[i], tree, revs)
        rows.append(row)
    for dst, message in overlay_collisions(project, tree):
        problems.append(_problem("overlay", dst, message))
    for ov in pin.overlays:
        parent = str(PurePosixPath(ov.dst).parent)
        if not tree.dir_exists(parent):
            message = (
                f"the overlay's destination {ov.dst}: its parent {parent}/ is gone"
            )
            problems.append(_problem("overlay", ov.dst, message))
    imports = []
    for (module, name), used in sorted(inputs.imports.items(), key=str):
        status, note = import_status(module, name, tree)
        imports.append(
            {"module": module, "name": name, "status": status, "used_at": used}
        )
        if note:
            imports[-1]["note"] = note
        if status.endswith("missing"):
            statement = f"from {module} import {name}" if name else f"import {module}"
            message = f"{', '.join(used)}: `{statement}`: {status}"
            problems.append(_problem("import", statement, message))
    report = overrides.check_overrides(
        inputs.sources,
        tree.python_files(pin.name),
        read_pinned=inputs.pinned.read,
        top=pin.name,
        roots=overlay_roots(pin),
        label=f"{pin.name} {version}",
        pinned_label=f"{pin.name} {pin.version} (the pin)",
    )
    for p in report.problems:
        key = " ".join(str(x) for x in (p.where, p.subject, p.kind, p.name) if x)
        entry = _problem("override", key, f"{p.kind}: {p.describe()}")
        (problems if p.severity == overrides.ERROR else warnings).append(entry)
    return {
        "version": version,
        "sdist": {"file": sdist.name, "sha256": sha},
        "patches": rows,
        "counts": dict(Counter(row["status"] for row in rows)),
        "imports": imports,
        "overrides": report.to_json(),
        "problems": problems,
        "warnings": warnings,
    }


def versions_asked(
    project: Project, release: str | None, since: str | None, versions: str | None
) -> list[str]:
    """``--release V``, ``--versions A,B`` (sorted), else the index's releases
    newer than ``--since V``."""
    if release:
        return [release]
    if versions:
        asked = {v.strip() for v in versions.split(",") if v.strip()}
        return sorted(asked, key=Version)
    return releases.list_versions(project.manifest.name, since)


def run(
    project: Project,
    *,
    release: str | None = None,
    since: str | None = None,
    versions: str | None = None,
    say: Say,
) -> dict:
    """The report of every release asked for."""
    pin = project.manifest
    patches = load_patches(project)  # refuse a broken series before any download
    sources = overlay_python(project)
    imports = overlay_imports(sources, pin)
    asked = versions_asked(project, release, since, versions)
    wanted = set().union(*map(touched_paths, patches))
    for module, _ in imports:
        wanted.update(module_candidates(module))
    results = []
    if asked:  # the pin with its series: the base of every comparison
        pinned = SeriesOnSdist(releases.fetch(pin, say), pin, patches)
        inputs = Inputs(project, patches, sources, imports, wanted, pinned)
    for n, version in enumerate(asked, 1):
        prefix = f"[{n}/{len(asked)}] {version}:"
        res = check_release(inputs, version, lambda m, p=prefix: say(f"{p} {m}"))
        applies = sum(res["counts"].get(s, 0) for s in APPLIES)
        say(
            f"{prefix} {applies} of {len(patches)} patches apply, "
            f"{len(res['problems'])} problems, {len(res['warnings'])} warnings"
        )
        results.append(res)
    ok = not any(res["problems"] for res in results)
    return {
        "tool": "build.py check --release",
        "pinned": {"name": pin.name, "version": pin.version, "sha256": pin.sha256},
        "since": None if release or versions else since,
        "series": [
            {"name": p.name, "subject": p.title, "files": sorted(touched_paths(p))}
            for p in patches
        ],
        "versions": results,
        "ok": ok,
        "exit_code": EXIT_OK if ok else EXIT_PROBLEMS,
    }


# -- for people ----------------------------------------------------------------


def render(report: dict) -> str:
    """The grid (a row per release, a column per patch), the legend, then each
    problem and warning once, from the first release it shows on."""
    pinned, series = report["pinned"], report["series"]
    if not report["versions"]:
        return f"check: no {pinned['name']} release newer than {report['since']}"
    cols = [
        name[:4] if name[:4].isdigit() else f"#{i}"
        for i, name in enumerate(p["name"] for p in series)
    ]
    lines = [
        f"check --release: {len(series)} patches and the overlay on {pinned['name']} "
        f"releases (pinned {pinned['version']})",
        f"{'version':<9}"
        + "".join(f"{c:>6}" for c in cols)
        + "   ovl  imp  ovr   applies",
    ]
    for res in report["versions"]:
        cells = [
            CODES[row["status"]] + ("*" if row.get("after_failed_same_files") else "")
            for row in res["patches"]
        ]
        kinds = Counter(p["kind"] for p in res["problems"])
        unsure = any(i["status"] == "unverifiable" for i in res["imports"])
        imp = kinds["import"] or ("?" if unsure else ".")
        ovr = kinds["override"] or ("w" if res["warnings"] else ".")
        counts = res["counts"]
        applies = sum(counts.get(s, 0) for s in APPLIES)
        detail = ", ".join(f"{counts[s]} {s}" for s in CODES if s in counts)
        lines.append(
            f"{res['version']:<9}"
            + "".join(f"{c:>6}" for c in cells)
            + f"{kinds['overlay'] or '.':>6}{imp:>5}{ovr:>5}   "
            f"{applies}/{len(series)} ({detail})"
        )
    lines += ["legend:", *("  " + x for x in LEGEND.splitlines()), "patches:"]
    lines += [f"  {col}  {p['subject']}" for col, p in zip(cols, series)]
    for what in ("problems", "warnings"):
        first: dict[str, str] = {}
        for res in report["versions"]:
            for p in res[what]:
                first.setdefault(p["key"], f"  {res['version']}: {p['message']}")
        if first:
            lines += [
                f"{what} (each from the first release it shows on):",
                *first.values(),
            ]
    return "\n".join(lines)
