"""mergecheck: what a clean 3-way merge can still break in one Python file.

Each case gives the four versions of a file a rebase step knows (the old base
and the original patched file on the pin; the new base and the merged file on
the target) and the lines the step adds.
"""

from __future__ import annotations

from patchset import mergecheck

OLD_BASE = """import os

LIMIT = 4


class Worker:
    def __init__(self):
        self.block_len = 16
        self.n = 0

    def start(self):
        return self.n
"""


def added_lines(new: str, *snippets: str) -> set[int]:
    """The line numbers of ``new`` holding any of snippets (the step's + lines)."""
    return {
        i
        for i, line in enumerate(new.splitlines(), 1)
        if any(s in line for s in snippets)
    }


def check(
    new: str,
    *,
    added: set[int],
    new_base: str | None = None,
    old: str | None = None,
    old_base: str | None = OLD_BASE,
):
    return mergecheck.check_step(
        "vllm/w.py",
        new,
        new_base=new_base,
        old=old,
        old_base=old_base,
        added=added,
        old_label="vllm 0.18.1",
    )


def test_a_duplicate_the_step_adds_names_both_lines() -> None:
    upstream = OLD_BASE + "\n    def has_requests(self):\n        return self.n > 0\n"
    merged = upstream + "\n    def has_requests(self):\n        return True\n"
    (finding,) = check(
        merged, added=added_lines(merged, "return True") | {17}, new_base=upstream
    )
    assert finding.kind == mergecheck.DUPLICATE and finding.line == 17
    assert "class Worker defines has_requests twice (lines 14 and 17" in finding.message
    assert "the patch adds line 17" in finding.message


def test_setters_overloads_and_upstreams_own_duplicates_are_not_reported() -> None:
    upstream = OLD_BASE + (
        "\n    @property\n    def size(self):\n        return self.n\n"
        "\n    @size.setter\n    def size(self, n):\n        self.n = n\n"
        "\n    mode = 1\n    mode = 2\n"  # upstream's own repeat: not the step's doing
    )
    merged = upstream + (
        "\n    @overload\n    def get(self, k: int) -> int: ...\n"
        "\n    @typing.overload\n    def get(self, k: str) -> str: ...\n"
        "\n    def get(self, k):\n        return k\n"
    )
    added = set(range(len(upstream.splitlines()) + 1, len(merged.splitlines()) + 1))
    assert check(merged, added=added, new_base=upstream) == []


def test_a_nested_class_is_checked_under_its_own_name() -> None:
    merged = (
        OLD_BASE
        + "\n    class Inner:\n        def f(self): ...\n        def f(self): ...\n"
    )
    (finding,) = check(merged, added=added_lines(merged, "def f"), new_base=OLD_BASE)
    assert "class Worker.Inner defines f twice" in finding.message


def test_an_attribute_upstream_removed_is_reported() -> None:
    upstream = OLD_BASE.replace("self.block_len = 16", "self.block_size = 16")
    merged = upstream.replace("return self.n", "return self.n + self.block_len")
    (finding,) = check(
        merged, added=added_lines(merged, "self.block_len"), new_base=upstream
    )
    assert finding.kind == mergecheck.REMOVED_ATTRIBUTE
    assert "uses self.block_len, which the file no longer defines" in finding.message
    assert "line 8 defined it on vllm 0.18.1" in finding.message


def test_names_the_old_file_never_defined_are_never_guessed_at() -> None:
    """self.config may be inherited; a name from another module is not ours to judge."""
    merged = OLD_BASE.replace("return self.n", "return self.config.x + undefined_here")
    assert check(merged, added=added_lines(merged, "self.config")) == []


def test_an_attribute_the_step_defines_itself_is_not_reported() -> None:
    upstream = OLD_BASE.replace("        self.block_len = 16\n", "")
    merged = upstream.replace(
        "        self.n = 0\n", "        self.n = 0\n        self.block_len = 8\n"
    ).replace("return self.n", "return self.block_len")
    added = added_lines(merged, "block_len")
    assert check(merged, added=added, new_base=upstream) == []


def test_only_the_steps_added_lines_count() -> None:
    """Upstream's own use of a name it removed is upstream's business."""
    merged = OLD_BASE.replace("self.block_len = 16", "self.block_size = 16").replace(
        "return self.n", "return self.block_len"
    )
    assert check(merged, added=set()) == []


def test_a_module_level_name_upstream_removed_is_reported_unless_bound() -> None:
    upstream = OLD_BASE.replace("LIMIT = 4\n", "")
    merged = upstream.replace("return self.n", "return min(self.n, LIMIT)")
    (finding,) = check(merged, added=added_lines(merged, "LIMIT"), new_base=upstream)
    assert finding.kind == mergecheck.REMOVED_NAME
    assert "uses LIMIT, which the file no longer defines or imports" in finding.message
    # bound anywhere in the file (here a parameter): not reported
    local = merged.replace("def start(self):", "def start(self, LIMIT=2):")
    assert check(local, added=added_lines(local, "LIMIT")) == []
    # a removed import is reported too; builtins and star imports never are
    no_os = merged.replace("import os\n", "").replace("LIMIT)", "len(os.sep))")
    (finding,) = check(no_os, added=added_lines(no_os, "os.sep"))
    assert "uses os," in finding.message
    star = "from os.path import *\n" + no_os
    assert check(star, added=added_lines(star, "os.sep")) == []


def test_a_class_with_dynamic_attributes_is_not_judged() -> None:
    merged = (
        OLD_BASE.replace("self.block_len = 16", "self.block_size = 16").replace(
            "return self.n", "return self.block_len"
        )
        + "\n    def __getattr__(self, name):\n        return 0\n"
    )
    assert check(merged, added=added_lines(merged, "self.block_len")) == []


def test_a_file_that_no_longer_parses_is_reported() -> None:
    merged = OLD_BASE.replace("return self.n", "<<<<<<< HEAD\n        return self.n")
    (finding,) = check(merged, added=added_lines(merged, "<<<<<<<"), new_base=OLD_BASE)
    assert finding.kind == mergecheck.SYNTAX and finding.line == 12
    assert "no longer parses" in finding.message
    # upstream's own file already did not parse: not the step's doing
    assert check("def (:\n", added={1}, new_base="def (:\n") == []
