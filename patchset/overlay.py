"""Overlay folders: our new files, copied into the tree and back.

An overlay maps a repo folder (``connector/``) to a folder inside the tree.
Every file under it is placed, except Python caches. Overlay files must never
replace a file of the tree: they are additions only, wiring goes in patches.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .upstream import Overlay

SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
SKIP_SUFFIXES = (".pyc", ".pyo")


def _walk(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or path.name in SKIP_DIRS:
            continue
        if path.is_file() and not path.name.endswith(SKIP_SUFFIXES):
            files.append(path)
    return files


def source_files(root: Path, overlays: tuple[Overlay, ...]) -> dict[str, Path]:
    """Tree-relative destination path -> file in the repo, for all overlays."""
    out: dict[str, Path] = {}
    for ov in overlays:
        base = root / ov.src
        for path in _walk(base):
            out[f"{ov.dst}/{path.relative_to(base).as_posix()}"] = path
    return out


def tree_files(tree: Path, overlays: tuple[Overlay, ...]) -> dict[str, Path]:
    """Tree-relative path -> file in the tree, for files under overlay folders."""
    out: dict[str, Path] = {}
    for ov in overlays:
        for path in _walk(tree / ov.dst):
            out[path.relative_to(tree).as_posix()] = path
    return out


def repo_path(root: Path, overlays: tuple[Overlay, ...], tree_path: str) -> Path:
    """Where a tree overlay file lives in the repo."""
    for ov in overlays:
        if tree_path.startswith(ov.dst + "/"):
            return root / ov.src / tree_path[len(ov.dst) + 1 :]
    raise ValueError(f"{tree_path} is not under an overlay folder")


def read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def copy_file(src: Path, dst: Path) -> bool:
    """Copy bytes and the executable bit; returns False when dst was already equal."""
    if (
        dst.is_file()
        and dst.read_bytes() == src.read_bytes()
        and ((dst.stat().st_mode & 0o111) == (src.stat().st_mode & 0o111))
    ):
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    shutil.copymode(src, dst)
    return True
