"""Confinement: every path a patch or the overlay touches stays inside the tree.

The policy lives here, as functions over a parsed ``Patch`` (and, when there
is one, the tree on disk); ``check``, ``apply``, ``export`` and ``status`` all
ask it and report what it finds. A path is refused when it

- is absolute, or has a ``..`` component (``a/../../evil.txt``),
- has a ``.git`` component (it would write into a git dir: hooks, config),
- passes through a symlink that leads out of the tree: one on disk, or one
  created by an earlier file or patch of the series (git mode 120000),
- is a new symlink whose target leads out of the tree.

The raw patch text is scanned, not unidiff's view of it: every line naming a
path counts (``diff --git``, ``---``/``+++``, ``rename``/``copy from``/``to``,
``Binary files ... differ``), so binary patches, renames, copies and patches
that do not even parse are covered, and each finding names its line.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from . import overlay
from .errors import ProblemsFound
from .series import Patch, _split_message_and_diff, decode, split_lines

if TYPE_CHECKING:
    from .project import Project
    from .upstream import Overlay

Kind = Literal[
    "absolute",
    "parent",
    "git-dir",
    "through-symlink",
    "symlink-target",
    "source-symlink",
]
# Symlinks as a series leaves them: tree path -> target; None = known not a link.
Links = dict[str, str | None]

_SYMLINK_MODE = "120000"
_MAX_LINKS = 40  # symlink hops before a path counts as a loop (as in Linux)
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_BINARY = re.compile(r"^Binary files (.+?) and (.+) differ$")
_NAMED = re.compile(r"^(rename from|rename to|copy from|copy to) (.+)$")
_MODE = re.compile(r"^(?:new file mode|new mode|index \S+) (\d+)$")
_FIX_PATHS = "a patch may only touch files inside the tree: fix the diff's a/ b/ paths"

# kind -> (what is wrong, what to do); {tree} is "the tree <its path>"
_REASONS: dict[Kind, tuple[str, str]] = {
    "absolute": ("is absolute, not inside {tree}", _FIX_PATHS),
    "parent": ("leaves {tree} through '..'", _FIX_PATHS),
    "git-dir": (
        "has a .git component: it would write into a git directory",
        "a patch must never touch git metadata (hooks, config): drop that file",
    ),
    "through-symlink": (
        "passes through a symlink that leads out of {tree}",
        "patch the real file inside the tree instead, or remove the symlink",
    ),
    "symlink-target": (
        "is a symlink whose target leads out of {tree}",
        "point the symlink at a relative path inside the tree, or ship the file",
    ),
    "source-symlink": (
        "is a symlink leading out of its overlay folder",
        "put the file itself in the overlay folder instead of a symlink",
    ),
}


@dataclass(frozen=True)
class Violation:
    """One path that leaves the tree: where it is written and why it is refused."""

    patch: str  # patch file name; for the overlay, the folder mapping
    line: int | None  # line in the patch file (None for the overlay)
    path: str
    kind: Kind
    detail: str = ""  # e.g. which symlink, and its target

    def message(self, tree: str = "") -> str:
        """One line: patch, line, path, what is wrong and what to do (``tree``: its path)."""
        reason, fix = _REASONS[self.kind]
        where = f"patch {self.patch} line {self.line}" if self.line else self.patch
        detail = f" ({self.detail})" if self.detail else ""
        reason = reason.format(tree=f"the tree {tree}" if tree else "the tree")
        return f"{where}: path {self.path} {reason}{detail}; {fix}"

    def to_json(self, tree: str = "") -> dict:
        return {
            "patch": self.patch,
            "line": self.line,
            "path": self.path,
            "kind": self.kind,
            "detail": self.detail,
            "message": self.message(tree),
        }


@dataclass
class FileEntry:
    """One file section of a patch: each line naming it, and what it becomes."""

    names: list[tuple[int, str]] = field(default_factory=list)  # (line, tree path)
    old: str | None = None
    new: str | None = None
    new_line: int = 0
    mode: str | None = None  # git mode of the new side, when the patch states one
    deleted: bool = False
    renamed: bool = False
    hunks: bool = False
    new_side: list[str] | None = None  # new-side hunk lines of a symlink (its target)

    @property
    def symlink(self) -> bool:
        return self.mode == _SYMLINK_MODE

    @property
    def target(self) -> str | None:
        if not self.symlink or self.deleted or self.new_side is None:
            return None
        return "".join(self.new_side).rstrip("\r\n")

    def add(self, line: int, path: str | None, new: bool) -> None:
        if not path:
            return
        self.names.append((line, path))
        if new:
            self.new, self.new_line = path, line
        else:
            self.old = path


def _unquote(name: str) -> str:
    """A git C-quoted name (``"a/\\303\\251"``) as text; other names unchanged."""
    if len(name) < 2 or not (name.startswith('"') and name.endswith('"')):
        return name
    try:
        raw = name[1:-1].encode("latin-1").decode("unicode_escape").encode("latin-1")
    except (UnicodeError, ValueError):
        return name[1:-1]
    return raw.decode("utf-8", "surrogateescape")


def _side(name: str) -> str | None:
    """A diff side's tree path (``-p1``): ``b/x`` -> ``x``; absolute stays absolute."""
    name = _unquote(name.split("\t", 1)[0].rstrip("\r"))
    if name == "/dev/null":
        return None
    if name.startswith("/"):
        return name
    return name.split("/", 1)[1] if "/" in name else name


