"""Where things are in a project checkout (the repo that holds ``patches/``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from . import overlay, series
from .errors import PatchsetError, ProblemsFound
from .release_index import MANIFEST
from .upstream import Manifest, load_manifest

# the pinned series; `build.py rebase` writes others to rolls/<version>
PATCHES = "patches"
SERIES = "series"
ROLLS = "rolls"  # a roll of the series onto release V: rolls/V/


class PatchOutsideFolder(ProblemsFound):
    """A series entry that names something other than a file of its folder."""


@dataclass
class Project:
    root: Path
    # folder (relative to root) with upstream.toml, series, *.patch
    patches: str = PATCHES
    # build the tree elsewhere (rebase's scratch copy)
    tree_override: Path | None = None

    @cached_property
    def manifest(self) -> Manifest:
        return load_manifest(self.patches_dir / MANIFEST)

    @property
    def patches_dir(self) -> Path:
        return self.root / self.patches

    @property
    def series_path(self) -> Path:
        return self.patches_dir / SERIES

    @property
    def tree(self) -> Path:
        return self.tree_override or self.root / self.manifest.tree

    @property
    def git_dir(self) -> Path:
        """The tree's git dir, next to (never inside) the tree: ``vllm.git``."""
        tree = self.tree
        return tree.with_name(tree.name + ".git")

    def cmd(self, args: str) -> str:
        """The command line that runs ``build.py args`` on this patch folder, as a
        hint prints it: with ``--patches`` unless the folder is the default."""
        where = "" if self.patches == PATCHES else f" --patches {self.patches}"
        return f"python build.py{where} {args}"

    def rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)

    def series(self) -> series.Series:
        """The series file, parsed; a missing one is an error (an empty file is
        a series of no patches)."""
        if not self.series_path.is_file():
            raise PatchsetError(
                f"{self.rel(self.series_path)} does not exist: {self.patches}/ is not "
                "a patch folder (pass the folder that holds upstream.toml and "
                "series with --patches; an empty series file lists no patches)"
            )
        return series.read_series(self.series_path)

    def patch_name_problem(self, name: str) -> str | None:
        """Why ``name``, a series entry, does not name a file of the patch folder
        (None: it does). Every entry is a plain file name: no absolute path, no
        folder, no '..', and not a symlink leading out of the folder."""
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            return (
                f"is not a file name in {self.patches}/ (absolute paths, folders "
                "and '..' are refused)"
            )
        path = self.patches_dir / name
        if path.is_symlink():
            target = path.resolve()
            if not target.is_relative_to(self.patches_dir.resolve()):
                return f"is a symlink out of {self.patches}/ (-> {target})"
        return None

    def patch_path(self, name: str) -> Path:
        """The file of series entry ``name``; refuses a name outside the folder
        (patch_name_problem), so no command reads, writes or deletes elsewhere."""
        why = self.patch_name_problem(name)
        if why is not None:
            raise PatchOutsideFolder(
                f"{self.rel(self.series_path)}: {name!r} {why}. List each patch by "
                f"its file name in {self.patches}/."
            )
        return self.patches_dir / name

    def patch_files_on_disk(self) -> list[str]:
        """Names (relative to patches/) of every *.patch / *.diff file."""
        found = []
        for suffix in ("*.patch", "*.diff"):
            found += [
                p.relative_to(self.patches_dir).as_posix()
                for p in self.patches_dir.rglob(suffix)
            ]
        return sorted(found)

    def overlay_sources(self) -> dict[str, Path]:
        return overlay.source_files(self.root, self.manifest.overlays)

    def git_cmd(self) -> str:
        """How a user drives the tree's git by hand, from the project root."""
        git_dir = self.git_dir.relative_to(self.tree.parent).as_posix()
        return f"git -C {self.rel(self.tree)} --git-dir=../{git_dir}"
