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


def header_problems(patch: Patch) -> list[str]:
    """What is wrong with a patch's header; empty when it follows the policy."""
    problems = []
    header = patch.header
    if not header.has_mail_headers:
        problems.append(
            "no mail-style header: start the patch with 'From: Name <email>' and "
            "'Subject: [PATCH] ...' lines (git format-patch style)"
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
