"""The README's configuration table says what connector/common/config.py reads.

Three sources must agree: the variables ``ExtConfig.from_env`` reads (its source),
the table in config.py's docstring, and the README's "Configuration" table, with
the same defaults. A variable added to the code but not to the README (or a
default changed in one place only) fails here.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import config

README = Path(__file__).resolve().parents[4] / "README.md"
NAME = r"MOONCAKE_[A-Z_]*[A-Z*]"
DOC_ROW = re.compile(rf"^({NAME})(?:=\S+)?\s+(\S+)\s", re.MULTILINE)
README_ROW = re.compile(rf"^\| `({NAME})` \| ([^|]+?) \|", re.MULTILINE)
# Read by config.py only to validate or parse; documented under MOONCAKE_FAULT_*.
FAULT = "MOONCAKE_FAULT_"


def docstring_table() -> dict[str, str]:
    return dict(DOC_ROW.findall(config.__doc__ or ""))


def readme_table() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    return dict(README_ROW.findall(section))


def names_read_by_code() -> set[str]:
    source = inspect.getsource(config)
    names = set(re.findall(rf'"({NAME})"', source))
    return {n for n in names if not n.startswith(FAULT)} | {FAULT + "*"}


def test_every_variable_the_code_reads_is_in_both_tables():
    read = names_read_by_code()
    assert read - set(docstring_table()) == set(), (
        "missing from config.py's docstring table"
    )
    assert read - set(readme_table()) == set(), (
        "missing from README.md's Configuration table"
    )


def test_the_tables_name_no_variable_the_code_does_not_read():
    read = names_read_by_code()
    assert set(docstring_table()) - read == set()
    assert set(readme_table()) - read == set()


@pytest.mark.parametrize("name", sorted(docstring_table()))
def test_readme_default_matches_config(name):
    doc_default = docstring_table()[name]
    readme_default = readme_table()[name]
    if doc_default.startswith("see"):
        # a computed default: the README states the value with the upstream defaults
        field = {
            "MOONCAKE_LAYERWISE_TIMEOUT_S": "layerwise_timeout_s",
            "MOONCAKE_DECODE_PULL_WAIT_S": "decode_pull_wait_s",
        }[name]
        computed = getattr(config.ExtConfig.from_env({}), field)
        assert float(readme_default) == computed
    else:
        assert readme_default == doc_default