def _git_names(rest: str) -> tuple[str, str]:
    """The two names of a ``diff --git`` line, prefixes kept."""
    rest = rest.rstrip("\r")
    quoted = r'"(?:[^"\\]|\\.)*"'
    m = re.match(rf"^({quoted}|\S+) ({quoted})$", rest) or re.match(
        rf"^({quoted}) (.+)$", rest
    )
    if m:
        return m.group(1), m.group(2)
    spaces = [i for i, c in enumerate(rest) if c == " "]
    for i in spaces:  # unquoted names with spaces: the split where both agree
        a, b = rest[:i], rest[i + 1 :]
        if a.split("/", 1)[-1] == b.split("/", 1)[-1]:
            return a, b
    a, _, b = rest.partition(" ")
    return a, b


def scan(patch: Patch) -> list[FileEntry]:
    """Every file the patch names, in order, with the patch-file line of each name."""
    lines = split_lines(decode(patch.raw))
    start = len(_split_message_and_diff(lines)[0])
    files: list[FileEntry] = []
    old = new = 0  # lines left in the current hunk

    def entry(fresh: bool = False) -> FileEntry:
        if fresh or not files:
            files.append(FileEntry())
        return files[-1]

    for lineno, text in enumerate(lines[start:], start + 1):
        line = text.rstrip("\n")
        if old > 0 or new > 0:  # inside a hunk: content, never a header
            tag = line[:1]
            old -= tag in (" ", "", "-")
            new -= tag in (" ", "", "+")
            side = files[-1].new_side
            if side is not None and tag in (" ", "", "+"):
                side.append(line[1:] + "\n")
            if tag in (" ", "", "-", "+", "\\"):
                continue
            old = new = 0  # a malformed hunk ends here: read the line as a header
        following = lines[lineno] if lineno < len(lines) else ""
        if line.startswith("diff --git "):
            a, b = _git_names(line[len("diff --git ") :])
            f = entry(fresh=True)
            f.add(lineno, _side(a), False)
            f.add(lineno, _side(b), True)
        elif line.startswith("--- ") and following.startswith("+++ "):
            entry(fresh=not files or files[-1].hunks).add(
                lineno, _side(line[4:]), False
            )
        # outside a hunk: always a header (as unidiff reads it)
        elif line.startswith("+++ "):
            entry().add(lineno, _side(line[4:]), True)
        elif m := _NAMED.match(line):
            f = entry()
            f.add(lineno, _unquote(m.group(2).rstrip("\r")), m.group(1).endswith(" to"))
            f.renamed = f.renamed or m.group(1).startswith("rename")
        elif m := _BINARY.match(line):
            f = entry()
            f.add(lineno, _side(m.group(1)), False)
            f.add(lineno, _side(m.group(2)), True)
        elif m := _MODE.match(line.rstrip("\r")):
            entry().mode = m.group(1)
        elif line.startswith("deleted file mode "):
            entry().deleted = True
        elif m := _HUNK.match(line):
            f = entry()
            f.hunks = True
            old, new = int(m.group(1) or 1), int(m.group(2) or 1)
            if f.symlink and f.new_side is None:
                f.new_side = []
    # and every name unidiff (so apply) reads, whatever the scan above made of the text
    seen = {path for f in files for _, path in f.names}
    for pf in patch.files:
        for name, new in ((pf.source_file, False), (pf.target_file, True)):
            path = _side(name) if name else None
            if path and path not in seen:
                found = next((i for i, t in enumerate(lines, 1) if name in t), 0)
                extra = FileEntry()
                extra.add(found, path, new)
                files.append(extra)
                seen.add(path)
    return files


