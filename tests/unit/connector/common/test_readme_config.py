"""The README's configuration table says what connector/common/config.py reads.

Every variable ``ExtConfig.from_env`` reads is in the README's "Configuration"
table and no other, and setting a variable to the default the table states
changes nothing: a variable added to the code but not to the README, or a
default changed in one place only, fails here.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import config

README = Path(__file__).resolve().parents[4] / "README.md"
NAME = r"MOONCAKE_[A-Z_]*[A-Z*]"
README_ROW = re.compile(rf"^\| `({NAME})` \| ([^|]+?) \|", re.MULTILINE)
# Read by config.py only to validate or parse; documented under MOONCAKE_FAULT_*.
FAULT = "MOONCAKE_FAULT_"
# A default the README states in words: the value that means it.
SPELLED = {"off": "0", "empty": ""}


def readme_table() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    return dict(README_ROW.findall(section))


def names_read_by_code() -> set[str]:
    source = inspect.getsource(config)
    names = set(re.findall(rf'"({NAME})"', source))
    return {n for n in names if not n.startswith(FAULT)} | {FAULT + "*"}


def test_the_readme_names_every_variable_the_code_reads_and_no_other():
    assert names_read_by_code() == set(readme_table())


@pytest.mark.parametrize(
    "name",
    sorted(n for n, d in readme_table().items() if d != "unset"),
)
def test_setting_a_variable_to_its_readme_default_changes_nothing(name):
    stated = readme_table()[name]
    value = SPELLED.get(stated, stated)
    assert config.ExtConfig.from_env({name: value}) == config.ExtConfig.from_env({})
