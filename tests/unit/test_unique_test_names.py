"""pytest imports test modules by their file name (the test folders are not
packages): two test files with one name stop the whole collection."""

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_name_is_unique():
    by_name = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    assert {n: ps for n, ps in by_name.items() if len(ps) > 1} == {}
