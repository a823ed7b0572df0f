"""Unit tests of the pure parts: series, headers, exact apply, canonical export."""

from __future__ import annotations

import pytest
from conftest import patch_text, udiff

from patchset.exactapply import PatchDoesNotApply, apply_patch
from patchset.headers import UPSTREAM_STATUS, header_problems
from patchset.series import canonical_patch, parse_patch, parse_series, patch_file_name


def _apply(diff: str, files: dict[str, str]) -> dict[str, str | None]:
    patch = parse_patch("t.patch", patch_text("t", diff).encode())
    return {p: r.content for p, r in apply_patch(patch, files.get).items()}


def test_series_comments_blank_lines_and_p1() -> None:
    series = parse_series(
        "# header\n\n0001-a.patch\n  # note\n0002-b.patch -p1\n\n0003-c.patch # why\n"
    )
    assert series.names == ["0001-a.patch", "0002-b.patch", "0003-c.patch"]
    assert series.problems == []
    assert series.header == ["# header", ""]


def test_series_unsupported_options_are_problems() -> None:
    series = parse_series("0001-a.patch -p0\n0002-b.patch -R\n")
    assert len(series.problems) == 2
    assert "-p0" in series.problems[0] and "-R" in series.problems[1]


@pytest.mark.parametrize(
    "line, ok",
    [
        ("Upstream-Status: Pending", True),
        (
            "Upstream-Status: Submitted [https://github.com/vllm-project/vllm/pull/1]",
            True,
        ),
        ("Upstream-Status: Backport [vllm 0.19 commit abc]", True),
        ("Upstream-Status: Inappropriate [mooncake-only wiring]", True),
        ("Upstream-Status: Submitted", False),
        ("Upstream-Status: Inappropriate []", False),
        ("Upstream-Status: pending", False),
        ("Upstream-Status: Accepted", False),
    ],
)
def test_upstream_status_regex(line: str, ok: bool) -> None:
    assert bool(UPSTREAM_STATUS.match(line)) is ok


def test_header_parsing_and_policy() -> None:
    diff = udiff("f", "a\n", "b\n")
    patch = parse_patch(
        "p", patch_text("Do it", diff, author="Jöhn Doe <j@example.com>").encode()
    )
    assert patch.header.subject == "[PATCH] Do it"
    assert patch.header.author == ("Jöhn Doe", "j@example.com")
    assert header_problems(patch) == []
    bad = parse_patch("p", patch_text("Do it", diff, body="", status=None).encode())
    problems = " | ".join(header_problems(bad))
    assert "does not say why" in problems and "missing 'Upstream-Status:'" in problems
    nosubj = parse_patch(
        "p", ("From: A <a@b>\n\nwhy\n\nUpstream-Status: Pending\n---\n" + diff).encode()
    )
    assert any("missing Subject" in p for p in header_problems(nosubj))
    invalid = parse_patch(
        "p", patch_text("x", diff, status="Upstream-Status: Maybe").encode()
    )
    assert any(
        "invalid 'Upstream-Status: Maybe'" in p for p in header_problems(invalid)
    )


def test_exact_apply_modify_create_delete_no_newline() -> None:
    files = {"a": "1\n2\n3\n", "gone": "x\ny\n", "nonl": "p\nq"}
    diff = (
        udiff("a", files["a"], "1\nTWO\n3\n")
        + udiff("new", "", "hello\n")
        + udiff("gone", files["gone"], "")
        + udiff("nonl", files["nonl"], "p\nq2")
    )
    out = _apply(diff, files)
    assert out == {"a": "1\nTWO\n3\n", "new": "hello\n", "gone": None, "nonl": "p\nq2"}


def test_exact_apply_refuses_offset_and_names_it() -> None:
    old = "".join(f"l{i}\n" for i in range(1, 21))
    diff = udiff("f", old, old.replace("l10\n", "L10\n"))
    shifted = "x\ny\n" + old
    with pytest.raises(PatchDoesNotApply) as info:
        _apply(diff, {"f": shifted})
    exc = info.value
    assert exc.file == "f" and exc.hunk_index == 1 and exc.offset == 2
    assert exc.hunk_header.startswith("@@ -7,7 +7,7 @@")
    assert exc.line == 7 and exc.expected == "l7\n" and exc.actual == "l5\n"


def test_exact_apply_refuses_fuzz_even_whitespace() -> None:
    old = "a\nb\nc\nd\n"
    diff = udiff("f", old, "a\nB\nc\nd\n")
    with pytest.raises(PatchDoesNotApply) as info:
        _apply(diff, {"f": "a\nb\nc \nd\n"})
    assert (
        info.value.line == 3
        and info.value.actual == "c \n"
        and info.value.offset is None
    )
    assert "'c '" in str(info.value)


def test_exact_apply_refuses_creating_existing_and_missing_target() -> None:
    with pytest.raises(PatchDoesNotApply, match="already exists"):
        _apply(udiff("f", "", "x\n"), {"f": "y\n"})
    with pytest.raises(PatchDoesNotApply, match="does not exist"):
        _apply(udiff("f", "x\n", "y\n"), {})


def test_canonical_patch_drops_date_and_adds_separator() -> None:
    raw = (
        b"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        b"From: A <a@b>\nDate: Sat, 1 Jan 2000 00:00:00 +0000\nSubject: [PATCH] s\n\n"
        b"why\n\nUpstream-Status: Pending\n\ndiff --git a/f b/f\n--- a/f\n+++ b/f\n"
    )
    out = canonical_patch(raw)
    assert b"Date:" not in out
    assert out.endswith(
        b"Upstream-Status: Pending\n---\ndiff --git a/f b/f\n--- a/f\n+++ b/f\n"
    )
    assert canonical_patch(out) == out


def test_patch_file_name() -> None:
    assert (
        patch_file_name(3, "[PATCH] Add KV hook: mooncake (v1)")
        == "0003-add-kv-hook-mooncake-v1.patch"
    )
