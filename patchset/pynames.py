"""Names a Python module defines at its top level, read from its ``ast``.

Shared by ``compat`` (does a name the overlay imports still exist upstream?)
and ``mergecheck`` (does a name a patch uses still exist after a rebase step?),
so both agree on what "defined" means: ``def``/``class``, assignments
(plain, annotated, augmented; unpacked targets too) and imports, also inside
top-level ``if``/``try``/``with``/``for`` blocks. Nothing is imported or run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field


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

    def walk(body: list[ast.stmt]) -> None:
        for stmt in body:
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
            elif isinstance(stmt, ast.If):
                walk(stmt.body)
                walk(stmt.orelse)
            elif isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                walk(stmt.body)
                for h in stmt.handlers:
                    walk(h.body)
                walk(stmt.orelse)
                walk(stmt.finalbody)
            elif isinstance(stmt, (ast.With, ast.For)):
                walk(stmt.body)

    walk(tree.body)
    return out
