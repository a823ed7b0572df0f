#!/usr/bin/env python3
"""Fail when a tracked file names how the work was organised instead of what it does.

    python3 .ci/check_words.py      (from anywhere; scans the repository holding this file)

Lists the tracked files (``git ls-files``), skips binary ones (a NUL byte in the first
8 KiB) and matches every line against the rules below. Prints ``path:line: matched text
(rule)`` per hit and exits 1, or prints ``no process words in N tracked files`` and exits
0; exits 2 if git cannot list the files. Standard library only.

The rules (all case-insensitive). Each names what it catches and a line of this
project's own vocabulary it must let through:

  numbered-session  "session" (or "sessions") followed by a number: a numbered period
                    of work. Not when the number is a host:port or dotted address, which
                    is a Mooncake transfer-engine session id: "session 127.0.0.1:1";
                    a user's "turn 2 of a session" has no number after the word.
  sessions-of-work  "session(s) of work". Not "a multi-turn session".
  helper            "helper session(s)" / "helper agent(s)": who did a piece of work.
                    Not "helpers.py" or "a helper function".
  bare-issue        "issue" (or "issues") followed by a number, "#" optional: a bare
                    tracker number. Not when a repository or project names the tracker
                    right before it: "vLLM issue #43226", "upstream issue 5", "Mooncake
                    issue #12", "vllm-project/vllm issue #1"; "vllm#50984" has no
                    "issue" at all. The verb followed by a count ("may issue 2 writes")
                    trips it too: spell the count ("issue two writes").
  fixed-in          "fixed in" / "done in" followed by "session" or "issue".
                    Not "fixed in vLLM 0.19".
  sprint            the word "sprint(s)". Not "sprintf" (whole words only).
  ticket            "ticket" followed by a number, "#" optional. Not "a ticket lock".

This file and its test (tests/unit/test_process_words.py) describe and quote the words
they look for, so both are exempt (EXEMPT below); nothing else is.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Repository-relative paths never scanned: the checker and its test quote what they catch.
EXEMPT = frozenset({".ci/check_words.py", "tests/unit/test_process_words.py"})

# A tracker named right before "issue N" makes it an upstream reference, not ours.
_NAMED_TRACKER = re.compile(
    r"(?:\bvllm|\bupstream|\bmooncake|\b[\w.-]+/[\w.-]+)(?:'s)?\s+$", re.IGNORECASE
)


def _issue_is_ours(line: str, match: re.Match[str]) -> bool:
    return not _NAMED_TRACKER.search(line[: match.start()])


# (rule, pattern, keep): a match counts when keep is None or keep(line, match) is true.
RULES: list[
    tuple[str, re.Pattern[str], Callable[[str, re.Match[str]], bool] | None]
] = [
    # digits not continuing as ".digit" or ":digit" (an address such as 127.0.0.1:1)
    (
        "numbered-session",
        re.compile(r"\bsessions?[\s#-]*\d+\b(?!\.\d|:\d)", re.I),
        None,
    ),
    ("sessions-of-work", re.compile(r"\bsessions? of work\b", re.I), None),
    ("helper", re.compile(r"\bhelper (?:session|agent)s?\b", re.I), None),
    ("bare-issue", re.compile(r"\bissues?\s*#?\d+\b", re.I), _issue_is_ours),
    ("fixed-in", re.compile(r"\b(?:fixed|done) in (?:session|issue)\b", re.I), None),
    ("sprint", re.compile(r"\bsprints?\b", re.I), None),
    ("ticket", re.compile(r"\btickets?\s*#?\d+", re.I), None),
]


def scan_line(text: str) -> list[str]:
    """Every hit in one line, as ``"matched text (rule)"``; empty when the line is clean."""
    hits = []
    for rule, pattern, keep in RULES:
        for m in pattern.finditer(text):
            if keep is None or keep(text, m):
                hits.append(f"{m.group(0)} ({rule})")
    return hits


def scan_text(text: str) -> list[tuple[int, str]]:
    """``(line number, hit)`` for every hit in a file's text."""
    return [
        (n, hit)
        for n, line in enumerate(text.splitlines(), 1)
        for hit in scan_line(line)
    ]


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True
    ).stdout
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def _text_of(path: Path) -> str | None:
    """The file's text, or None for a binary or missing file."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None  # deleted in the work tree, or a submodule
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", "replace")


def main(root: Path = ROOT) -> int:
    try:
        files = tracked_files(root)
    except (OSError, subprocess.CalledProcessError) as e:
        print(
            f"check_words: cannot list the tracked files of {root} ({e}); "
            "run it inside the git repository",
            file=sys.stderr,
        )
        return 2
    scanned = 0
    hits = []
    for rel in files:
        if rel in EXEMPT:
            continue
        text = _text_of(root / rel)
        if text is None:
            continue
        scanned += 1
        hits += [f"{rel}:{n}: {hit}" for n, hit in scan_text(text)]
    for line in hits:
        print(line)
    if hits:
        print(
            f"check_words: {len(hits)} process word(s) in {scanned} tracked files; say what "
            "the code does or what was seen instead (rules: .ci/check_words.py)",
            file=sys.stderr,
        )
        return 1
    print(f"no process words in {scanned} tracked files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
