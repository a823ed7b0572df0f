"""One patch against a release's files: does it apply, how, and if not, why.

Each file of a patch is classified on the files the earlier patches left:

- ``exact``: every hunk matches at its stated line (``exactapply``);
- ``offset``: GNU ``patch -F0`` applies it, some hunks at other lines;
- ``upstream``: ``patch -R -F0`` applies, upstream already has the change;
- ``fuzz``: only ``patch`` with its default fuzz (2) applies it;
- ``conflict``: some hunks do not apply even with fuzz;
- ``missing``: a file the patch changes is gone.

A patch whose header claims it is upstream's own change (``Backport [...]``,
``Inappropriate [superseded by ...]``) is ``obsolete`` instead, when the
release has that change: every file reverse-applies, or every hunk's added
lines are already there (its removed ones gone). Drop it when rolling there.

The fuzz-applied result (and, for a conflict, the hunks that do apply) is
what the next patches see. A failed hunk is explained by upstream's own
change of its region (``conflict_regions``: the pristine pinned file against
the pristine release file, the hunk mapped back past the earlier patches); a
missing file by its likely new path (``locate_moved_files``).
"""

from __future__ import annotations

import difflib
import functools
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from ..errors import PatchsetError
from ..exactapply import (
    PatchDoesNotApply,
    PatchLeavesTree,
    _hunk_header,
    apply_patch,
    file_paths,
)
from ..headers import claims_upstream_change
from ..series import Patch, decode, split_lines

if TYPE_CHECKING:
    from .inputs import PinnedBase, TreeState

# status -> grid code, in increasing severity
CODES = {
    "exact": ".",
    "offset": "o",
    "fuzz": "f",
    "upstream": "U",
    "obsolete": "D",  # a patch's verdict only, never a file's
    "conflict": "C",
    "missing": "M",
}
RANK = {status: i for i, status in enumerate(CODES)}
APPLIES = ("exact", "offset", "fuzz")
BREAKS = ("conflict", "missing")
CONTEXT = 3  # lines around a failed hunk's region in the upstream-change diff
MAX_DIFF_LINES = 60

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
    statuses = [f["status"] for f in result["files"]]
    obsolete = _obsolete(patch, result["files"], state.read)
    if obsolete:
        # the release has the change: it stays as the release has it
        result["status"] = "obsolete"
        result["obsolete"] = obsolete
        return result
    state.files.update(updates)
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


# -- obsolete: a backport whose change the release has ----------------------


def _obsolete(
    patch: Patch, rows: list[dict], read: Callable[[str], str | None]
) -> dict | None:
    """{claim, how} when the patch claims to be upstream's change and ``read``'s
    release has it, else None."""
    claim = claims_upstream_change(patch)
    if claim is None or not rows:
        return None
    statuses = {row["status"] for row in rows}
    if statuses == {"upstream"}:
        return {"claim": claim, "how": "the patch reverse-applies"}
    for pf, row in zip(patch.files, rows):
        if row["status"] != "upstream" and not _change_present(pf, read):
            return None
    return {"claim": claim, "how": "the release has every hunk's added lines"}


def _meaningful(lines: list[str]) -> list[str]:
    return [ln.rstrip() for ln in lines if ln.strip()]


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def _change_present(pf, read: Callable[[str], str | None]) -> bool:
    """Whether one file of a patch is already as the patch would leave it.

    Blank lines and trailing blanks aside, each hunk's added lines must appear
    in the file as one run; a hunk that only removes lines must find them gone.
    """
    src, dst = file_paths(pf)
    current = read(dst or src or "")
    if dst is None:  # the patch deletes the file
        return current is None
    if current is None:
        return False
    have = _meaningful(split_lines(current))
    for hunk in pf:
        added = _meaningful([ln.value for ln in hunk if ln.line_type == "+"])
        removed = _meaningful([ln.value for ln in hunk if ln.line_type == "-"])
        if added and not _contains(have, added):
            return False
        if not added and removed and _contains(have, removed):
            return False
    return True


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


def conflict_regions(
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


def locate_moved_files(
    rows: list[dict], state: TreeState, base: PinnedBase, texts: dict[str, str]
) -> None:
    """Where each missing file of each patch likely went (``texts``: every .py file
    of the release): the same file name elsewhere, else the best content match."""
    for index, row in enumerate(rows):
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
