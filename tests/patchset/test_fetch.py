"""build.py fetch: pinned sha256, cache outside the tree, no network when cached."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import TOP, VERSION, manifest_text

from patchset import releases, upstream


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


def serve_from_index(project, monkeypatch, sha: str | None = None) -> Path:
    """A local index (VMP_INDEX_URL) listing the project's sdist; no VMP_SDIST_URL."""
    index = project.base / "index"
    (index / "vllm").mkdir(parents=True)
    entry = {
        "filename": project.source.name,
        "packagetype": "sdist",
        "url": project.source.as_uri(),
        "digests": {"sha256": sha or project.sha},
        "yanked": False,
    }
    (index / "vllm" / "json").write_text(json.dumps({"releases": {VERSION: [entry]}}))
    monkeypatch.delenv("VMP_SDIST_URL")
    monkeypatch.setenv("VMP_INDEX_URL", str(index))
    releases.clear_index_cache()
    return index


@pytest.fixture
def no_pip(monkeypatch, tmp_path) -> None:
    """An interpreter whose pip would build the sdist's metadata and fail (no torch)."""
    fake = tmp_path / "fake-python"
    fake.write_text(
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    yield
    releases.clear_index_cache()


def test_fetch_downloads_the_index_file_without_pip(project, monkeypatch, no_pip):
    """No torch in the interpreter: fetch never runs pip, it takes the index's file."""
    serve_from_index(project, monkeypatch)
    r = project.run("fetch")
    assert r.code == 0, r.text
    cached = project.cache / f"{TOP}.tar.gz"
    assert cached.read_bytes() == project.source.read_bytes()
    assert project.source.as_uri() in r.out and "verified sha256" in r.out
    assert "pip" not in r.out


def test_fetch_refuses_an_index_digest_other_than_the_pin(
    project, monkeypatch, no_pip
) -> None:
    other = "f" * 64
    serve_from_index(project, monkeypatch, sha=other)
    r = project.run("fetch")
    assert r.code == 1, r.text
    assert other in r.err and project.sha in r.err and "index" in r.err
    assert not (project.cache / f"{TOP}.tar.gz").exists()


def test_a_corrupt_cached_sdist_is_moved_aside_not_deleted(project) -> None:
    cached = project.cache / f"{TOP}.tar.gz"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not a tarball")
    bad = hashlib.sha256(b"not a tarball").hexdigest()
    r = project.run("fetch")
    assert r.code == 0, r.text
    aside = project.cache / f"{TOP}.tar.gz.corrupt-{bad[:12]}"
    assert aside.read_bytes() == b"not a tarball"  # the evidence is kept
    assert str(aside) in r.out and bad in r.out
    assert cached.read_bytes() == project.source.read_bytes()


def test_a_corrupt_cached_release_is_moved_aside_not_deleted(
    project, monkeypatch
) -> None:
    """The same for releases compat and rebase fetch from the index."""
    serve_from_index(project, monkeypatch)
    cached = project.cache / f"{TOP}.tar.gz"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"truncated")
    bad = hashlib.sha256(b"truncated").hexdigest()
    said: list[str] = []
    path, sha = releases.fetch_release(VERSION, said.append)
    assert path == cached and sha == project.sha
    aside = project.cache / f"{TOP}.tar.gz.corrupt-{bad[:12]}"
    assert aside.read_bytes() == b"truncated"
    assert any(str(aside) in m for m in said), said
    releases.clear_index_cache()


def test_bad_manifest_cannot_run(project) -> None:
    (project.root / "patches" / "upstream.toml").write_text(
        "[upstream]\nname = 'vllm'\n"
    )
    r = project.run("status")
    assert r.code == 2 and "version" in r.err


class _Drip(BaseHTTPRequestHandler):
    """A file served a byte every 0.1 s: each read is answered in time, the whole
    file takes 20 s."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "200")
        self.end_headers()
        for _ in range(200):
            try:
                self.wfile.write(b"x")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.1)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("what", ["file", "index"])
def test_a_download_that_never_ends_stops_at_its_deadline(what, tmp_path, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(upstream, "DOWNLOAD_DEADLINE_S", 1)
    url = f"http://127.0.0.1:{server.server_address[1]}/vllm.tar.gz"
    start = time.monotonic()
    try:
        with pytest.raises(releases.ReleaseError, match="not finished after 1 s"):
            if what == "file":
                releases.download(url, tmp_path / "vllm.tar.gz", print)
            else:
                releases._index_json(url)
    finally:
        server.shutdown()
        server.server_close()
    assert time.monotonic() - start < 5
