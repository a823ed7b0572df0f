"""Quilt series files and mail-style patch files.

A series file lists one patch per line, in order; ``#`` starts a comment,
blank lines are ignored and the only option accepted is ``-p1`` (the default
here). A patch file is a mail-style header followed by a ``-p1`` unified diff:

    From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
    From: A U Thor <author@example.com>
    Subject: [PATCH] one line saying what

    Why the patch exists and how it will go away.

    Upstream-Status: Pending
    ---
    diff --git a/vllm/x.py b/vllm/x.py
    ...

The mbox ``From `` line, ``From:`` and ``Date:`` are optional; ``git am``,
``quilt push`` and ``patch -p1`` all read this format. ``canonical_patch``
turns ``git format-patch`` output into exactly this form (no Date, a ``---``
line between message and diff) so exported files are byte-stable.
"""

from __future__ import annotations

import email
import email.policy
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import unidiff
from unidiff.errors import UnidiffParseError

DEFAULT_AUTHOR = ("vllm-mooncake", "vllm-mooncake@localhost")

_MBOX_FROM = re.compile(r"^From [0-9a-f]{40} ")
_HEADER_LINE = re.compile(r"^[A-Za-z][A-Za-z0-9-]*:")
_SUBJECT_TAG = re.compile(r"^\s*(\[[^\]]*\]\s*)+")


# -- series -----------------------------------------------------------------


@dataclass(frozen=True)
class SeriesEntry:
    name: str
    line: int


@dataclass
class Series:
    entries: list[SeriesEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    header: list[str] = field(default_factory=list)  # leading comment block

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]


def parse_series(text: str) -> Series:
    """Parse a quilt series file; option tokens other than ``-p1`` are problems."""
    series = Series()
    in_header = True
    for lineno, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if in_header and (not stripped or stripped.startswith("#")):
            series.header.append(raw)
            continue
        in_header = False
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        for opt in options:
            if opt != "-p1":
                series.problems.append(
                    f"series line {lineno}: option {opt!r} for {name} is not "
                    "supported (patches are -p1 unified diffs, applied forward)"
                )
        series.entries.append(SeriesEntry(name, lineno))
    # A header that is only blank lines is not worth keeping.
    if not any(h.strip() for h in series.header):
        series.header = []
    return series


def read_series(path: Path) -> Series:
    if not path.exists():
        return Series()
    return parse_series(path.read_text(encoding="utf-8"))


def render_series(names: list[str], header: list[str]) -> str:
    """Series text: the kept leading comment block, then one name per line."""
    lines = [*header, *names]
    return "\n".join(lines) + "\n" if lines else ""


# -- patch files ------------------------------------------------------------


@dataclass
class PatchHeader:
    subject: str | None
    author: tuple[str, str] | None
    body: str  # message body without the subject, trailing blank lines stripped
    has_mail_headers: bool

    def commit_message(self) -> str:
        """The commit message that ``git format-patch -k`` turns back into this header."""
        subject = self.subject or ""
        if self.body:
            return f"{subject}\n\n{self.body}\n"
        return f"{subject}\n"


@dataclass
class Patch:
    name: str
    raw: bytes
    header: PatchHeader
    files: list[unidiff.PatchedFile]
    parse_error: str | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def title(self) -> str:
        return clean_subject(self.header.subject or "") or self.name


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def clean_subject(subject: str) -> str:
    """Subject without leading ``[PATCH ...]`` tags."""
    return _SUBJECT_TAG.sub("", subject).strip()


def decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def split_lines(text: str) -> list[str]:
    """Split on ``\\n`` only, keeping line ends (unlike str.splitlines)."""
    if not text:
        return []
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _split_message_and_diff(lines: list[str]) -> tuple[list[str], list[str]]:
    """Message lines (header and body) and the diff lines, as ``git am`` splits."""
    for i, line in enumerate(lines):
        if line.rstrip("\r\n") == "---":
            return lines[:i], lines[i + 1 :]
        if line.startswith("diff --git "):
            return lines[:i], lines[i:]
        if (
            line.startswith("--- ")
            and i + 1 < len(lines)
            and lines[i + 1].startswith("+++ ")
        ):
            return lines[:i], lines[i:]
    return lines, []


