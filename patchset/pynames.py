"""Names a Python module defines at its top level, read from its ``ast``.

Read by ``releasecheck`` (does a name the overlay imports still exist upstream?):
``def``/``class``, assignments (plain, annotated, augmented; unpacked targets
too) and imports, also inside top-level ``if``/``try``/``with``/``for``
blocks. Nothing is imported or run.

The ``ast`` readings ``releasecheck`` and ``overrides`` share live here too: a
body's statements, the module a relative import names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath


def statements(body: list[ast.stmt], blocks: bool = False) -> Iterator[ast.stmt]:
    """Statements of a module or class body, looking into ``if``/``try`` blocks
    (and into ``with``/``for`` bodies when ``blocks``)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            parts = [stmt.body, stmt.orelse]
        elif isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            handlers = [h.body for h in stmt.handlers]
            parts = [stmt.body, *handlers, stmt.orelse, stmt.finalbody]
        elif blocks and isinstance(stmt, (ast.With, ast.For)):
            parts = [stmt.body]
        else:
            yield stmt
            continue
        for part in parts:
            yield from statements(part, blocks)


def absolute_module(module: str | None, level: int, package: list[str]) -> str | None:
    """The module ``from <level dots><module> import ...`` names in ``package``
    (None when it climbs above the top)."""
    if not level:
        return module
    keep = len(package) - (level - 1)
    if keep <= 0:
        return None
    return ".".join(package[:keep] + (module.split(".") if module else []))


def package_of(path: str) -> list[str]:
    """Package parts of a tree .py path (the package a relative import starts at)."""
    return list(PurePosixPath(path).parent.parts)


def module_candidates(module: str) -> list[str]:
    base = module.replace(".", "/")
    return [f"{base}.py", f"{base}/__init__.py"]


@dataclass
class TopLevelNames:
    """Each name -> the first line defining it, and whether the module can define
    names no reader can see (``from x import *``, a module ``__getattr__``)."""

    lines: dict[str, int] = field(default_factory=dict)
    dynamic: bool = False


def top_level_names(tree: ast.Module) -> TopLevelNames:
    out = TopLevelNames()

    def add(name: str, line: int) -> None:
        out.lines.setdefault(name, line)

    def targets(node: ast.AST, line: int) -> None:
        if isinstance(node, ast.Name):
            add(node.id, line)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                targets(elt, line)
        elif isinstance(node, ast.Starred):
            targets(node.value, line)

    for stmt in statements(tree.body, blocks=True):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(stmt.name, stmt.lineno)
            if stmt.name == "__getattr__":
                out.dynamic = True
        elif isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                targets(t, stmt.lineno)
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            targets(stmt.target, stmt.lineno)
        elif isinstance(stmt, ast.Import):
            for a in stmt.names:
                add(a.asname or a.name.split(".")[0], stmt.lineno)
        elif isinstance(stmt, ast.ImportFrom):
            for a in stmt.names:
                if a.name == "*":
                    out.dynamic = True
                else:
                    add(a.asname or a.name, stmt.lineno)
    return out
