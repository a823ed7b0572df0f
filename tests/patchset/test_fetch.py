"""build.py fetch: pinned sha256, cache outside the tree, no network when cached."""

from __future__ import annotations

import sys

import pytest
from conftest import TOP, manifest_text

from patchset import upstream
from patchset.errors import PatchsetError


def test_fetch_verifies_and_caches(project) -> None:
    r = project.run("fetch")
    assert r.code == 0, r.text
    cached = project.cache / f"{TOP}.tar.gz"
    assert cached.read_bytes() == project.source.read_bytes()
    assert "verified sha256" in r.out
    assert not (project.root / "third_party").exists()  # fetch does not unpack


def test_sha256_mismatch_refused_naming_both_hashes(project) -> None:
    wrong = "0" * 64
    (project.root / "patches" / "upstream.toml").write_text(manifest_text(wrong))
    r = project.run("fetch")
    assert r.code == 1
    assert wrong in r.err and project.sha in r.err
    assert "sha256 mismatch" in r.err
    assert not (project.cache / f"{TOP}.tar.gz").exists()  # the bad file is not kept
    assert [p.name for p in project.cache.iterdir()] == []
    # apply fetches too, and refuses the same way without creating a tree
    r = project.run("apply")
    assert r.code == 1 and wrong in r.err and project.sha in r.err
    assert not project.tree.exists()


def test_cached_verified_sdist_reused_without_network(project, monkeypatch) -> None:
    assert project.run("fetch").code == 0
    # No source any more: any download attempt would fail.
    monkeypatch.setenv("VMP_SDIST_URL", str(project.base / "nowhere.tar.gz"))
    r = project.run("fetch")
    assert r.code == 0, r.text
    assert "no download" in r.out


def test_corrupt_cache_is_replaced(project) -> None:
    cached = project.cache / f"{TOP}.tar.gz"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not a tarball")
    r = project.run("fetch")
    assert r.code == 0, r.text
    assert "fetching again" in r.out
    assert cached.read_bytes() == project.source.read_bytes()


def test_pip_failure_says_torch_and_shows_pip_output(
    project, monkeypatch, tmp_path
) -> None:
    monkeypatch.delenv("VMP_SDIST_URL")
    fake = tmp_path / "fake-python"
    fake.write_text(
        "#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    manifest = upstream.load_manifest(project.root / "patches" / "upstream.toml")
    with pytest.raises(PatchsetError) as info:
        upstream.fetch(manifest, say=lambda m: None)
    msg = str(info.value)
    assert "torch and setuptools_scm must be importable" in msg
    assert "No module named torch" in msg
    assert "VLLM_TARGET_DEVICE=empty" in msg and "--no-build-isolation" in msg
    assert info.value.exit_code == 2


def test_bad_manifest_cannot_run(project) -> None:
    (project.root / "patches" / "upstream.toml").write_text(
        "[upstream]\nname = 'vllm'\n"
    )
    r = project.run("status")
    assert r.code == 2 and "version" in r.err
