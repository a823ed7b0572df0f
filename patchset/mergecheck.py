"""What a clean 3-way merge can still break in a Python file.

``git rebase`` replays a patch onto a newer upstream line by line: when the
patch's hunks and upstream's changes do not touch the same lines, the merge is
"clean" even when the result is wrong. Two cases are common when rolling a
series over vLLM, and both are silent until the code runs:

- **duplicate**: the patch adds a method (``has_requests``) that upstream now
  also has, elsewhere in the same class. The class body defines it twice and
  the later definition silently replaces the earlier one. Only duplicates the
  step introduced count: one that upstream's file (the step's parent) or the
  original patched file already had is left alone (a property's setter, an
  ``@overload``, a conditional definition).
- **removed name**: a line the patch adds uses ``self.block_len`` (or a
  module-level name), which the file defined before the roll, and upstream
  removed or renamed it. Only names the file defined at the old base (the file
  the original patch applied to: ``self.X = ...``, a class body's names, or a
  top-level name as ``pynames`` reads it) and that nothing in the file defines (or,
  for a bare name, binds anywhere) after the step are reported; names the
  file never defined (inherited, or from elsewhere) are never guessed at.

A file that no longer parses after the step (where its parent did) is
reported too.

Policy only: texts in, findings out; no git. ``rebase`` feeds it the files
each step touched.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass

from .pynames import is_self, top_level_names

DUPLICATE = "duplicate"
REMOVED_ATTRIBUTE = "removed-attribute"
REMOVED_NAME = "removed-name"
SYNTAX = "syntax"

_ACCESSORS = ("setter", "getter", "deleter")
_DYNAMIC_ATTRIBUTES = ("__getattr__", "__getattribute__")


@dataclass(frozen=True)
class Finding:
    """One problem in one file after a step: where, and what to do."""

    kind: str  # duplicate | removed-attribute | removed-name | syntax
    path: str
    line: int
    message: str

    def describe(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def check_step(
    path: str,
    new: str,
    *,
    new_base: str | None,
    old: str | None,
    old_base: str | None,
    added: set[int],
    old_label: str = "the old base",
) -> list[Finding]:
    """Findings for one .py file a rebase step touched.

    ``new`` is the file after the step and ``new_base`` before it (upstream's
    file with the earlier steps); ``old`` is the file after the original patch
    and ``old_base`` before it (the pinned release with the earlier patches).
    ``added`` holds the line numbers of ``new`` that the step adds.
    """
    try:
        tree = ast.parse(new, filename=path)
    except (SyntaxError, ValueError) as exc:
        if new_base is not None and _parse(new_base) is None:
            return []  # upstream's own file does not parse (another Python)
        why = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        return [
            Finding(
                SYNTAX,
                path,
                getattr(exc, "lineno", None) or 1,
                f"the file no longer parses after this step ({why}); "
                "fix it (conflict markers left in?)",
            )
        ]
    findings = _duplicates(path, tree, new_base, old, added)
    base = _parse(old_base) if old_base is not None else None
    if base is not None:
        findings += _removed_names(path, tree, base, added, old_label)
    return sorted(findings, key=lambda f: (f.line, f.kind))


# -- duplicates ---------------------------------------------------------------


def class_duplicates(tree: ast.Module) -> dict[tuple[str, str], list[int]]:
    """(class, name) -> the lines of each definition, for names a class body defines twice.

    Counted: ``def``/``async def``/``class`` and plain assignments directly in a
    class body. Not counted: property accessors (``@x.setter``) and
    ``@overload`` stubs, which repeat a name on purpose.
    """
    found: dict[tuple[str, str], list[int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                qualname = f"{prefix}{child.name}"
                seen: dict[str, list[int]] = {}
                for stmt in child.body:
                    for name in _defined_in_body(stmt):
                        seen.setdefault(name, []).append(stmt.lineno)
                for name, lines in seen.items():
                    if len(lines) > 1:
                        found[(qualname, name)] = lines
                visit(child, qualname + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _defined_in_body(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return (
            []
            if any(_repeats_on_purpose(d) for d in stmt.decorator_list)
            else [stmt.name]
        )
    if isinstance(stmt, ast.ClassDef):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        return [stmt.target.id] if isinstance(stmt.target, ast.Name) else []
    return []


def _repeats_on_purpose(decorator: ast.expr) -> bool:
    if isinstance(decorator, ast.Call):
        decorator = decorator.func
    if isinstance(decorator, ast.Attribute):
        return decorator.attr in _ACCESSORS or decorator.attr == "overload"
    return isinstance(decorator, ast.Name) and decorator.id == "overload"


def _duplicates(
    path: str, tree: ast.Module, new_base: str | None, old: str | None, added: set[int]
) -> list[Finding]:
    known: set[tuple[str, str]] = set()
    for text in (new_base, old):
        parsed = _parse(text) if text is not None else None
        if parsed is not None:
            known |= set(class_duplicates(parsed))
    findings = []
    for (cls, name), lines in class_duplicates(tree).items():
        if (cls, name) in known:
            continue
        ours = [line for line in lines if line in added]
        shown = ", ".join(map(str, lines[:-1])) + f" and {lines[-1]}"
        whose = f"; the patch adds line {', '.join(map(str, ours))}" if ours else ""
        findings.append(
            Finding(
                DUPLICATE,
                path,
                (ours or lines)[-1],
                f"class {cls} defines {name} twice (lines {shown}{whose}): the later "
                "definition silently replaces the earlier one. Keep one: drop the "
                "patch's if upstream's now does the job, or merge the two",
            )
        )
    return findings


# -- names the patch uses that the file no longer defines ---------------------


def attribute_definitions(tree: ast.Module) -> dict[str, int]:
    """Attributes the file gives its objects -> the first line defining each.

    ``self.X = ...`` (also augmented, annotated, unpacked, ``for``/``with``
    targets), ``setattr(self, "X", ...)``, and every name a class body defines
    (methods, nested classes, class attributes, annotated fields).
    """
    out: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        out.setdefault(name, line)

    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and is_self(node.value)
        ):
            add(node.attr, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and is_self(node.args[0])
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            add(node.args[1].value, node.lineno)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                for name in _class_body_names(stmt):
                    add(name, stmt.lineno)
    return out


def _class_body_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [
            n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)
        ]
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and isinstance(
        stmt.target, ast.Name
    ):
        return [stmt.target.id]
    return []


def bound_names(tree: ast.Module) -> set[str]:
    """Every name the file binds anywhere: any scope, any kind of binding."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
    return names