# -- the policy -------------------------------------------------------------------


def _in_git_dir(parts: Iterable[str]) -> bool:
    return any(p.lower() == ".git" for p in parts)


def _lexical(path: str) -> Kind | None:
    """What is wrong with a path as written, before any symlink is followed."""
    if path.startswith("/"):
        return "absolute"
    parts = path.split("/")
    if ".." in parts:
        return "parent"
    if _in_git_dir(parts):
        return "git-dir"
    return None


def _link(path: str, links: Mapping[str, str | None], root: Path | None) -> str | None:
    if path in links:
        return links[path]
    if root is not None and (root / path).is_symlink():
        return os.readlink(root / path)
    return None


def _escape(
    path: str, links: Mapping[str, str | None], root: Path | None, follow_last: bool
) -> tuple[str, str] | None:
    """The symlink ``(link, target)`` through which ``path`` leaves the tree (or
    reaches a .git dir); None when it stays inside. Links are the series' own
    (mode 120000 files) over the ones on disk under ``root``."""
    todo = path.split("/")[::-1]  # a stack: next component last
    out: list[str] = []
    via: tuple[str, str] | None = None
    hops = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                return via or (path, "..")
            out.pop()
            continue
        out.append(part)
        if not todo and not follow_last:
            break
        target = _link("/".join(out), links, root)
        if target is None:
            continue
        via, hops = ("/".join(out), target), hops + 1
        if target.startswith("/") or hops > _MAX_LINKS:
            return via
        out.pop()
        todo.extend(target.split("/")[::-1])
    if via and _in_git_dir(out):
        return via
    return None


def _check(
    patch: Patch, root: Path | None, links: Mapping[str, str | None]
) -> tuple[list[Violation], Links]:
    """Violations of one patch, and the symlinks the tree has after it."""
    links = dict(links)
    found: dict[tuple[str, Kind], Violation] = {}

    def flag(line: int, path: str, kind: Kind, detail: str = "") -> None:
        found.setdefault((path, kind), Violation(patch.name, line, path, kind, detail))

    for f in scan(patch):
        for line, path in f.names:
            if kind := _lexical(path):
                flag(line, path, kind)
            elif via := _escape(path, links, root, follow_last=not f.symlink):
                flag(line, path, "through-symlink", f"{via[0]} -> {via[1]}")
        target = f.target
        if target is not None and f.new and not _lexical(f.new):
            dest = posixpath.join(posixpath.dirname(f.new), target)
            if (
                target.startswith("/")
                or _in_git_dir(target.split("/"))
                or _escape(dest, links, root, follow_last=True)
            ):
                flag(f.new_line, f.new, "symlink-target", f"-> {target}")
        # what the tree holds after this file: symlinks the next paths may pass
        if f.renamed and f.old in links and f.new:
            links[f.new] = links[f.old]
        if f.old and (f.deleted or f.renamed):
            links[f.old] = None
        if f.new and not f.deleted and f.mode:
            links[f.new] = target if f.symlink else None
    return list(found.values()), links


