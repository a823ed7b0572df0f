"""Zero-fuzz, zero-offset patch application.

Every hunk must match the file EXACTLY at the line numbers its header states:
each context and removed line, byte for byte (line ends included). No offset
search, no fuzz, no whitespace leniency. This is stricter than ``patch -F0``
(which still accepts offsets) and is what keeps a series honest across
rebases: a patch that only applies somewhere else has to be refreshed.

``apply_patch`` works on text held in memory: it takes a reader for the
current contents and returns the new contents, touching nothing on disk, so
the same code validates a series against the pristine tarball (``check``)
and against the real tree (``apply``). A patch is all-or-nothing: if any hunk
of any file does not match, nothing is returned.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import unidiff

from . import confine
from .errors import ProblemsFound
from .series import Patch, split_lines

_DEV_NULL = "/dev/null"
_MODE_LINE = re.compile(r"^(?:new file mode|new mode) (\d+)$")

Reader = Callable[[str], "str | None"]


@dataclass
class FileResult:
    """New state of one file: content None means the file is deleted."""

    path: str
    content: str | None
    mode: int | None = None  # git mode from the patch (0o100755, ...), if any

    @property
    def executable(self) -> bool | None:
        return None if self.mode is None else bool(self.mode & 0o111)


class PatchDoesNotApply(ProblemsFound):
    """A hunk (or a file operation) of a patch does not match exactly."""

    def __init__(
        self,
        patch: str,
        file: str,
        reason: str,
        *,
        hunk_index: int | None = None,
        hunk_count: int | None = None,
        hunk_header: str | None = None,
        line: int | None = None,
        expected: str | None = None,
        actual: str | None = None,
        offset: int | None = None,
    ) -> None:
        self.patch = patch
        self.file = file
        self.reason = reason
        self.hunk_index = hunk_index
        self.hunk_count = hunk_count
        self.hunk_header = hunk_header
        self.line = line
        self.expected = expected
        self.actual = actual
        self.offset = offset
        self.note: str | None = None
        super().__init__(self.describe())

    def set_note(self, note: str) -> None:
        """Add what the caller did about it (e.g. where the tree was left)."""
        self.note = note
        self.args = (self.describe(),)

    def describe(self) -> str:
        lines = [f"patch {self.patch} does not apply exactly (zero fuzz, no offset):"]
        if self.file:
            where = f"  file {self.file}"
            if self.hunk_index is not None:
                where += (
                    f", hunk {self.hunk_index} of {self.hunk_count}: {self.hunk_header}"
                )
            lines.append(where)
        lines.append(f"  {self.reason}")
        if self.line is not None:
            lines.append(f"  first mismatching line {self.line}:")
            lines.append(f"    expected: {_show(self.expected)}")
            lines.append(f"    actual:   {_show(self.actual)}")
        if self.offset is not None:
            lines.append(
                f"  the hunk's lines do match at offset {self.offset:+d} "
                f"(line {self.line_of_offset()}); offsets are refused: refresh "
                "the patch"
            )
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)

    def line_of_offset(self) -> int | None:
        if self.offset is None or self.hunk_header is None:
            return None
        m = re.match(r"@@ -(\d+)", self.hunk_header)
        return int(m.group(1)) + self.offset if m else None

    def to_json(self) -> dict:
        return {
            "patch": self.patch,
            "file": self.file,
            "reason": self.reason,
            "hunk": self.hunk_index,
            "hunk_count": self.hunk_count,
            "hunk_header": self.hunk_header,
            "line": self.line,
            "expected": self.expected,
            "actual": self.actual,
            "offset": self.offset,
            "note": self.note,
        }


class PatchLeavesTree(PatchDoesNotApply):
    """``confine`` refuses a path of the patch; nothing is applied."""

    def __init__(
        self, patch: str, found: list[confine.Violation], tree: str = ""
    ) -> None:
        self.violations = found
        self.tree = tree
        super().__init__(patch, found[0].path, found[0].message(tree))

    def describe(self) -> str:
        lines = [f"patch {self.patch} is refused by the confinement rules:"]
        lines += [f"  {v.message(self.tree)}" for v in self.violations]
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            **super().to_json(),
            "confinement": [v.to_json(self.tree) for v in self.violations],
        }


def _show(line: str | None) -> str:
    if line is None:
        return "<end of file>"
    if line.endswith("\n"):
        return repr(line[:-1])
    return repr(line) + " (no newline at end of file)"


def strip_p1(name: str | None) -> str | None:
    """Path of a diff side with its first component removed (``-p1``)."""
    if name is None or name == _DEV_NULL:
        return None
    name = name.split("\t", 1)[0]
    if "/" not in name:
        return name
    return name.split("/", 1)[1]


def file_paths(pf: unidiff.PatchedFile) -> tuple[str | None, str | None]:
    """(source path, target path) of a patched file; None for /dev/null."""
    return strip_p1(pf.source_file), strip_p1(pf.target_file)


def touched_paths(patch: Patch) -> set[str]:
    paths: set[str] = set()
    for pf in patch.files:
        paths.update(p for p in file_paths(pf) if p)
    return paths


def _hunk_sides(hunk: unidiff.Hunk) -> tuple[list[str], list[str]]:
    """Source-side and target-side lines, honouring 'No newline at end of file'."""
    source: list[str] = []
    target: list[str] = []
    last_type = None
    for line in hunk:
        kind = line.line_type
        if kind == "\\":
            # The marker applies to the line just before it.
            if last_type in (" ", "-") and source:
                source[-1] = source[-1].removesuffix("\n")
            if last_type in (" ", "+") and target:
                target[-1] = target[-1].removesuffix("\n")
            continue
        if kind == " ":
            source.append(line.value)
            target.append(line.value)
        elif kind == "-":
            source.append(line.value)
        elif kind == "+":
            target.append(line.value)
        else:  # trailing empty lines after the hunk
            continue
        last_type = kind
    return source, target


def _hunk_header(hunk: unidiff.Hunk) -> str:
    text = f"@@ -{hunk.source_start},{hunk.source_length} +{hunk.target_start},{hunk.target_length} @@"
    if hunk.section_header:
        text += f" {hunk.section_header}"
    return text


def _find(lines: list[str], block: list[str]) -> list[int]:
    if not block:
        return []
    n = len(block)
    first = block[0]
    return [
        i
        for i in range(len(lines) - n + 1)
        if lines[i] == first and lines[i : i + n] == block
    ]


def _apply_hunks(patch_name: str, path: str, text: str, pf: unidiff.PatchedFile) -> str:
    lines = split_lines(text)
    out: list[str] = []
    pos = 0
    count = len(pf)
    for index, hunk in enumerate(pf, 1):
        source, target = _hunk_sides(hunk)
        start = hunk.source_start - 1 if hunk.source_length > 0 else hunk.source_start
        header = _hunk_header(hunk)
        if start < pos:
            raise PatchDoesNotApply(
                patch_name,
                path,
                f"hunk starts at line {hunk.source_start}, inside the previous hunk "
                "(hunks must be in order and must not overlap)",
                hunk_index=index,
                hunk_count=count,
                hunk_header=header,
            )
        actual = lines[start : start + len(source)]
        if actual != source:
            for i, expected_line in enumerate(source):
                actual_line = actual[i] if i < len(actual) else None
                if actual_line != expected_line:
                    break
            found = [j - start for j in _find(lines, source)]
            offset = min(found, key=abs) if found else None
            reason = (
                "the hunk matches elsewhere in the file, not at its stated line"
                if offset is not None
                else "the hunk's context or removed lines differ from the file"
            )
            raise PatchDoesNotApply(
                patch_name,
                path,
                reason,
                hunk_index=index,
                hunk_count=count,
                hunk_header=header,
                line=start + i + 1,
                expected=expected_line,
                actual=actual_line,
                offset=offset,
            )
        out.extend(lines[pos:start])
        out.extend(target)
        pos = start + len(source)
    out.extend(lines[pos:])
    return "".join(out)


def _mode(pf: unidiff.PatchedFile) -> int | None:
    for line in pf.patch_info or []:
        m = _MODE_LINE.match(line.strip())
        if m:
            return int(m.group(1), 8)
    return None


def apply_patch(patch: Patch, read: Reader) -> dict[str, FileResult]:
    """Validate a whole patch against ``read`` and return the new file states.

    ``read(path)`` gives the current text of a file (None when it does not
    exist). Raises PatchDoesNotApply naming the file, the hunk and the first
    mismatching line; nothing is returned (so nothing is written) in that case.
    First of all, ``confine`` must accept the patch (regular text files inside
    the tree), else PatchLeavesTree.
    """
    found = confine.violations(patch)
    if found:
        raise PatchLeavesTree(patch.name, found)
    if patch.parse_error:
        raise PatchDoesNotApply(
            patch.name, "", f"it cannot be parsed: {patch.parse_error}"
        )
    results: dict[str, FileResult] = {}

    def current(path: str) -> str | None:
        if path in results:
            return results[path].content
        return read(path)

    for pf in patch.files:
        src, dst = file_paths(pf)
        path = dst or src or "?"
        if src and dst and src != dst:
            raise PatchDoesNotApply(
                patch.name,
                path,
                f"renames ({src} -> {dst}) are not supported; write them as a "
                "deletion and an addition (git format-patch --no-renames)",
            )
        mode = _mode(pf)
        if src is None and dst is None:
            raise PatchDoesNotApply(
                patch.name, path, "both sides of the diff are /dev/null"
            )
        if src is None:  # new file
            if current(dst) is not None:
                raise PatchDoesNotApply(
                    patch.name, dst, "the patch creates this file but it already exists"
                )
            new = _apply_hunks(patch.name, dst, "", pf)
            results[dst] = FileResult(dst, new, mode or 0o100644)
            continue
        old = current(src)
        if old is None:
            raise PatchDoesNotApply(
                patch.name, src, "the file the patch changes does not exist"
            )
        new = _apply_hunks(patch.name, src, old, pf)
        if dst is None:  # deleted file: the hunks must remove all of it
            if new:
                raise PatchDoesNotApply(
                    patch.name,
                    src,
                    "the patch deletes this file but the file has lines the patch does not remove",
                )
            results[src] = FileResult(src, None)
        else:
            results[dst] = FileResult(dst, new, mode)
    return results
