"""Confinement: a patch writes regular text files inside the tree, nothing else.

The policy lives here, as functions over a parsed ``Patch`` (and, when there
is one, the tree on disk); ``check``, ``apply``, ``export`` and ``status`` all
ask it and report what it finds. Refused outright, whatever the path:

- a symlink: any mode line of git's symlink mode 120000 (created, changed or
  deleted);
- a binary patch (``GIT binary patch``, ``Binary files ... differ``).

A path, as written, is refused when it is absolute, has a ``..`` component
(``a/../../evil.txt``) or a ``.git`` component (it would write into a git dir:
hooks, config). One check looks at the disk: the real path of a file, every
symlink there followed, must stay inside the tree and out of any .git dir
(and an overlay source file must really lie inside the project). Since no
patch may make a symlink, the symlinks to follow are only those on disk.

The raw patch text is scanned, not unidiff's view of it: every line naming a
path counts (``diff --git``, ``---``/``+++``, ``rename``/``copy from``/``to``,
``Binary files ... differ``), so renames, copies and patches that do not even
parse are covered, and each finding names its line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
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
    "symlink",
    "binary",
    "through-symlink",
    "source-symlink",
]

_SYMLINK_MODE = "120000"
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_BINARY = re.compile(r"^Binary files (.+?) and (.+) differ$")
_NAMED = re.compile(r"^(?:rename|copy) (?:from|to) (.+)$")
_MODE = re.compile(r"^(?:(?:new|deleted) file mode|old mode|new mode|index \S+) (\d+)$")
_FIX_PATHS = "a patch may only touch files inside the tree: fix the diff's a/ b/ paths"

# kind -> (what is wrong, what to do); {tree} is "the tree <its path>"
_REASONS: dict[Kind, tuple[str, str]] = {
    "absolute": ("is absolute, not inside {tree}", _FIX_PATHS),
    "parent": ("leaves {tree} through '..'", _FIX_PATHS),
    "git-dir": (
        "has a .git component: it would write into a git directory",
        "a patch must never touch git metadata (hooks, config): drop that file",
    ),
    "symlink": (
        "is a symlink (git mode 120000): a patch writes regular files only",
        "put the file itself in the patch (or the overlay), not a link to it",
    ),
    "binary": (
        "is a binary patch: a patch changes text files only",
        "keep binary files in an overlay folder",
    ),
    "through-symlink": (
        "passes through a symlink on disk that leads out of {tree}",
        "patch the real file inside the tree instead, or remove the symlink",
    ),
    "source-symlink": (
        "is a symlink leading out of the project",
        "put the file itself in the overlay folder instead of a symlink",
    ),
}


@dataclass(frozen=True)
class Violation:
    """One refused path: where it is written and why it is refused."""

    patch: str  # patch file name; for the overlay, the folder mapping
    line: int | None  # line in the patch file (None for the overlay)
    path: str
    kind: Kind
    detail: str = ""  # e.g. where a symlink on disk leads

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


# -- reading the patch text -------------------------------------------------------


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


def _scan(patch: Patch) -> list[tuple[int, str, Kind | None]]:
    """``(line, path, refusal)`` for every line of the patch file naming a file:
    the refusal is ``symlink`` for a mode line of 120000 and ``binary`` for a
    binary patch (the path is then the file the line belongs to), else None."""
    lines = split_lines(decode(patch.raw))
    start = len(_split_message_and_diff(lines)[0])
    found: list[tuple[int, str, Kind | None]] = []
    current = ""  # the file the header lines being read belong to
    old = new = 0  # lines left in the current hunk

    def name(lineno: int, path: str | None) -> None:
        nonlocal current
        if path:
            found.append((lineno, path, None))
            current = path

    for lineno, text in enumerate(lines[start:], start + 1):
        line = text.rstrip("\r\n")
        if old > 0 or new > 0:  # inside a hunk: content, never a header
            tag = line[:1]
            old -= tag in (" ", "", "-")
            new -= tag in (" ", "", "+")
            if tag in (" ", "", "-", "+", "\\"):
                continue
            old = new = 0  # a malformed hunk ends here: read the line as a header
        following = lines[lineno] if lineno < len(lines) else ""
        if line.startswith("diff --git "):
            for side in _git_names(line[len("diff --git ") :]):
                name(lineno, _side(side))
        # outside a hunk, "+++ " is always a header (as unidiff reads it)
        elif line.startswith("+++ ") or (
            line.startswith("--- ") and following.startswith("+++ ")
        ):
            name(lineno, _side(line[4:]))
        elif m := _NAMED.match(line):
            name(lineno, _unquote(m.group(1)))
        elif m := _BINARY.match(line):
            name(lineno, _side(m.group(1)))
            name(lineno, _side(m.group(2)))
            found.append((lineno, current, "binary"))
        elif line == "GIT binary patch":
            found.append((lineno, current, "binary"))
        elif (m := _MODE.match(line)) and m.group(1) == _SYMLINK_MODE:
            found.append((lineno, current, "symlink"))
        elif m := _HUNK.match(line):
            old, new = int(m.group(1) or 1), int(m.group(2) or 1)
    # and what unidiff (so apply) reads, whatever the scan above made of the text
    seen = {(path, kind) for _, path, kind in found}
    for pf in patch.files:
        for raw in (pf.source_file, pf.target_file):
            path = _side(raw) if raw else None
            for kind in (None, "binary") if pf.is_binary_file else (None,):
                if path and (path, kind) not in seen:
                    lineno = next((i for i, t in enumerate(lines, 1) if raw in t), 0)
                    found.append((lineno, path, kind))
                    seen.add((path, kind))
    return found


# -- the policy -------------------------------------------------------------------


def _lexical(path: str) -> Kind | None:
    """What is wrong with a path as written, before any symlink is followed."""
    if path.startswith("/"):
        return "absolute"
    parts = path.split("/")
    if ".." in parts:
        return "parent"
    if any(p.lower() == ".git" for p in parts):
        return "git-dir"
    return None


def _leaves(base: Path, path: str) -> Path | None:
    """The check on disk: where ``base/path`` really is (every symlink on disk
    followed) when that is outside ``base`` or in a .git dir; None when inside."""
    try:
        real = (base / path).resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return base / path
    top = base.resolve()
    if real.is_relative_to(top) and not _lexical(real.relative_to(top).as_posix()):
        return None
    return real


def violations(patch: Patch, root: Path | None = None) -> list[Violation]:
    """Why ``patch`` may not be applied, in the order the patch names them: symlinks,
    binary patches, paths refused as written, and (``root``: the tree on disk)
    paths a symlink there takes out of it."""
    found: dict[tuple[str, Kind], Violation] = {}
    for line, path, refusal in _scan(patch):
        kind = refusal or _lexical(path)
        if kind is None and root is not None and (real := _leaves(root, path)):
            kind, detail = "through-symlink", f"resolves to {real}"
        else:
            detail = ""
        if kind:
            found.setdefault(
                (path, kind), Violation(patch.name, line, path, kind, detail)
            )
    return list(found.values())


def disk_violations(root: Path, patch: Patch, paths: Iterable[str]) -> list[Violation]:
    """Right before writing: each of ``paths`` (files of ``patch``) whose real
    path, every symlink on disk followed, is outside ``root`` or in a .git dir."""
    lines: dict[str, int] = {}
    for line, path, _ in _scan(patch):
        lines.setdefault(path, line)
    return [
        Violation(
            patch.name, lines.get(path), path, "through-symlink", f"resolves to {real}"
        )
        for path in paths
        if (real := _leaves(root, path))
    ]


def overlay_violations(
    root: Path, overlays: Iterable[Overlay], tree: Path | None = None
) -> list[Violation]:
    """Overlay destinations refused as written or (``tree``: the tree on disk)
    led out of it by a symlink there, and overlay source files that are
    symlinks out of the project ``root`` (what they lead to would be copied in)."""
    found = []
    for ov in overlays:
        label = f"overlay {ov.src}/ -> {ov.dst}/ (patches/upstream.toml)"
        files = overlay.source_files(root, (ov,))
        if kind := _lexical(ov.dst):
            found.append(Violation(label, None, ov.dst, kind))
        elif tree is not None:  # the folder, then each file: the first that leaves
            for dst in [ov.dst, *files]:
                if real := _leaves(tree, dst):
                    detail = f"resolves to {real}"
                    found.append(Violation(label, None, dst, "through-symlink", detail))
                    break
        for src in files.values():
            rel = src.relative_to(root).as_posix()
            if real := _leaves(root, rel):
                found.append(
                    Violation(label, None, rel, "source-symlink", f"-> {real}")
                )
    return found


def project_violations(
    project: Project, patches: Iterable[Patch], *, on_disk: bool = True
) -> list[Violation]:
    """Everything above for a project: its series (against the tree on disk when
    ``on_disk`` and the tree exists) and its overlay folders."""
    tree = project.tree if on_disk and project.tree.is_dir() else None
    found = [v for patch in patches for v in violations(patch, tree)]
    return found + overlay_violations(project.root, project.manifest.overlays, tree)


class PathsOutsideTree(ProblemsFound):
    """Raised by apply and export: refused paths, each explained."""

    def __init__(
        self, action: str, found: list[Violation], tree: str, hint: str
    ) -> None:
        self.violations = found
        listing = "\n".join(f"  {v.message(tree)}" for v in found)
        super().__init__(
            f"refusing to {action}: {len(found)} path{'s' * (len(found) != 1)} "
            f"may not be written to the tree {tree}:\n{listing}\n{hint}"
        )
