"""Which tree commit is which patch: the ``Patch-Filename:`` trailer.

As Electron's ``script/lib/git.py`` does, ``apply`` ends every patch commit's
message with ``Patch-Filename: <name>`` and ``export`` takes the patch file
name from it (and strips it, so the patch file never holds it). The name
travels with the commit through ``git commit --amend``, ``--fixup`` +
``rebase --autosquash``, reordering and rewording, which all change commit
ids: a rewritten commit is still "patch N, changed in the tree", never an
unknown commit, and export writes it back to the same file.

The overlay commit carries ``Vmp-Overlay: true`` so a rebase that rewrites it
cannot turn it into a patch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PATCH_TRAILER = "Patch-Filename"
OVERLAY_TRAILER = "Vmp-Overlay"

_PATCH_LINE = re.compile(rf"^{PATCH_TRAILER}: *(\S+) *$", re.MULTILINE)
_OVERLAY_LINE = re.compile(rf"^{OVERLAY_TRAILER}: *true *$", re.MULTILINE)
_TRAILER_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9-]*: ")


def _with_trailer(message: str, trailer: str) -> str:
    """message + trailer, joined to its last paragraph when that is a trailer block."""
    text = message.rstrip("\n")
    last = text.rsplit("\n\n", 1)[-1] if "\n\n" in text else ""
    joins = bool(last) and all(_TRAILER_LIKE.match(line) for line in last.splitlines())
    return f"{text}{chr(10) if joins else chr(10) * 2}{trailer}\n"


def tag_patch_message(message: str, name: str) -> str:
    """The commit message of patch ``name``: its header's message plus the trailer."""
    return _with_trailer(message, f"{PATCH_TRAILER}: {name}")


def tag_overlay_message(message: str) -> str:
    return _with_trailer(message, f"{OVERLAY_TRAILER}: true")


def patch_name_of(message: str) -> str | None:
    """The patch a commit message names (the last trailer wins), or None."""
    found = _PATCH_LINE.findall(message)
    return found[-1] if found else None


def is_overlay(message: str) -> bool:
    return bool(_OVERLAY_LINE.search(message))


def untag(message: str) -> str:
    """A message without its ``Patch-Filename:`` line(s)."""
    text = _PATCH_LINE.sub("\0", message).replace("\0\n", "").replace("\0", "")
    return text.rstrip("\n") + "\n"


def strip_trailer(format_patch_output: bytes) -> bytes:
    """Drop the ``Patch-Filename:`` line(s) from a patch's message (never from its diff)."""
    text = format_patch_output.decode("utf-8", "surrogateescape")
    head, sep, diff = text.partition("\ndiff --git ")
    head = _PATCH_LINE.sub("\0", head).replace("\0\n", "").replace("\0", "")
    return (head + sep + diff).encode("utf-8", "surrogateescape")


@dataclass
class ChainIdentity:
    """What each commit of pristine..HEAD is, from its id and its trailers."""

    patch_of: dict[str, str] = field(default_factory=dict)  # commit -> patch name
    overlay: str | None = None  # the overlay commit, if any
    amended: dict[str, str] = field(default_factory=dict)  # patch name -> new commit


def identify(
    chain: list[str],
    messages: dict[str, str],
    recorded: dict[str, str],
    recorded_overlay: str | None,
) -> ChainIdentity:
    """Name the commits of ``chain`` (oldest first).

    ``recorded`` maps patch name -> the commit ``apply``/``export`` made for it.
    A commit is that patch when its id is the recorded one, or when its
    trailer names the patch (then it was rewritten in the tree: ``amended``).
    A second commit naming a patch already taken is a new commit.
    """
    out = ChainIdentity()
    by_commit = {c: n for n, c in recorded.items()}
    taken: set[str] = set()
    for commit in chain:
        message = messages.get(commit, "")
        if commit == recorded_overlay or is_overlay(message):
            out.overlay = commit
            continue
        name = by_commit.get(commit) or patch_name_of(message)
        if name is None:
            continue
        if name in taken:
            continue
        taken.add(name)
        out.patch_of[commit] = name
        if name in recorded and recorded[name] != commit:
            out.amended[name] = commit
    return out
