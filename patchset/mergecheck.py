"""What a clean 3-way merge can still break in a Python file, read by ruff.

``git rebase`` replays a patch onto a newer upstream line by line: when the
patch's hunks and upstream's changes do not touch the same lines, the merge is
"clean" even when the result is wrong. Two cases are common when rolling a
series over vLLM, and both are silent until the code runs; ruff's pyflakes
rules see both:

- **F811, a name defined twice**: the patch adds a method (``has_requests``)
  that upstream now also has, elsewhere in the same class; the later
  definition silently replaces the earlier one.
- **F821, an undefined name**: a line the patch adds uses a module-level name
  that upstream removed or renamed.

Only what the step introduced counts: a finding its parent (upstream's file
with the earlier steps) has too is left alone, compared by rule and message
without line numbers. A file that no longer parses after the step (where its
parent did) is reported from ``compile()``. Not seen: an attribute upstream
renamed (``self.block_len``) that the patch still reads; the type check of the
overlay and the tests on the rolled tree are what catch those.

Texts in, findings out: ruff runs on standard input (the interpreter's own
``ruff`` package, pinned in requirements/tools.txt); no git.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

from .errors import PatchsetError

RULES = "F811,F821"
SYNTAX = "syntax"
RUFF_TIMEOUT_S = 60.0
WHAT_TO_DO = {
    "F811": "the later definition silently replaces the earlier one: keep one (drop "
    "the patch's if upstream's now does the job, or merge the two)",
    "F821": "upstream removed, renamed or moved it: use what replaced it",
}


@dataclass(frozen=True)
class Finding:
    """One problem in one file after a step: where, and what to do."""

    kind: str  # a ruff rule (F811, F821) or "syntax"
    path: str
    line: int
    message: str

    def describe(self) -> str:
        hint = WHAT_TO_DO.get(self.kind)
        return f"{self.path}:{self.line}: {self.kind} {self.message}" + (
            f"; {hint}" if hint else ""
        )


def check_step(path: str, new: str, *, new_base: str | None) -> list[Finding]:
    """Findings for one .py file a rebase step touched: ``new`` is the file
    after the step, ``new_base`` before it (None: the step created it)."""
    try:
        compile(new, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        if new_base is not None and not _compiles(new_base, path):
            return []  # upstream's own file does not parse (another Python)
        why = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        line = getattr(exc, "lineno", None) or 1
        return [
            Finding(
                SYNTAX,
                path,
                line,
                f"the file no longer parses after this step ({why}); "
                "fix it (conflict markers left in?)",
            )
        ]
    before = Counter(_key(f) for f in _ruff(path, new_base)) if new_base else Counter()
    findings = []
    for f in _ruff(path, new):
        if before[_key(f)]:
            before[_key(f)] -= 1
        else:
            findings.append(f)
    return findings


def _key(f: Finding) -> tuple[str, str]:
    return f.kind, re.sub(r"\d+", "N", f.message)


def _compiles(text: str, path: str) -> bool:
    try:
        compile(text, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


def _ruff(path: str, text: str) -> list[Finding]:
    cmd = [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache"]
    cmd += ["--select", RULES, "--output-format", "json", "--exit-zero"]
    cmd += ["--stdin-filename", path, "-"]
    try:
        done = subprocess.run(
            cmd, input=text, capture_output=True, text=True, timeout=RUFF_TIMEOUT_S
        )
        why = "" if done.returncode == 0 else done.stderr.strip() or "no output"
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why:
        raise PatchsetError(
            f"ruff could not check {path} ({why}), so the step is not passed; "
            "install it (pip install -r requirements/tools.txt) and run "
            "`rebase --continue` again"
        )
    return [
        Finding(d["code"], path, d["location"]["row"], d["message"])
        for d in json.loads(done.stdout)
    ]
