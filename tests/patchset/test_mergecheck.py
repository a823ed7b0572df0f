"""mergecheck: what a clean 3-way merge can still break in one Python file.

Each case gives the file before a rebase step (upstream's, with the earlier
steps) and after it; ruff runs on both for real.
"""

from __future__ import annotations

import pytest

from patchset import mergecheck
from patchset.errors import PatchsetError

BASE = """import os

LIMIT = 4


class Worker:
    def __init__(self):
        self.block_len = 16
        self.n = 0

    def start(self):
        return self.n
"""


def check(new: str, new_base: str | None = BASE) -> list[mergecheck.Finding]:
    return mergecheck.check_step("vllm/w.py", new, new_base=new_base)


def test_a_method_the_step_defines_twice_is_reported_with_what_to_do() -> None:
    upstream = BASE + "\n    def has_requests(self):\n        return self.n > 0\n"
    merged = upstream + "\n    def has_requests(self):\n        return True\n"
    (finding,) = check(merged, new_base=upstream)
    assert finding.kind == "F811" and finding.line == 17
    assert "has_requests" in finding.message and "line 14" in finding.message
    assert "silently replaces" in finding.describe()


def test_setters_overloads_and_upstreams_own_duplicates_are_not_reported() -> None:
    upstream = BASE + (
        "\n    @property\n    def size(self):\n        return self.n\n"
        "\n    @size.setter\n    def size(self, n):\n        self.n = n\n"
        "\n    def mode(self): ...\n    def mode(self): ...\n"  # upstream's own
    )
    merged = (
        "from typing import overload\n"
        + upstream
        + (
            "\n    @overload\n    def get(self, k: int) -> int: ...\n"
            "\n    @overload\n    def get(self, k: str) -> str: ...\n"
            "\n    def get(self, k):\n        return k\n"
        )
    )
    assert check(merged, new_base=upstream) == []


def test_a_module_level_name_upstream_removed_is_reported_unless_bound() -> None:
    upstream = BASE.replace("LIMIT = 4\n", "")
    merged = upstream.replace("return self.n", "return min(self.n, LIMIT)")
    (finding,) = check(merged, new_base=upstream)
    assert finding.kind == "F821" and "LIMIT" in finding.message
    assert "use what replaced it" in finding.describe()
    # bound in scope (here a parameter): not reported
    local = merged.replace("def start(self):", "def start(self, LIMIT=2):")
    assert check(local, new_base=upstream) == []
    # a removed import is reported too; builtins never are
    no_os = merged.replace("import os\n", "").replace("LIMIT)", "len(os.sep))")
    (finding,) = check(no_os, new_base=upstream)
    assert finding.kind == "F821" and "`os`" in finding.message


def test_only_what_the_parent_did_not_have_counts() -> None:
    """Upstream's own undefined name is upstream's business, even moved."""
    upstream = BASE.replace("return self.n", "return self.n + MISSING")
    merged = "# moved down a line\n" + upstream
    assert check(merged, new_base=upstream) == []
    twice = merged.replace("return self.n + MISSING", "return MISSING + MISSING")
    assert [f.kind for f in check(twice, new_base=upstream)] == ["F821"]


def test_a_file_that_no_longer_parses_is_reported() -> None:
    merged = BASE.replace("return self.n", "<<<<<<< HEAD\n        return self.n")
    (finding,) = check(merged)
    assert finding.kind == mergecheck.SYNTAX and finding.line == 12
    assert "no longer parses" in finding.message
    # upstream's own file already did not parse: not the step's doing
    assert check("def (:\n", new_base="def (:\n") == []


def test_without_ruff_the_step_is_not_passed(monkeypatch) -> None:
    """A check that cannot run says so and what to install; it never passes."""
    monkeypatch.setattr(mergecheck.sys, "executable", "/nonexistent/python")
    with pytest.raises(PatchsetError, match="ruff could not check vllm/w.py"):
        check(BASE + "\n")
