"""``build.py compat``: how the series and the overlay fare on newer upstream releases.

For every upstream version asked for, the verified sdist (``releases``) is read
straight from the tarball (nothing is unpacked) and the series is applied to
it in memory, in order, each patch on the state the earlier ones left:

- ``exact``: every hunk matches at its stated line (``exactapply``);
- ``offset``: GNU ``patch -F0`` applies it, some hunks at other lines;
- ``upstream``: ``patch -R -F0`` applies, upstream already has the change;
- ``fuzz``: only ``patch`` with its default fuzz (2) applies it;
- ``conflict``: some hunks do not apply even with fuzz; the hunk is named
  with the upstream change of its region (pinned vs target, both with the
  earlier patches applied) and, given a vLLM git clone, the commits that
  changed those lines between the last good and the first broken release;
- ``missing``: a file the patch changes is gone; the likely new path is the
  same basename elsewhere (or, failing that, the best content match).

The fuzz-applied result (and, for a conflict, the hunks that do apply) is what
the next patches see; a patch checked after an earlier one failed on the same
files says so. Then the overlay: does each destination's parent still exist,
does an overlay file collide with an upstream one, and does every vLLM name
the overlay imports (absolute ``vllm.*`` imports and relative ones that climb
out of the overlay) still exist in the patched target tree. Last, the
overlay's subclasses of upstream classes (``overrides``): does every method
that overrides an upstream one in the pinned release still exist in the
target, with a compatible signature, and does every ``super()`` call still
land; is a method of ours now also defined upstream.

A version's result is cached (``<cache>/compat/<version>.json``) under a key
of the sdist sha256, the patches' sha256s, the overlay's import set and the
text of the overlay files that subclass upstream classes, so a second run
recomputes nothing and downloads nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import difflib
import functools
import hashlib
import json
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packaging.version import Version

from . import overrides, releases, upstream
from .check import overlay_python, overlay_roots, tarball_reader
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
from .series import Patch, decode, split_lines
from .tree import load_patches

FORMAT = 5  # bump when the analysis changes: cached results are then recomputed
CONTEXT = 3  # lines around a failed hunk's region in the upstream-change diff
MAX_DIFF_LINES = 60
DEFAULT_JSON = "results/compat.json"

# status -> grid code, in increasing severity
CODES = {
    "exact": ".",
    "offset": "o",
    "fuzz": "f",
    "upstream": "U",
    "conflict": "C",
    "missing": "M",
}
RANK = {status: i for i, status in enumerate(CODES)}
APPLIES = ("exact", "offset", "fuzz")
BREAKS = ("conflict", "missing")
IMPORT_BREAKS = ("module missing", "name missing")
# override problems whose upstream def line changed: git names the commits (-G)
OVERRIDE_ATTRIBUTED = (
    "override-missing",
    "super-missing",
    "signature",
    "super-call",
    "shadowed",
)
LEGEND = (
    "patches: . exact  o offset  f fuzz  U already upstream (reverse-applies)  "
    "C conflict  M target file missing/moved\n"
    "         * checked after an earlier patch failed on the same file\n"
    "ovl: . ok  C an overlay file collides with an upstream file  P a destination's "
    "parent is gone\n"
    "imp: . ok  N imported vLLM names/modules missing  ? some unverifiable\n"
    "ovr: . ok  N overrides / super() calls of our subclasses broken  w only warnings "
    "(a method of ours now also upstream)"
)

Say = Callable[[str], None]


# -- the overlay's imports from vLLM ---------------------------------------


@dataclass(frozen=True)
class ImportRef:
    file: str  # tree path of the overlay file
    line: int
    module: str  # absolute dotted module
    name: str | None  # imported name; None for ``import module``
    guarded: bool  # inside ``try: ... except ImportError``

    @property
    def target(self) -> tuple[str, str | None]:
        return (self.module, self.name)


def _module_of(path: str) -> list[str]:
    """Package parts of a tree .py path (the package a relative import starts at)."""
    return list(PurePosixPath(path).parent.parts)


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = []
        if handler.type is None:
            return True
        types = (
            handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        )
        names = [t.id for t in types if isinstance(t, ast.Name)]
        if {"ImportError", "ModuleNotFoundError", "Exception"} & set(names):
            return True
    return False


def overlay_imports(
    sources: dict[str, Path], overlays: tuple[upstream.Overlay, ...], top: str
) -> tuple[list[ImportRef], list[str]]:
    """Imports of upstream modules in the overlay's .py files (and parse errors)."""
    own = [ov.dst.replace("/", ".") for ov in overlays]
    refs: list[ImportRef] = []
    errors: list[str] = []
    for dst, src in sorted(sources.items()):
        if not dst.endswith(".py"):
            continue
        try:
            tree = ast.parse(src.read_bytes(), filename=str(src))
        except SyntaxError as exc:
            errors.append(f"{dst}: {exc}")
            continue
        for node, guarded in _import_nodes(tree, False):
            for module, name in _imported(node, _module_of(dst)):
                if module != top and not module.startswith(top + "."):
                    continue
                if any(module == o or module.startswith(o + ".") for o in own):
                    continue  # ours: another overlay file
                refs.append(ImportRef(dst, node.lineno, module, name, guarded))
    return refs, errors