def _removed_names(
    path: str, tree: ast.Module, base: ast.Module, added: set[int], old_label: str
) -> list[Finding]:
    used_attrs: dict[str, int] = {}
    used_names: dict[str, int] = {}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", None)
        if line not in added:
            continue
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and is_self(node.value)
        ):
            used_attrs.setdefault(node.attr, line)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            used_names.setdefault(node.id, line)
    findings = []
    if used_attrs and not _dynamic_attributes(tree):
        before, after = attribute_definitions(base), attribute_definitions(tree)
        for attr, line in used_attrs.items():
            if attr in before and attr not in after:
                findings.append(
                    Finding(
                        REMOVED_ATTRIBUTE,
                        path,
                        line,
                        f"a line the patch adds uses self.{attr}, which the file no "
                        f"longer defines (line {before[attr]} defined it on {old_label}): "
                        "upstream removed or renamed it; use what replaced it",
                    )
                )
    if used_names and not _star_import(tree):
        before_names, after_names = top_level_names(base).lines, bound_names(tree)
        for name, line in used_names.items():
            if (
                name in before_names
                and name not in after_names
                and not hasattr(builtins, name)
            ):
                findings.append(
                    Finding(
                        REMOVED_NAME,
                        path,
                        line,
                        f"a line the patch adds uses {name}, which the file no longer "
                        f"defines or imports (line {before_names[name]} did on {old_label}): "
                        "upstream removed, renamed or moved it; use what replaced it",
                    )
                )
    return findings


def _dynamic_attributes(tree: ast.Module) -> bool:
    """Whether some class of the file resolves attributes at run time."""
    return any(
        isinstance(node, ast.ClassDef)
        and any(
            name in _DYNAMIC_ATTRIBUTES
            for stmt in node.body
            for name in _class_body_names(stmt)
        )
        for node in ast.walk(tree)
    )


def _star_import(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
        for node in ast.walk(tree)
    )


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None
