"""tests/upstream/selection.py: the upstream test files a release runs come from the
files its series touches; an unmapped touched file or a missing test file is an
error, a file a release does not ship yet is not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "upstream"))
from selection import (  # noqa: E402
    MOONCAKE,
    TESTS_OF,
    UNTESTED,
    derive,
    touched_files,
)

from harness.vllm_series import SUPPORTED, series  # noqa: E402

HAND = [("tests/v1/core/test_scheduler.py", "hand-picked")]


def tree_with(tmp_path: Path, *files: str) -> Path:
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    return tmp_path


def test_the_tests_of_a_touched_file_are_selected_before_the_hand_picked(tmp_path):
    tree = tree_with(tmp_path, *TESTS_OF["vllm/v1/core/block_pool.py"], HAND[0][0])
    sel = derive({"vllm/v1/core/block_pool.py": ["0010"]}, HAND, tree, "0.18.1")
    assert sel.errors == []
    assert sel.files == [*TESTS_OF["vllm/v1/core/block_pool.py"], HAND[0][0]]
    assert "patches 0010" in sel.why[sel.files[0]]


def test_a_touched_file_with_no_entry_is_an_error_naming_what_to_do(tmp_path):
    sel = derive({"vllm/new_area.py": ["0020"]}, [], tmp_path, "0.32.0")
    assert len(sel.errors) == 1
    assert "vllm/new_area.py" in sel.errors[0] and "TESTS_OF" in sel.errors[0]


def test_a_missing_test_file_is_an_error_unless_the_release_predates_it(tmp_path):
    sel = derive({MOONCAKE: ["0014"]}, [], tmp_path, "0.18.1")
    assert sel.errors == [] and sel.files == []
    assert set(sel.not_shipped) == set(TESTS_OF[MOONCAKE])
    sel = derive({MOONCAKE: ["0014"]}, [], tmp_path, "0.32.0")
    assert len(sel.errors) == 3 and sel.files == []


def test_an_untested_file_is_reported_with_its_reason(tmp_path):
    sel = derive({"setup.py": ["0001"]}, [], tmp_path, "0.18.1")
    assert sel.errors == [] and sel.untested == {"setup.py": UNTESTED["setup.py"]}


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_file_a_supported_series_touches_has_an_entry(version):
    touched = touched_files(series(version).patches)
    assert touched, version
    assert [f for f in touched if f not in TESTS_OF and f not in UNTESTED] == []
