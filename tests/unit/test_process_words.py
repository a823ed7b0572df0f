"""The process-word check (.ci/check_words.py) flags how the work was organised and
lets the product's own vocabulary through.

The lines to flag are ones this repository once held; the lines to pass are the
product's sessions (a user's multi-turn session, Mooncake's transfer-engine session)
and upstream tracker references. The whole repository is scanned by .ci/run, not here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_checker():
    spec = importlib.util.spec_from_file_location(
        "check_words", ROOT / ".ci" / "check_words.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check_words = _load_checker()

MUST_FLAG = [
    ("Fixed in session 2: the transfer engine's silent -1", "fixed-in"),
    ("Fixed in session 2: the transfer engine's silent -1", "numbered-session"),
    ("Measured (session 4, Intel, warm caches)", "numbered-session"),
    ("the targets of issue 13", "bare-issue"),
    ("layer-wise write failed (issue 4)", "bare-issue"),
    ("mb7 under load, issue 4).", "bare-issue"),
    (
        "Security hardening of prefix push (issue 10): who may make C write",
        "bare-issue",
    ),
    ("measured by a helper session", "helper"),
    ("Done in session 4 (issue 11)", "fixed-in"),
    ("results/push-session3-before-issue10.json", "numbered-session"),
    ("results/push-session3-before-issue10.json", "bare-issue"),
    ("Session 5 kept the default", "numbered-session"),
    ("over three sessions of work", "sessions-of-work"),
    ("left for the next sprint", "sprint"),
    ("see ticket #12", "ticket"),
]

MUST_PASS = [
    "turn 2 of a session on another instance",
    "a multi-turn session",
    "# forged requests of this module (session 127.0.0.1:1) may have none",
    "session 10.0.0.2:17000 and session localhost:17001",
    "dst_session",
    "mooncake_session = f'{host}:{port}'",
    "request and must never hear of it again (vLLM issue #43226).",
    "Upstream-Status: Backport [same fix as vllm-project/vllm#37354]",
    "vllm#50984",
    "vllm-project/vllm issue #37354 and upstream issue 5 and Mooncake's issue #12",
    "the session's KV",
    "which issues them with the transfer engine",
    "from helpers import wait_until  # a helper function",
    'sprintf("%d", n)',
    "github.com/vllm-project/vllm/issues/43226",
]


@pytest.mark.parametrize(("line", "rule"), MUST_FLAG)
def test_a_line_naming_how_the_work_was_organised_is_flagged(line, rule) -> None:
    hits = check_words.scan_line(line)
    assert any(hit.endswith(f"({rule})") for hit in hits), hits


@pytest.mark.parametrize("line", MUST_PASS)
def test_the_products_own_vocabulary_passes(line) -> None:
    assert check_words.scan_line(line) == []


def test_a_hit_names_the_matched_text_and_its_rule() -> None:
    assert check_words.scan_line("the targets of issue 13") == ["issue 13 (bare-issue)"]


def _repo(tmp_path: Path, files: dict[str, bytes]) -> Path:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for rel, data in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    return tmp_path


def test_the_script_reports_path_line_and_rule_and_fails(tmp_path, capsys) -> None:
    root = _repo(
        tmp_path,
        {
            "a.py": b"x = 1\n# seen under load (issue 4)\n",
            "ok.md": b"turn 2 of a session\n",
            "blob.bin": b"\0issue 4\n",  # binary: skipped
            ".ci/check_words.py": b"# issue 4\n",  # exempt
        },
    )
    assert check_words.main(root) == 1
    assert capsys.readouterr().out.splitlines() == ["a.py:2: issue 4 (bare-issue)"]


def test_the_script_passes_a_clean_tree_and_counts_its_files(tmp_path, capsys) -> None:
    root = _repo(tmp_path, {"a.py": b"x = 1\n", "b.md": b"a multi-turn session\n"})
    assert check_words.main(root) == 0
    assert capsys.readouterr().out == "no process words in 2 tracked files\n"