def _import_nodes(node: ast.AST, guarded: bool):
    """Every import statement under node, and whether a try/except ImportError guards it."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, guarded
        elif isinstance(child, ast.Try) and _catches_import_error(child):
            for stmt in child.body:
                yield from _import_nodes(ast.Module([stmt], []), True)
            for part in (child.handlers, child.orelse, child.finalbody):
                for stmt in part:
                    yield from _import_nodes(ast.Module([stmt], []), guarded)
        else:
            yield from _import_nodes(child, guarded)


def _imported(
    node: ast.Import | ast.ImportFrom, package: list[str]
) -> list[tuple[str, str | None]]:
    """(absolute module, name) pairs of one import statement in ``package``."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    if node.level:
        keep = len(package) - (node.level - 1)
        if keep <= 0:
            return []
        module = ".".join(
            package[:keep] + (node.module.split(".") if node.module else [])
        )
    else:
        module = node.module or ""
    return [(module, a.name) for a in node.names]


def _defined_names(tree: ast.Module) -> tuple[set[str], bool]:
    """Top-level names a module defines, and whether it can define more (``*``, ``__getattr__``)."""
    names: set[str] = set()
    dynamic = False

    def targets(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                targets(elt)
        elif isinstance(node, ast.Starred):
            targets(node.value)

    def walk(body: list[ast.stmt]) -> None:
        nonlocal dynamic
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
                if stmt.name == "__getattr__":
                    dynamic = True
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    targets(t)
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                targets(stmt.target)
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    names.add(a.asname or a.name.split(".")[0])
            elif isinstance(stmt, ast.ImportFrom):
                for a in stmt.names:
                    if a.name == "*":
                        dynamic = True
                    else:
                        names.add(a.asname or a.name)
            elif isinstance(stmt, ast.If):
                walk(stmt.body)
                walk(stmt.orelse)
            elif isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                walk(stmt.body)
                for h in stmt.handlers:
                    walk(h.body)
                walk(stmt.orelse)
                walk(stmt.finalbody)
            elif isinstance(stmt, (ast.With, ast.For)):
                walk(stmt.body)

    walk(tree.body)
    return names, dynamic


def _module_candidates(module: str) -> list[str]:
    base = module.replace(".", "/")
    return [f"{base}.py", f"{base}/__init__.py"]


# -- one version ----------------------------------------------------------


class TreeState:
    """An sdist's files in memory: the member list, read contents, patch results."""

    def __init__(self, members: set[str], raw: dict[str, bytes]) -> None:
        self.members = members
        self.raw = raw
        self.files: dict[str, str | None] = {}

    def read(self, path: str) -> str | None:
        if path in self.files:
            return self.files[path]
        if path in self.raw:
            return decode(self.raw[path])
        if path in self.members:
            raise AssertionError(f"{path} was not read from the tarball")
        return None

    def exists(self, path: str) -> bool:
        if path in self.files:
            return self.files[path] is not None
        return path in self.members

    def dir_exists(self, path: str) -> bool:
        prefix = path.rstrip("/") + "/"
        return any(m.startswith(prefix) for m in self.members) or any(
            p.startswith(prefix) and c is not None for p, c in self.files.items()
        )


_HUNK_LINE = re.compile(
    r"^Hunk #(\d+) (succeeded|FAILED|ignored) at (\d+)"
    r"(?: with fuzz (\d+))?(?: \(offset (-?\d+) lines?\))?"
)


@dataclass
class GnuRun:
    ok: bool
    hunks: dict[int, dict]  # hunk number -> {line, offset, fuzz, failed}
    output: str


def _gnu_patch(
    diff: str, path: str, content: str | None, *, reverse: bool, fuzz: int, dry: bool
) -> tuple[GnuRun, str | None]:
    """Run GNU patch on one file's diff in a temp dir; (result, new content)."""
    exe = shutil.which("patch")
    if exe is None:
        raise PatchsetError(
            "GNU patch is not installed (needed to classify offset/fuzz/reversed "
            "hunks); install it (apt-get install patch)"
        )
    with tempfile.TemporaryDirectory(prefix="vmp-compat-") as tmp:
        root = Path(tmp) / "t"
        root.mkdir()
        target = root / path
        if content is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content.encode("utf-8", "surrogateescape"))
        diff_file = Path(tmp) / "p.diff"
        diff_file.write_bytes(diff.encode("utf-8", "surrogateescape"))
        cmd = [
            exe,
            "-p1",
            "-f",
            f"-F{fuzz}",
            "--no-backup-if-mismatch",
            "-i",
            str(diff_file),
        ]
        if reverse:
            cmd.append("-R")
        if dry:
            cmd.append("--dry-run")
        proc = subprocess.run(
            cmd,
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
        hunks: dict[int, dict] = {}
        for line in proc.stdout.splitlines():
            m = _HUNK_LINE.match(line)
            if m:
                hunks[int(m.group(1))] = {
                    "line": int(m.group(3)),
                    "offset": int(m.group(5) or 0),
                    "fuzz": int(m.group(4) or 0),
                    "failed": m.group(2) != "succeeded",
                }
        new = None
        if not dry and target.is_file():
            new = decode(target.read_bytes())
    return GnuRun(proc.returncode == 0, hunks, proc.stdout + proc.stderr), new


def _file_diff(pf) -> str:
    text = str(pf)
    return text if text.endswith("\n") else text + "\n"


def _target_side(pf) -> str:
    lines: list[str] = []
    for hunk in pf:
        for line in hunk:
            if line.line_type in ("+", " "):
                lines.append(line.value)
    return "".join(lines)


def _hunk_rows(pf, run: GnuRun | None, fuzz_run: GnuRun | None = None) -> list[dict]:
    rows = []
    for i, hunk in enumerate(pf, 1):
        row = {"index": i, "header": _hunk_header(hunk), "result": "exact"}
        info = (fuzz_run.hunks.get(i) if fuzz_run else None) or (
            run.hunks.get(i) if run else None
        )
        if info:
            if info["failed"]:
                row["result"] = "failed"
            elif info["fuzz"]:
                row["result"] = "fuzz"
            elif info["offset"]:
                row["result"] = "offset"
            row.update(line=info["line"], offset=info["offset"], fuzz=info["fuzz"])
        rows.append(row)
    return rows


def check_file(pf, read: Callable[[str], str | None]) -> tuple[dict, str | None, bool]:
    """Classify one file of a patch; (result, new content, content changed)."""
    src, dst = file_paths(pf)
    path = dst or src or "?"
    out: dict = {"path": path, "hunks": []}
    diff = _file_diff(pf)
    if src is None:  # the patch creates the file
        current = read(dst)
        if current is None:
            out["status"] = "exact"
            return out, _target_side(pf), True
        same = current == _target_side(pf)
        out["status"] = "upstream" if same else "conflict"
        out["note"] = (
            "upstream already has this file with the patch's content"
            if same
            else "the patch creates this file but upstream now has one there"
        )
        return out, current, False
    current = read(src)
    if current is None:
        out["status"] = "missing"
        return out, None, False
    forward, _ = _gnu_patch(diff, src, current, reverse=False, fuzz=0, dry=True)
    if forward.ok:
        out["status"] = (
            "offset" if any(h["offset"] for h in forward.hunks.values()) else "exact"
        )
        out["hunks"] = _hunk_rows(pf, forward)
    else:
        back, _ = _gnu_patch(diff, src, current, reverse=True, fuzz=0, dry=True)
        if back.ok:
            out["status"] = "upstream"
            out["hunks"] = [
                {**row, "result": "upstream"} for row in _hunk_rows(pf, None)
            ]
            return out, current, False
        fuzzy, _ = _gnu_patch(diff, src, current, reverse=False, fuzz=2, dry=True)
        out["status"] = "fuzz" if fuzzy.ok else "conflict"
        out["hunks"] = _hunk_rows(pf, forward, fuzzy)
        if not fuzzy.ok and not fuzzy.hunks:
            out["note"] = fuzzy.output.strip()[-400:]
    # The applied result (fuzz allowed; for a conflict, the hunks that apply).
    _, new = _gnu_patch(diff, src, current, reverse=False, fuzz=2, dry=False)
    if dst is None:
        return out, None, True
    return out, new if new is not None else current, True


def check_patch(patch: Patch, state: TreeState) -> dict:
    """Classify one patch against ``state`` and leave its (best-effort) result there."""
    result: dict = {"name": patch.name, "files": []}
    try:
        changes = apply_patch(patch, state.read)
    except PatchLeavesTree as exc:  # never hand such paths to GNU patch
        result["status"] = "conflict"
        result["note"] = exc.describe()
        return result
    except PatchDoesNotApply as exc:
        exact_error = exc
    else:
        for path, change in changes.items():
            state.files[path] = change.content
        result["status"] = "exact"
        result["files"] = [{"path": p, "status": "exact"} for p in changes]
        return result
    if patch.parse_error:
        result["status"] = "conflict"
        result["note"] = f"the patch does not parse: {patch.parse_error}"
        return result
    updates: dict[str, str | None] = {}

    def read(path: str) -> str | None:
        return updates[path] if path in updates else state.read(path)

    for pf in patch.files:
        row, new, changed = check_file(pf, read)
        result["files"].append(row)
        if changed:
            src, dst = file_paths(pf)
            if src and dst is None:
                updates[src] = None
            else:
                updates[dst or src] = new
    state.files.update(updates)
    statuses = [f["status"] for f in result["files"]]
    worst = max(statuses, key=RANK.__getitem__)
    if worst == "exact":
        # GNU patch is content with what exactapply refused (hunk order, modes, ...).
        worst = "offset"
        result["note"] = f"exactapply refused it: {exact_error.reason}"
    elif worst == "upstream" and len(set(statuses)) > 1:
        result["note"] = (
            f"{statuses.count('upstream')} of {len(statuses)} files already have the change"
        )
    result["status"] = worst
    return result


# -- conflicts: the upstream change in the failed hunk's region -------------


def _align(old: list[str], new: list[str]) -> list[tuple[str, int, int, int, int]]:
    return difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()


@functools.lru_cache(maxsize=32)
def _align_texts(old: str, new: str) -> list[tuple[str, int, int, int, int]]:
    return _align(split_lines(old), split_lines(new))


def _map_start(ops, x: int) -> int:
    """Index in new of old line ``x`` (0-based), for the start of a range."""
    for tag, i1, i2, j1, _j2 in ops:
        if i1 <= x < i2:
            return j1 + (x - i1) if tag == "equal" else j1
    return ops[-1][4] if ops else 0


def _map_end(ops, x: int) -> int:
    """Index in new of the exclusive old range end ``x``."""
    for tag, i1, i2, j1, j2 in ops:
        if i1 < x <= i2:
            return j1 + (x - i1) if tag == "equal" else j2
    return 0


def region_change(
    base: str, target: str, start: int, length: int, old_label: str, new_label: str
) -> dict:
    """The diff between base and target around base lines start..start+length-1 (1-based)."""
    old, new = split_lines(base), split_lines(target)
    ops = _align_texts(base, target)
    lo = max(0, start - 1 - CONTEXT)
    hi = min(len(old), start - 1 + max(length, 1) + CONTEXT)
    # widen to whole changes that touch the region
    touched = False
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        if i1 < hi and (i2 > lo or (i1 == i2 and lo <= i1)):
            touched = True
            lo, hi = min(lo, i1), max(hi, i2)
    t_lo = _map_start(ops, lo)
    t_hi = max(_map_end(ops, hi), t_lo) if hi > lo else t_lo
    lines = [
        f"--- {old_label}",
        f"+++ {new_label}",
        f"@@ -{lo + 1},{hi - lo} +{t_lo + 1},{t_hi - t_lo} @@",
    ]
    for tag, i1, i2, j1, j2 in _align(old[lo:hi], new[t_lo:t_hi]):
        if tag == "equal":
            lines += [" " + s.rstrip("\n") for s in old[lo + i1 : lo + i2]]
        else:
            lines += ["-" + s.rstrip("\n") for s in old[lo + i1 : lo + i2]]
            lines += ["+" + s.rstrip("\n") for s in new[t_lo + j1 : t_lo + j2]]
    if len(lines) > MAX_DIFF_LINES:
        lines = lines[:MAX_DIFF_LINES] + [
            f"... ({len(lines) - MAX_DIFF_LINES} more lines)"
        ]
    return {
        "changed": touched,
        "base_range": [lo + 1, hi],
        "target_range": [t_lo + 1, t_hi],
        "diff": "\n".join(lines),
    }


def _similarity(a: str, b: str) -> float:
    sa = {s.strip() for s in a.splitlines() if len(s.strip()) > 3}
    sb = {s.strip() for s in b.splitlines() if len(s.strip()) > 3}
    if not sa or not sb:
        return 0.0
    return len(sa & sb) / len(sa | sb)


# -- the analysis of one version ------------------------------------------


@dataclass
class Inputs:
    """Everything a version's result depends on, besides the sdist."""

    project: Project
    patches: list[Patch]
    overlay_sources: dict[str, Path]
    imports: list[ImportRef]
    import_errors: list[str]
    override_sources: list[overrides.OverlaySource] = dataclasses.field(
        default_factory=list
    )

    @property
    def manifest(self) -> upstream.Manifest:
        return self.project.manifest

    def key(self, version: str, sdist_sha: str) -> str:
        data = {
            "format": FORMAT,
            "version": version,
            "sdist_sha256": sdist_sha,
            "pinned_sha256": self.manifest.sha256,
            "patches": [[p.name, p.sha256] for p in self.patches],
            "overlay_files": sorted(self.overlay_sources),
            "overlays": [[o.src, o.dst] for o in self.manifest.overlays],
            "imports": sorted(
                {json.dumps([r.module, r.name, r.guarded]) for r in self.imports}
            ),
            "overrides": overrides.fingerprint(
                self.override_sources, self.manifest.name
            ),
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


class PinnedBase:
    """The pinned sdist's touched files with 0..i-1 patches applied (lazily read)."""

    def __init__(self, inputs: Inputs) -> None:
        self.inputs = inputs
        self._before: list[dict[str, str | None]] | None = None
        self._read: Callable[[str], str | None] | None = None

    def before(self, index: int, path: str) -> str | None:
        if self._before is None:
            self._before = self._compute()
        states = self._before
        return states[min(index, len(states) - 1)].get(path)

    def read(self, path: str) -> str | None:
        """Any file of the pinned tree with the whole series applied."""
        if self._before is None:
            self._before = self._compute()
        assert self._read is not None
        return self._read(path)

    def _compute(self) -> list[dict[str, str | None]]:
        manifest = self.inputs.manifest
        sdist = pinned_sdist(manifest, lambda _m: None)
        wanted: set[str] = set()
        for p in self.inputs.patches:
            wanted |= touched_paths(p)
        touched = set(wanted)
        wanted |= overrides.wanted_paths(self.inputs.override_sources, manifest.name)
        members, raw = upstream.read_tarball(sdist, manifest, wanted)
        current: dict[str, str | None] = {
            p: decode(raw[p]) if p in raw else None for p in touched
        }
        states = []
        for patch in self.inputs.patches:
            states.append(dict(current))
            try:
                changes = apply_patch(patch, lambda p: current.get(p))
            except PatchDoesNotApply:
                continue
            for path, change in changes.items():
                current[path] = change.content
        states.append(dict(current))
        self._read = tarball_reader(sdist, manifest, members, raw, current)
        return states


def pinned_sdist(manifest: upstream.Manifest, say: Say) -> Path:
    """The pinned sdist, from the cache or (verified against the pin) the index."""
    path = upstream.verified_cached_sdist(manifest)
    if path is not None:
        return path
    path, sha = releases.fetch_release(manifest.version, say, manifest.name)
    if sha != manifest.sha256:
        raise PatchsetError(
            f"the index's sha256 for {manifest.name} {manifest.version} is {sha}, not the "
            f"pinned {manifest.sha256} (patches/upstream.toml); refusing to compare against it"
        )
    return path


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
            wanted.update(_module_candidates(".".join(parts[:i])))
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
        _conflict_regions(row, index, state, base, inputs.manifest.version, version)
        result["patches"].append(row)
    needs_scan = any(
        f["status"] == "missing" for row in result["patches"] for f in row["files"]
    )
    result["overlay"] = _overlay(inputs, state)
    result["imports"] = _imports(inputs, state, top)
    if needs_scan or any(i["status"] != "ok" for i in result["imports"]):
        _locate_moved(result, inputs, sdist, manifest, state, base, top)
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


def _conflict_regions(
    row: dict, index: int, state: TreeState, base: PinnedBase, pinned: str, version: str
) -> None:
    """For each failed hunk: upstream's change of its region.

    Both sides are pristine (the pinned file and the target release's file, as
    git has them at the tags), so only upstream's edits show. The hunk's lines
    are numbered on the pinned file with the earlier patches applied; they are
    mapped back onto the pristine pinned file first.
    """
    for f in row["files"]:
        if f["status"] != "conflict" or not f.get("hunks"):
            continue
        path = f["path"]
        patched, pristine = base.before(index, path), base.before(0, path)
        raw = state.raw.get(path)
        if patched is None or pristine is None or raw is None:
            continue
        ops = _align_texts(patched, pristine) if patched != pristine else None
        for h in f["hunks"]:
            if h["result"] != "failed":
                continue
            m = re.match(r"@@ -(\d+)(?:,(\d+))?", h["header"])
            start = int(m.group(1))
            length = int(m.group(2)) if m.group(2) is not None else 1
            if ops:
                lo = _map_start(ops, start - 1)
                hi = _map_end(ops, start - 1 + length) if length else lo
                start, length = lo + 1, max(hi - lo, 0)
            h["upstream_change"] = region_change(
                pristine,
                decode(raw),
                start,
                length,
                f"{pinned}/{path}",
                f"{version}/{path}",
            )


def _overlay(inputs: Inputs, state: TreeState) -> dict:
    out: dict = {"destinations": [], "collisions": []}
    for ov in inputs.manifest.overlays:
        parent = str(PurePosixPath(ov.dst).parent)
        out["destinations"].append(
            {
                "dst": ov.dst,
                "parent": parent,
                "parent_exists": state.dir_exists(parent),
                "dst_exists_upstream": state.dir_exists(ov.dst),
            }
        )
    for path in sorted(inputs.overlay_sources):
        if state.exists(path):
            out["collisions"].append(path)
    return out


def _imports(inputs: Inputs, state: TreeState, top: str) -> list[dict]:
    """One row per distinct (module, name) the overlay imports from upstream."""
    parsed: dict[str, tuple[set[str], bool] | None] = {}

    def module_file(module: str) -> str | None:
        for cand in _module_candidates(module):
            if state.exists(cand):
                return cand
        return None

    def names_of(path: str) -> tuple[set[str], bool] | None:
        if path not in parsed:
            try:
                parsed[path] = _defined_names(ast.parse(state.read(path) or ""))
            except SyntaxError:
                parsed[path] = None
        return parsed[path]

    rows = []
    refs: dict[tuple[str, str | None], list[ImportRef]] = {}
    for ref in inputs.imports:
        refs.setdefault(ref.target, []).append(ref)
    for (module, name), uses in sorted(refs.items(), key=str):
        row: dict = {"module": module, "name": name}
        if all(u.guarded for u in uses):
            row["guarded"] = True  # every use is inside try/except ImportError
        path = module_file(module)
        if path is None:
            namespace = state.dir_exists(module.replace(".", "/"))
            if namespace and name and module_file(f"{module}.{name}"):
                row.update(status="ok", file=module.replace(".", "/") + "/")
            else:
                row.update(status="module missing")
            rows.append(row)
            continue
        row["file"] = path
        if name is None or name == "*":
            row["status"] = "ok"
        elif module_file(f"{module}.{name}"):
            row["status"] = "ok"  # a submodule
        else:
            names = names_of(path)
            if names is None:
                row["status"] = "unverifiable"
                row["note"] = f"{path} does not parse"
            elif name in names[0]:
                row["status"] = "ok"
            elif names[1]:
                row["status"] = "unverifiable"
                row["note"] = (
                    f"{path} defines names dynamically (* import or __getattr__)"
                )
            else:
                row["status"] = "name missing"
        rows.append(row)
    return rows


def _locate_moved(
    result: dict,
    inputs: Inputs,
    sdist: Path,
    manifest: upstream.Manifest,
    state: TreeState,
    base: PinnedBase,
    top: str,
) -> None:
    """Second pass over the tarball: where did missing files and names go?"""
    py = {m for m in state.members if m.startswith(top + "/") and m.endswith(".py")}
    _, raw = upstream.read_tarball(sdist, manifest, py)
    texts = {p: decode(b) for p, b in raw.items()}
    for index, row in enumerate(result["patches"]):
        for f in row["files"]:
            if f["status"] != "missing":
                continue
            old = base.before(index, f["path"]) or ""
            name = PurePosixPath(f["path"]).name
            same = [m for m in state.members if PurePosixPath(m).name == name]
            scored = sorted(
                ((_similarity(old, texts.get(m, "")), m) for m in same), reverse=True
            )
            how = "same file name"
            if not scored or (name == "__init__.py" and scored[0][0] < 0.3):
                suffix = PurePosixPath(f["path"]).suffix
                pool = (
                    [m for m in texts if m.endswith(suffix)] if suffix == ".py" else []
                )
                scored = sorted(
                    ((_similarity(old, texts[m]), m) for m in pool), reverse=True
                )
                scored = [s for s in scored if s[0] >= 0.3]
                how = "best content match"
            f["candidates"] = [
                {"path": m, "similarity": round(s, 2)} for s, m in scored[:3]
            ]
            if scored:
                f["moved_to"] = scored[0][1]
                f["moved_how"] = how
    for row in result["imports"]:
        if row["status"] == "name missing":
            pattern = re.compile(
                rf"^(?:class|def|async def)\s+{re.escape(row['name'])}\b|^{re.escape(row['name'])}\s*[:=]",
                re.MULTILINE,
            )
            row["defined_in"] = sorted(
                p for p, t in texts.items() if pattern.search(t)
            )[:5]
        elif row["status"] == "module missing":
            last = row["module"].rsplit(".", 1)[-1]
            row["candidates"] = sorted(
                m
                for m in state.members
                if m.endswith((f"/{last}.py", f"/{last}/__init__.py"))
            )[:5]


# -- git attribution -----------------------------------------------------


class UpstreamGit:
    """A vLLM clone with release tags ``v<version>``; names the commits that broke things."""

    def __init__(self, path: Path) -> None:
        self.path = path
        proc = self._git("rev-parse", "--git-dir", check=False)
        if proc.returncode != 0:
            raise PatchsetError(f"--upstream-git {path} is not a git repository")

    def _git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["git", "-C", str(self.path), *args],
            capture_output=True,
            text=True,
            check=False,
            errors="surrogateescape",
            timeout=600,  # git log -L over a release's history
        )
        if check and proc.returncode != 0:
            raise PatchsetError(
                f"git {' '.join(args)} failed in {self.path}: {proc.stderr.strip()}"
            )
        return proc

    def tag(self, version: str) -> str | None:
        for name in (f"v{version}", version):
            if (
                self._git(
                    "rev-parse", "-q", "--verify", f"{name}^{{commit}}", check=False
                ).returncode
                == 0
            ):
                return name
        return None

    def _commits(self, *args: str) -> list[dict]:
        out = self._git("log", "--format=%x00%H%x1f%s", *args).stdout
        seen, commits = set(), []
        for line in out.splitlines():
            if line.startswith("\0"):
                sha, _, subject = line[1:].partition("\x1f")
                if sha not in seen:
                    seen.add(sha)
                    commits.append({"sha": sha, "subject": subject})
        return commits

    def lines(self, old: str, new: str, path: str, start: int, end: int) -> list[dict]:
        """Commits in old..new that changed lines start..end (of ``path`` at ``new``)."""
        end = max(end, start)
        return self._commits(f"-L{start},{end}:{path}", f"{old}..{new}")

    def removed(self, old: str, new: str, *paths: str) -> list[dict]:
        """Commits in old..new that deleted (or renamed away) any of paths."""
        return self._commits("--diff-filter=DR", f"{old}..{new}", "--", *paths)

    def pickaxe(self, old: str, new: str, text: str, path: str) -> list[dict]:
        """Commits in old..new that changed how often ``text`` occurs in path."""
        return self._commits(f"-S{text}", f"{old}..{new}", "--", path)

    def grep_changes(self, old: str, new: str, regex: str, path: str) -> list[dict]:
        """Commits in old..new that added or removed a line of path matching regex."""
        return self._commits(f"-G{regex}", f"{old}..{new}", "--", path)


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
                    git.grep_changes,
                    rf"def {problem['name']}\(",
                    problem["upstream"],
                )
            out["overrides"][label] = entry
    return out


