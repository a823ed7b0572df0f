"""The README's configuration table is config.VARIABLES, the one table the code reads.

Each README row is a variable of the table with its stated default and help, the
code reads no variable of ours outside the table, and setting a variable to the
default the README states changes nothing.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import config

README = Path(__file__).resolve().parents[4] / "README.md"
NAME = r"MOONCAKE_[A-Z_]*[A-Z*]"
README_ROW = re.compile(rf"^\| `({NAME})` \| ([^|]+?) \| (.+?) \|$", re.MULTILINE)
# Read by config.py only to validate or parse; documented under MOONCAKE_FAULT_*.
FAULT = "MOONCAKE_FAULT_"
# A default the README states in words: the value that means it.
SPELLED = {"off": "0", "empty": ""}


def readme_rows() -> dict[str, tuple[str, str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    return {
        name: (default, help) for name, default, help in README_ROW.findall(section)
    }


def readme_table() -> dict[str, str]:
    return {name: default for name, (default, _) in readme_rows().items()}


def names_read_by_code() -> set[str]:
    source = inspect.getsource(config)
    names = set(re.findall(rf'"({NAME})"', source))
    return {n for n in names if not n.startswith(FAULT)} | {FAULT + "*"}


def test_the_readme_table_is_the_code_table():
    table = {name: (v.shown, v.help) for name, v in config.VARIABLES.items()}
    table[FAULT + "*"] = ("unset", "fault injection, tests only")
    assert readme_rows() == table


def test_the_code_reads_no_variable_of_ours_outside_the_table():
    assert names_read_by_code() == set(config.VARIABLES) | {FAULT + "*"}


@pytest.mark.parametrize(
    "name",
    sorted(n for n, d in readme_table().items() if d != "unset"),
)
def test_setting_a_variable_to_its_readme_default_changes_nothing(name):
    stated = readme_table()[name]
    value = SPELLED.get(stated, stated)
    assert config.ExtConfig.from_env({name: value}) == config.ExtConfig.from_env({})
