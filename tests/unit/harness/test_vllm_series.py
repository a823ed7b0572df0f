"""The supported vLLM releases (harness/vllm_series.py): each one's folders agree
with its own upstream.toml, and VMP_VLLM selects among them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness import vllm_series
from harness.vllm_series import (
    PINNED,
    RELEASE_INDEPENDENT_TESTS,
    SUPPORTED,
    selected,
    series,
)


@pytest.mark.parametrize("version", list(SUPPORTED))
def test_each_release_pins_itself_and_has_its_own_tree_venv_and_requirements(version):
    s = series(version)
    assert (s.patches / "series").is_file()
    for name in ("base.txt", "cpu.txt", "cuda.txt", "lock.txt"):
        assert (s.requirements / name).is_file(), f"{s.requirements / name} missing"
    others = [series(v) for v in SUPPORTED if v != version]
    assert all(o.tree != s.tree and o.venv != s.venv for o in others)
    # one overlay serves every release
    assert s.overlay and all(o.overlay == s.overlay for o in others)


def test_the_pinned_release_keeps_the_documented_paths():
    s = series(PINNED)
    root = vllm_series.ROOT
    assert (s.patches, s.tree, s.venv) == (
        root / "patches",
        root / "third_party" / "vllm",
        root / ".venv",
    )


def test_an_unsupported_release_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="supported: " + ", ".join(SUPPORTED)):
        series("0.99.0")


def test_vmp_vllm_selects_the_release(monkeypatch):
    monkeypatch.delenv("VMP_VLLM", raising=False)
    assert selected().version == PINNED
    roll = next(v for v in SUPPORTED if v != PINNED)
    monkeypatch.setenv("VMP_VLLM", roll)
    assert selected().version == roll


def test_a_folder_that_pins_another_release_is_refused(tmp_path):
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "upstream.toml").write_text(
        '[upstream]\nversion = "0.19.0"\ntree = "third_party/vllm"\n'
    )
    (tmp_path / "releases.toml").write_text(
        f'[release."{PINNED}"]\npinned = true\nstatus = "tested"\n'
        'patches = "patches"\nrequirements = "requirements"\nvenv = ".venv"\n'
    )
    with pytest.raises(ValueError, match="patches/upstream.toml pins vLLM 0.19.0"):
        series(PINNED, root=tmp_path)


def mooncake_pins(version: str) -> set[str]:
    lock = (series(version).requirements / "lock.txt").read_text().splitlines()
    return {ln.strip() for ln in lock if ln.startswith("mooncake-transfer-engine")}


def test_release_independent_tests_exist_and_every_release_pins_one_engine():
    """What lets scripts/test.sh run those tests once: they import no vLLM code
    but this series' overlay, and every release pins the same Mooncake engine."""
    root = vllm_series.ROOT
    for path in RELEASE_INDEPENDENT_TESTS:
        text = (root / path).read_text()
        assert "import vllm" not in text and "from vllm" not in text, path
    pinned = mooncake_pins(PINNED)
    assert pinned
    for version in SUPPORTED:
        cpu_engine = {p for p in mooncake_pins(version) if "non-cuda" in p}
        assert cpu_engine and cpu_engine <= pinned, (version, cpu_engine, pinned)


def shell_values(mode: str) -> dict[str, str]:
    """What bash sees after ``eval "$(python -m harness.vllm_series MODE)"``."""
    names = (
        "VMP_PINNED VMP_ROLLS VMP_CHECKED_ONLY VMP_ONCE VMP_BESIDE_UNIT VMP_BESIDE_INTEGRATION"
        " VMP_VLLM VMP_PATCHES"
    )
    script = (
        f'eval "$({sys.executable} -m harness.vllm_series {mode})" || exit 9; '
        f'for n in {names}; do printf "%s=%s\\n" "$n" "${{!n-}}"; done'
    )
    out = subprocess.run(
        ["bash", "-c", script],
        cwd=vllm_series.ROOT,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def test_the_releases_mode_gives_test_sh_every_list_in_one_call():
    got = shell_values("releases")
    assert got["VMP_PINNED"] == PINNED
    assert got["VMP_ROLLS"].split() == [v for v in SUPPORTED if v != PINNED]
    assert got["VMP_CHECKED_ONLY"].split() == list(vllm_series.CHECKED_ONLY.values())
    assert got["VMP_ONCE"].split() == list(
        RELEASE_INDEPENDENT_TESTS
        + vllm_series.PINNED_ONLY_TESTS
        + vllm_series.TOOLING_TESTS
    )
    for path in got["VMP_ONCE"].split():  # --ignore of a missing path is silent
        assert (vllm_series.ROOT / path).exists(), path
    # beside the unit tests: integration tests (each release those of them it runs)
    beside = got["VMP_BESIDE_UNIT"].split()
    assert beside and all(p.startswith("tests/integration/") for p in beside), beside
    # beside the integration tests: tests run once, with the pinned release
    beside = got["VMP_BESIDE_INTEGRATION"].split()
    assert set(RELEASE_INDEPENDENT_TESTS) <= set(beside), beside
    assert set(beside) <= set(got["VMP_ONCE"].split()), beside
    assert not set(beside) & set(got["VMP_BESIDE_UNIT"].split()), beside
    for path in got["VMP_BESIDE_UNIT"].split() + beside:
        assert (vllm_series.ROOT / path).exists(), path
    assert got["VMP_VLLM"] == ""  # the selection is the other mode's


def test_the_shell_mode_gives_the_selected_release():
    got = shell_values("shell")
    assert (got["VMP_VLLM"], got["VMP_PATCHES"]) == (PINNED, "patches")
    assert got["VMP_PINNED"] == ""


def test_the_tooling_tests_run_once_because_they_import_no_vllm():
    """Each test module in TOOLING_TESTS, imported alone, loads no vllm module: its
    outcome cannot depend on the release (scripts/test.sh runs it on the pinned one)."""
    modules = []
    for path in vllm_series.TOOLING_TESTS:
        p = vllm_series.ROOT / path
        files = sorted(p.glob("test_*.py")) if p.is_dir() else [p]
        assert files, path
        modules += [
            ".".join(f.relative_to(vllm_series.ROOT).with_suffix("").parts)
            for f in files
        ]
    code = (
        "import importlib, sys\n"
        "bad = []\n"
        "for m in sys.argv[1:]:\n"
        "    importlib.import_module(m)\n"
        "    if any(k == 'vllm' or k.startswith('vllm.') for k in sys.modules):\n"
        "        bad.append(m)\n"
        "        break\n"
        "print(' '.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *modules],
        cwd=vllm_series.ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "", f"imports vllm, so it depends on the release: {out}"