def _override_label(problem: dict) -> str:
    """Stable across releases (unlike the message, which names the release)."""
    subject = ".".join(x for x in (problem["cls"], problem["method"]) if x)
    return " ".join(
        str(x)
        for x in (
            problem["file"],
            subject,
            problem["kind"],
            problem["severity"],
            problem["name"],
        )
        if x
    )


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
                    git, prev, version, git.removed, f["path"]
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
                    git, prev, version, git.lines, f["path"], start, end
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
            entry["commits"] = _attribute(
                git, prev, version, git.pickaxe, row["name"], row["file"]
            )
        else:
            entry["commits"] = _attribute(
                git, prev, version, git.removed, *_module_candidates(row["module"])
            )
    return entry


def _attribute(
    git: UpstreamGit, prev: str, version: str, find: Callable, *args
) -> list[dict] | str:
    """``find(old_tag, new_tag, *args)``, or why it could not run."""
    a, b = git.tag(prev), git.tag(version)
    if a is None or b is None:
        return f"no tag v{prev if a is None else version} in {git.path}"
    try:
        return find(a, b, *args)
    except PatchsetError as exc:
        return str(exc)


# -- the run -------------------------------------------------------------


def load_inputs(project: Project) -> Inputs:
    patches = load_patches(project)
    sources = project.overlay_sources()
    refs, errors = overlay_imports(
        sources, project.manifest.overlays, project.manifest.name
    )
    return Inputs(project, patches, sources, refs, errors, overlay_python(project))


