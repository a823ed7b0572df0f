"""The overlay against a release: its destinations, and what it imports from vLLM.

The overlay's .py files are parsed (``ast``; nothing is imported) for every
absolute ``vllm.*`` import and every relative one that climbs out of the
overlay; imports of the overlay's own modules are skipped. On a release, each
imported module must still exist (a file or a package) and each imported name
must still be defined at the module's top level (or be a submodule). A name
that is gone is looked up across the release (``locate_moved_names``). The
overlay's destinations must keep their parent folder, and no overlay file may
collide with an upstream file.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from .. import upstream
from ..pynames import absolute_module, module_candidates, package_of, top_level_names

if TYPE_CHECKING:
    from .inputs import TreeState

IMPORT_BREAKS = ("module missing", "name missing")


@dataclass(frozen=True)
class ImportRef:
    file: str  # tree path of the overlay file
    line: int
    module: str  # absolute dotted module
    name: str | None  # imported name; None for ``import module``
    guarded: bool  # inside ``try: ... except ImportError``

    @property
    def target(self) -> tuple[str, str | None]:
        return (self.module, self.name)


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = []
        if handler.type is None:
            return True
        types = (
            handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        )
        names = [t.id for t in types if isinstance(t, ast.Name)]
        if {"ImportError", "ModuleNotFoundError", "Exception"} & set(names):
            return True
    return False


def overlay_imports(
    sources: dict[str, Path], overlays: tuple[upstream.Overlay, ...], top: str
) -> tuple[list[ImportRef], list[str]]:
    """Imports of upstream modules in the overlay's .py files (and parse errors)."""
    own = [ov.dst.replace("/", ".") for ov in overlays]
    refs: list[ImportRef] = []
    errors: list[str] = []
    for dst, src in sorted(sources.items()):
        if not dst.endswith(".py"):
            continue
        try:
            tree = ast.parse(src.read_bytes(), filename=str(src))
        except SyntaxError as exc:
            errors.append(f"{dst}: {exc}")
            continue
        for node, guarded in _import_nodes(tree, False):
            for module, name in _imported(node, package_of(dst)):
                if module != top and not module.startswith(top + "."):
                    continue
                if any(module == o or module.startswith(o + ".") for o in own):
                    continue  # ours: another overlay file
                refs.append(ImportRef(dst, node.lineno, module, name, guarded))
    return refs, errors


def _import_nodes(node: ast.AST, guarded: bool):
    """Every import statement under node, and whether a try/except ImportError guards it."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, guarded
        elif isinstance(child, ast.Try) and _catches_import_error(child):
            for stmt in child.body:
                yield from _import_nodes(ast.Module([stmt], []), True)
            for part in (child.handlers, child.orelse, child.finalbody):
                for stmt in part:
                    yield from _import_nodes(ast.Module([stmt], []), guarded)
        else:
            yield from _import_nodes(child, guarded)


def _imported(
    node: ast.Import | ast.ImportFrom, package: list[str]
) -> list[tuple[str, str | None]]:
    """(absolute module, name) pairs of one import statement in ``package``."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    module = absolute_module(node.module, node.level, package)
    return [] if module is None else [(module, a.name) for a in node.names]


def defined_names(tree: ast.Module) -> tuple[set[str], bool]:
    """Top-level names a module defines, and whether it can define more (``*``, ``__getattr__``)."""
    names = top_level_names(tree)
    return set(names.lines), names.dynamic


# -- on one release ---------------------------------------------------------


def check_overlay(
    overlays: tuple[upstream.Overlay, ...], sources: dict[str, Path], state: TreeState
) -> dict:
    """Each destination's parent on the release, and overlay files that collide."""
    out: dict = {"destinations": [], "collisions": []}
    for ov in overlays:
        parent = str(PurePosixPath(ov.dst).parent)
        out["destinations"].append(
            {
                "dst": ov.dst,
                "parent": parent,
                "parent_exists": state.dir_exists(parent),
                "dst_exists_upstream": state.dir_exists(ov.dst),
            }
        )
    for path in sorted(sources):
        if state.exists(path):
            out["collisions"].append(path)
    return out


def check_imports(imports: list[ImportRef], state: TreeState) -> list[dict]:
    """One row per distinct (module, name) the overlay imports from upstream."""
    parsed: dict[str, tuple[set[str], bool] | None] = {}

    def module_file(module: str) -> str | None:
        for cand in module_candidates(module):
            if state.exists(cand):
                return cand
        return None

    def names_of(path: str) -> tuple[set[str], bool] | None:
        if path not in parsed:
            try:
                parsed[path] = defined_names(ast.parse(state.read(path) or ""))
            except SyntaxError:
                parsed[path] = None
        return parsed[path]

    rows = []
    refs: dict[tuple[str, str | None], list[ImportRef]] = {}
    for ref in imports:
        refs.setdefault(ref.target, []).append(ref)
    for (module, name), uses in sorted(refs.items(), key=str):
        row: dict = {"module": module, "name": name}
        if all(u.guarded for u in uses):
            row["guarded"] = True  # every use is inside try/except ImportError
        path = module_file(module)
        if path is None:
            namespace = state.dir_exists(module.replace(".", "/"))
            if namespace and name and module_file(f"{module}.{name}"):
                row.update(status="ok", file=module.replace(".", "/") + "/")
            else:
                row.update(status="module missing")
            rows.append(row)
            continue
        row["file"] = path
        if name is None or name == "*":
            row["status"] = "ok"
        elif module_file(f"{module}.{name}"):
            row["status"] = "ok"  # a submodule
        else:
            names = names_of(path)
            if names is None:
                row["status"] = "unverifiable"
                row["note"] = f"{path} does not parse"
            elif name in names[0]:
                row["status"] = "ok"
            elif names[1]:
                row["status"] = "unverifiable"
                row["note"] = (
                    f"{path} defines names dynamically (* import or __getattr__)"
                )
            else:
                row["status"] = "name missing"
        rows.append(row)
    return rows


def locate_moved_names(
    rows: list[dict], state: TreeState, texts: dict[str, str]
) -> None:
    """Where a missing name is defined now, where a missing module went (``texts``:
    every .py file of the release)."""
    for row in rows:
        if row["status"] == "name missing":
            name = re.escape(row["name"])
            pattern = re.compile(
                rf"^(?:class|def|async def)\s+{name}\b|^{name}\s*[:=]", re.MULTILINE
            )
            row["defined_in"] = sorted(
                p for p, t in texts.items() if pattern.search(t)
            )[:5]
        elif row["status"] == "module missing":
            last = row["module"].rsplit(".", 1)[-1]
            row["candidates"] = sorted(
                m
                for m in state.members
                if m.endswith((f"/{last}.py", f"/{last}/__init__.py"))
            )[:5]