def violations(
    patch: Patch, root: Path | None = None, links: Mapping[str, str | None] = {}
) -> list[Violation]:
    """Paths of ``patch`` that leave the tree (``root``: the tree on disk, if any;
    ``links``: symlinks made by earlier patches, see ``series_violations``)."""
    return _check(patch, root, links)[0]


def series_violations(
    patches: Iterable[Patch], root: Path | None = None
) -> tuple[list[Violation], Links]:
    """Violations of every patch, in series order (each sees the symlinks the
    earlier ones create), and the symlinks the series leaves behind."""
    found: list[Violation] = []
    links: Links = {}
    for patch in patches:
        more, links = _check(patch, root, links)
        found += more
    return found, links


def overlay_violations(
    root: Path,
    overlays: Iterable[Overlay],
    tree: Path | None = None,
    links: Mapping[str, str | None] = {},
) -> list[Violation]:
    """Overlay destinations that leave the tree, and overlay source files that
    are symlinks out of their folder (their target would be copied in)."""
    found = []
    project = root.resolve()
    for ov in overlays:
        label = f"overlay {ov.src}/ -> {ov.dst}/ (patches/upstream.toml)"
        if kind := _lexical(ov.dst):
            found.append(Violation(label, None, ov.dst, kind))
        else:  # the folder, then each file (a symlink may sit below the folder)
            seen: set[tuple[str, str]] = set()
            for dst in [ov.dst, *overlay.source_files(root, (ov,))]:
                via = _escape(dst, links, tree, follow_last=True)
                if via and via not in seen:
                    seen.add(via)
                    detail = f"{via[0]} -> {via[1]}"
                    found.append(Violation(label, None, dst, "through-symlink", detail))
        src = root / ov.src
        base = src.resolve()
        if not base.is_relative_to(project):
            found.append(Violation(label, None, ov.src, "source-symlink", f"-> {base}"))
            continue
        for path in sorted(src.rglob("*")) if src.is_dir() else []:
            if path.is_symlink() and not path.resolve().is_relative_to(base):
                rel = path.relative_to(root).as_posix()
                detail = f"-> {os.readlink(path)}"
                found.append(Violation(label, None, rel, "source-symlink", detail))
    return found


def disk_violations(root: Path, patch: Patch, paths: Iterable[str]) -> list[Violation]:
    """Defence in depth, right before writing: the real path of each file (every
    symlink on disk followed) must be inside ``root`` and outside any .git dir."""
    lines: dict[str, int] = {}
    for f in scan(patch):
        for line, path in f.names:
            lines.setdefault(path, line)
    base = root.resolve()
    found = []
    for path in paths:
        real = (root / path).resolve()
        inside = real.is_relative_to(base)
        if not inside or _lexical(real.relative_to(base).as_posix()):
            kind = _lexical(path) or "through-symlink"
            found.append(
                Violation(
                    patch.name, lines.get(path), path, kind, f"resolves to {real}"
                )
            )
    return found


def project_violations(
    project: Project, patches: Iterable[Patch], *, on_disk: bool = True
) -> list[Violation]:
    """Everything above for a project: its series (against the tree on disk when
    ``on_disk`` and the tree exists) and its overlay folders."""
    tree = project.tree if on_disk and project.tree.is_dir() else None
    found, links = series_violations(patches, tree)
    return found + overlay_violations(
        project.root, project.manifest.overlays, tree, links
    )


class PathsOutsideTree(ProblemsFound):
    """Raised by apply and export: paths that leave the tree, each explained."""

    def __init__(
        self, action: str, found: list[Violation], tree: str, hint: str
    ) -> None:
        self.violations = found
        listing = "\n".join(f"  {v.message(tree)}" for v in found)
        super().__init__(
            f"refusing to {action}: {len(found)} path{'s' * (len(found) != 1)} "
            f"leave{'s' * (len(found) == 1)} the tree {tree}:\n"
            f"{listing}\n{hint}"
        )