def result_cache(version: str) -> Path:
    return upstream.cache_dir() / "compat" / f"{version}.json"


def run_compat(
    project: Project,
    versions: list[str],
    *,
    upstream_git: Path | None = None,
    use_cache: bool = True,
    say: Say,
) -> dict:
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
            f"{prefix} {len(inputs.patches)} patches: {_count_text(res['counts'])}; "
            f"{_overlay_text(res)}; {_imports_text(res)}; {_overrides_text(res)} "
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


def _count_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[s]} {s}" for s in CODES if counts.get(s)) or "none"


def _overlay_text(res: dict) -> str:
    ov = res["overlay"]
    gone = [d["dst"] for d in ov["destinations"] if not d["parent_exists"]]
    bits = []
    if ov["collisions"]:
        bits.append(f"overlay: {len(ov['collisions'])} file(s) collide")
    if gone:
        bits.append(f"overlay: {len(gone)} destination parent(s) gone")
    return "; ".join(bits) or "overlay ok"


def _broken_imports(res: dict) -> list[dict]:
    return [
        i for i in res["imports"] if i["status"] in ("module missing", "name missing")
    ]


def _imports_text(res: dict) -> str:
    broken = _broken_imports(res)
    ok = sum(1 for i in res["imports"] if i["status"] == "ok")
    text = f"imports {ok} ok"
    if broken:
        text += f", {len(broken)} broken"
    unsure = sum(1 for i in res["imports"] if i["status"] == "unverifiable")
    if unsure:
        text += f", {unsure} unverifiable"
    return text