def parse_header(message_lines: list[str]) -> PatchHeader:
    lines = list(message_lines)
    if lines and _MBOX_FROM.match(lines[0]):
        lines = lines[1:]
    header_lines: list[str] = []
    has_mail_headers = bool(lines) and bool(_HEADER_LINE.match(lines[0]))
    if has_mail_headers:
        while lines and lines[0].strip():
            header_lines.append(lines.pop(0))
    body_lines = [line.rstrip("\r\n") for line in lines]
    while body_lines and not body_lines[0].strip():
        body_lines.pop(0)
    while body_lines and not body_lines[-1].strip():
        body_lines.pop()
    subject = None
    author = None
    if header_lines:
        msg = email.message_from_string(
            "".join(header_lines), policy=email.policy.default
        )
        if msg["Subject"] is not None:
            subject = str(msg["Subject"]).strip() or None
        from_header = msg["From"]
        if from_header is not None and from_header.addresses:
            addr = from_header.addresses[0]
            author = (addr.display_name or addr.username, addr.addr_spec)
    return PatchHeader(subject, author, "\n".join(body_lines), has_mail_headers)


def parse_patch(name: str, raw: bytes) -> Patch:
    """Parse a patch file; a diff that unidiff rejects sets ``parse_error``."""
    text = decode(raw)
    lines = split_lines(text)
    message, diff = _split_message_and_diff(lines)
    header = parse_header(message)
    files: list[unidiff.PatchedFile] = []
    error = None
    if not diff:
        error = "no unified diff found (expected a '---' line or 'diff --git' after the header)"
    else:
        try:
            files = list(unidiff.PatchSet("".join(diff)))
        except UnidiffParseError as exc:
            error = f"the diff does not parse: {exc}"
        else:
            if not files:
                error = "the diff names no file"
    return Patch(name, raw, header, files, error)


def read_patch(path: Path, name: str) -> Patch:
    return parse_patch(name, path.read_bytes())


# -- export -----------------------------------------------------------------


def canonical_patch(format_patch_output: bytes) -> bytes:
    """Normalise ``git format-patch`` output: drop Date, put ``---`` before the diff.

    The result has no timestamps and no tool version, so exporting the same
    commits always gives the same bytes.
    """
    lines = split_lines(decode(format_patch_output))
    end = len(lines)
    for i, line in enumerate(lines):
        if line.startswith("diff --git "):
            end = i
            break
    message, diff = lines[:end], lines[end:]
    head: list[str] = []
    i = 0
    in_date = False
    while i < len(message) and message[i].strip():
        line = message[i]
        if line.startswith("Date:"):
            in_date = True
        elif not line[:1].isspace():
            in_date = False
        if not in_date:
            head.append(line)
        i += 1
    body = message[i:]
    while body and not body[0].strip():
        body.pop(0)
    while body and (not body[-1].strip() or body[-1].rstrip("\r\n") == "---"):
        body.pop()
    out = [*head, "\n", *body, "---\n", *diff]
    return "".join(out).encode("utf-8", "surrogateescape")


def slug(subject: str, limit: int = 52) -> str:
    """Lower-case file-name slug of a subject, like ``git format-patch``'s (tags dropped)."""
    text = clean_subject(subject).lower()
    text = re.sub(r"[^a-z0-9._]+", "-", text)
    text = re.sub(r"\.{2,}", ".", text).strip("-.")
    text = text[:limit].rstrip("-.")
    return text or "patch"


def patch_file_name(index: int, subject: str) -> str:
    return f"{index:04d}-{slug(subject)}.patch"
