"""releases.toml, the index of supported releases (patchset/release_index.py): read
and checked once, for build.py's --vllm and for harness/vllm_series.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import VERSION

from patchset import release_index
from patchset.errors import PatchsetError

ROOT = Path(__file__).resolve().parents[2]

PINNED_TABLE = (
    '[release."1.0.0"]\npinned = true\nstatus = "tested"\npatches = "patches"\n'
    'requirements = "requirements"\nvenv = ".venv"\n'
)
ROLL_TABLE = '[release."2.0.0"]\nstatus = "checked"\npatches = "rolls/2.0.0"\n'


def layout(root: Path, index: str, pins: dict[str, str] | None = None) -> Path:
    """A root with releases.toml and, per patch folder, an upstream.toml pinning
    ``pins[folder]``."""
    pins = {"patches": "1.0.0", "rolls/2.0.0": "2.0.0"} if pins is None else pins
    for folder, version in pins.items():
        (root / folder).mkdir(parents=True)
        (root / folder / "upstream.toml").write_text(
            f'[upstream]\nversion = "{version}"\n'
        )
    (root / "releases.toml").write_text(index)
    return root


def test_the_projects_index_has_one_pinned_release_and_its_rolls():
    index = release_index.read(ROOT)
    assert [r.version for r in index.values() if r.pinned] == ["0.18.1"]
    assert index["0.18.1"].patches == "patches"
    for release in index.values():
        assert (ROOT / release.patches / "series").is_file(), release
        if release.status == release_index.TESTED:
            assert (ROOT / release.requirements / "lock.txt").is_file(), release


def test_a_wellformed_index_reads_as_written(tmp_path):
    index = release_index.read(layout(tmp_path, PINNED_TABLE + ROLL_TABLE))
    assert index["2.0.0"] == release_index.Release(
        "2.0.0", patches="rolls/2.0.0", status="checked"
    )
    assert release_index.patches_of(tmp_path, "2.0.0") == "rolls/2.0.0"


@pytest.mark.parametrize(
    ("index", "pins", "names"),
    [
        ("", None, "exactly one release is pinned"),
        (PINNED_TABLE.replace("pinned = true", "pinned = false"), None, "pinned"),
        (PINNED_TABLE + ROLL_TABLE.replace("checked", "maybe"), None, "'maybe'"),
        (PINNED_TABLE + ROLL_TABLE + "colour = 1\n", None, "unknown keys ['colour']"),
        (PINNED_TABLE.replace('venv = ".venv"\n', ""), None, "names its requirements"),
        (PINNED_TABLE.replace("1.0.0", "one"), {"patches": "one"}, "not a final"),
        (PINNED_TABLE, {"patches": "1.0.1"}, "patches/upstream.toml pins vLLM 1.0.1"),
        (PINNED_TABLE + ROLL_TABLE, {"patches": "1.0.0"}, "rolls/2.0.0/upstream.toml"),
        ("[release", None, "cannot read the release index"),
    ],
    ids=[
        "none-pinned",
        "pinned-false",
        "bad-status",
        "unknown-key",
        "tested-without-venv",
        "bad-version",
        "folder-pins-another",
        "folder-missing",
        "not-toml",
    ],
)
def test_a_wrong_index_is_refused_naming_what_is_wrong(tmp_path, index, pins, names):
    with pytest.raises(PatchsetError, match=names.replace("[", r"\[")):
        release_index.read(layout(tmp_path, index, pins))


def test_build_py_vllm_picks_the_folder_of_a_release_and_refuses_others(project):
    """--vllm V runs a command on the series releases.toml names for V; a release
    it does not list is an rc-2 error naming the supported ones; --vllm and
    --patches together are refused."""
    (project.root / "releases.toml").write_text(PINNED_TABLE.replace("1.0.0", VERSION))
    assert project.run("fetch").code == 0
    r = project.run("--vllm", VERSION, "status")
    assert r.code == 1 and f"upstream: vllm {VERSION}" in r.out, r  # 1: no tree yet
    r = project.run("--vllm", "9.9.9", "status")
    assert r.code == 2 and f"supported: {VERSION}" in r.err, r
    assert project.run("--vllm", VERSION, "--patches", "patches", "status").code == 2