def _overrides_text(res: dict) -> str:
    ov = res.get("overrides") or {}
    if not ov.get("classes") and not ov.get("problems"):
        return "no subclasses of upstream classes"
    bits = [f"{n} {what}" for what in ("errors", "warnings") if (n := ov.get(what))]
    return f"overrides of {len(ov['classes'])} subclasses: {', '.join(bits) or 'ok'}"


def _overrides_code(res: dict) -> str:
    ov = res.get("overrides") or {}
    if ov.get("errors"):
        return str(ov["errors"])
    return "w" if ov.get("warnings") else "."


def problems_found(report: dict) -> bool:
    for res in report["versions"]:
        if any(r["status"] in BREAKS for r in res["patches"]):
            return True
        if _overlay_text(res) != "overlay ok" or _broken_imports(res):
            return True
        if (res.get("overrides") or {}).get("errors"):
            return True
    return False


# -- rendering -----------------------------------------------------------


def _short(name: str, index: int) -> str:
    m = re.match(r"(\d{4})-", name)
    return m.group(1) if m else f"#{index + 1}"


def render(report: dict) -> str:
    series = report["series"]
    cols = [_short(p["name"], i) for i, p in enumerate(series)]
    head = (
        f"{'version':<9}"
        + "".join(f"{c:>6}" for c in cols)
        + "   ovl  imp  ovr   applies"
    )
    lines = [
        (
            f"compat: {len(series)} patches + overlay imports vs "
            f"{report['pinned']['name']} releases (pinned {report['pinned']['version']})"
        ),
        head,
    ]
    for res in report["versions"]:
        cells = []
        for row in res["patches"]:
            code = CODES[row["status"]] + (
                "*" if row.get("after_failed_same_files") else ""
            )
            cells.append(f"{code:>6}")
        ov = res["overlay"]
        ovl = (
            "C"
            if ov["collisions"]
            else (
                "P" if any(not d["parent_exists"] for d in ov["destinations"]) else "."
            )
        )
        broken = _broken_imports(res)
        imp = (
            str(len(broken))
            if broken
            else (
                "?"
                if any(i["status"] == "unverifiable" for i in res["imports"])
                else "."
            )
        )
        c = res["counts"]
        applies = sum(c.get(s, 0) for s in APPLIES)
        detail = ", ".join(f"{c[s]} {s}" for s in APPLIES if c.get(s))
        up = f"; {c['upstream']} upstream" if c.get("upstream") else ""
        ovr = _overrides_code(res)
        lines.append(
            f"{res['version']:<9}" + "".join(cells) + f"{ovl:>6}{imp:>5}{ovr:>5}   "
            f"{applies}/{len(series)}" + (f" ({detail})" if detail else "") + up
        )
    lines += ["legend:", *("  " + x for x in LEGEND.splitlines())]
    lines.append("patches:")
    for col, p in zip(cols, series):
        lines.append(f"  {col}  {p['subject']}")
    fb = report["first_breaks"]
    if fb["patches"] or fb["imports"] or fb.get("overrides"):
        lines.append("first break:")
    for col, p in zip(cols, series):
        entry = fb["patches"].get(p["name"])
        if not entry:
            continue
        after = entry.get("after_failed_same_files")
        lines.append(
            f"  {col}  {entry['status']} from {entry['version']} (after {entry['after']})"
            + (
                f"; checked after failed {', '.join(_short(n, 0) for n in after)}, "
                f"alone on {entry['version']}'s files: {entry.get('alone_on_target')}"
                if after
                else ""
            )
        )
        for cause in entry["causes"]:
            if "hunk" in cause:
                lines.append(
                    f"        {cause['file']} hunk {cause['hunk']}: {cause['hunk_header']}"
                )
                if cause.get("note"):
                    lines.append(f"        {cause['note']}")
                for dl in (cause.get("upstream_change") or "").splitlines()[2:14]:
                    lines.append(f"          {dl}")
            else:
                moved = cause.get("moved_to")
                lines.append(
                    f"        {cause['file']} is gone"
                    + (f"; likely moved to {moved}" if moved else "")
                )
            commits = cause.get("commits")
            if isinstance(commits, str):
                lines.append(f"        upstream commits: {commits}")
            elif commits is not None:
                shown = (
                    ", ".join(f"{c['sha'][:12]} {c['subject']!r}" for c in commits[:5])
                    or "none found"
                )
                lines.append(f"        upstream commits: {shown}")
    for res in report["versions"]:
        ov = res["overlay"]
        for path in ov["collisions"]:
            lines.append(
                f"  overlay {res['version']}: {path} collides with an upstream file"
            )
        for d in ov["destinations"]:
            if not d["parent_exists"]:
                lines.append(
                    f"  overlay {res['version']}: {d['parent']}/ (parent of {d['dst']}) is gone"
                )
    for label, entry in fb["imports"].items():
        where = entry.get("defined_in") or entry.get("candidates")
        lines.append(
            f"  import {label}: {entry['status']} from {entry['version']} (after {entry['after']})"
            + (f"; now in {', '.join(where)}" if where else "")
        )
        commits = entry.get("commits")
        if isinstance(commits, list):
            shown = (
                ", ".join(f"{c['sha'][:12]} {c['subject']!r}" for c in commits[:5])
                or "none found"
            )
            lines.append(f"        upstream commits: {shown}")
        elif commits:
            lines.append(f"        upstream commits: {commits}")
    for entry in (fb.get("overrides") or {}).values():
        subject = ".".join(x for x in (entry["cls"], entry["method"]) if x)
        lines.append(
            f"  override {entry['where']} {subject}: {entry['kind']} ({entry['severity']}) "
            f"from {entry['version']} (after {entry['after']})"
        )
        lines.append(f"        {entry['message']}")
        if entry.get("commits") is not None:
            lines.append(f"        upstream commits: {_commits_text(entry['commits'])}")
    return "\n".join(lines)


def _commits_text(commits: list[dict] | str) -> str:
    if isinstance(commits, str):  # why they could not be named
        return commits
    shown = ", ".join(f"{c['sha'][:12]} {c['subject']!r}" for c in commits[:5])
    return shown or "none found"


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


def exit_code(report: dict) -> int:
    return EXIT_PROBLEMS if problems_found(report) else EXIT_OK
