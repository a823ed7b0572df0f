"""Header policy for our patches (Yocto-style Upstream-Status, a "why" body).

Every patch must have:
- a ``Subject:`` saying what it does (``[PATCH]`` tags aside, not empty);
- a body saying why it exists (and ideally how it will go away);
- exactly one ``Upstream-Status:`` line of one of the forms matched by
  ``UPSTREAM_STATUS``.
"""

from __future__ import annotations

import re

from .series import Patch, clean_subject

UPSTREAM_STATUS = re.compile(
    r"^Upstream-Status: (Pending|Submitted \[.+\]|Backport \[.+\]|Inappropriate \[.+\])$"
)
UPSTREAM_STATUS_FORMS = (
    "Pending | Submitted [where] | Backport [from] | Inappropriate [why]"
)
_STATUS_PARTS = re.compile(r"^Upstream-Status: (\w+)(?: \[(.+)\])?$")
# What a Backport claim must name so it can be checked: a pull request of a
# named repository (owner/repo#N, a GitHub pull URL) or a commit (a hex id of
# 7 to 40 digits, alone, as owner/repo@id or as a GitHub commit URL).
_CHANGE_REFERENCE = re.compile(
    r"(?:^|[\s(\[])[\w.-]+/[\w.-]+#\d+\b"
    r"|github\.com/[\w.-]+/[\w.-]+/(?:pull/\d+|commit/[0-9a-f]{7,40})"
    r"|(?:^|[\s@(\[])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
)


def upstream_status(patch: Patch) -> tuple[str, str] | None:
    """(kind, the text in brackets) of the patch's one valid Upstream-Status line."""
    lines = [
        ln for ln in patch.header.body.splitlines() if ln.startswith("Upstream-Status:")
    ]
    if len(lines) != 1 or not UPSTREAM_STATUS.match(lines[0]):
        return None
    m = _STATUS_PARTS.match(lines[0])
    return (m.group(1), m.group(2) or "") if m else None


def backport_reference_problem(patch: Patch) -> str | None:
    """What is wrong with a ``Backport [...]`` claim that names no upstream change.

    Only the form is checked (nothing is looked up): a PR of a named
    repository or a commit, so a reader, or a later check, can find it.
    """
    status = upstream_status(patch)
    if status is None or status[0] != "Backport" or _CHANGE_REFERENCE.search(status[1]):
        return None
    return (
        f"'Upstream-Status: Backport [{status[1]}]' names no upstream change to "
        "check it against: name the PR (vllm-project/vllm#NNNN, or its GitHub URL) "
        "or the commit (vllm-project/vllm@<sha>)"
    )


def header_problems(patch: Patch) -> list[str]:
    """What is wrong with a patch's header; empty when it follows the policy."""
    problems = []
    header = patch.header
    if not header.has_mail_headers:
        problems.append(
            "no mail-style header: start the patch with 'From: Name <email>' and "
            "'Subject: [PATCH] ...' lines (git format-patch style)"
        )
    if header.author is not None and "@" not in header.author[1]:
        problems.append(
            "the From: line names no email address: use 'From: Name <email>', the "
            "series' one identity"
        )
    if not clean_subject(header.subject or ""):
        problems.append("missing Subject: add 'Subject: [PATCH] <what it does>'")
    lines = header.body.splitlines()
    status_lines = [ln for ln in lines if ln.startswith("Upstream-Status:")]
    why = [ln for ln in lines if ln.strip() and not ln.startswith("Upstream-Status:")]
    if not why:
        problems.append(
            "the body does not say why the patch exists: add a paragraph after "
            "the Subject explaining why (and how it will go away)"
        )
    if not status_lines:
        problems.append(
            f"missing 'Upstream-Status:' line (one of: {UPSTREAM_STATUS_FORMS})"
        )
    elif len(status_lines) > 1:
        problems.append(
            f"{len(status_lines)} 'Upstream-Status:' lines; keep exactly one"
        )
    for line in status_lines:
        if not UPSTREAM_STATUS.match(line):
            problems.append(
                f"invalid {line!r}: use one of Upstream-Status: {UPSTREAM_STATUS_FORMS}"
            )
    return problems
