"""Our subclasses of upstream classes against a release: do their overrides still land?

The overlay derives classes from upstream's and overrides their methods, each override
marked ``@typing_extensions.override``. When upstream renames a method or changes its
signature nothing fails at import: the override is simply never called again, or called
with other arguments. basedpyright (pinned in requirements/tools.txt) reads the overlay
placed among a release's ``.py`` files in a temporary directory (nothing is imported or
run; the release's dependencies are not needed); its findings in the overlay files that
subclass upstream classes become the kinds ``_kind`` names (docs/patches.md lists them).

Two checks a type checker does not make stay here, read from the ``ast``: a new required
parameter of the direct upstream base's ``__init__`` (vLLM constructs our classes with
its arguments; override rules exempt ``__init__``), and a ``self.X`` ours sets that the
pinned release's base used and the release checked no longer does (ours would set a
name nothing reads). Without basedpyright the check does not pass.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .pynames import absolute_module, module_candidates, package_of, statements

Read = Callable[[str], "str | None"]

ERROR = "error"
WARNING = "warning"
DEADLINE_S = 300  # basedpyright on one release takes about 4 s here
RULES = (
    "reportGeneralTypeIssues",
    "reportIncompatibleMethodOverride",
    "reportIncompatibleVariableOverride",
    "reportImplicitOverride",
    "reportAttributeAccessIssue",
    "reportCallIssue",
    "reportImplicitAbstractClass",
    "reportAbstractUsage",
    "reportMissingImports",
)
_OVERRIDE_MISSING = re.compile(r'Method "(\w+)" is marked as override, but no base')
_QUOTED = re.compile(r'"([\w.]+)"')


@dataclass(frozen=True)
class OverlaySource:
    """One overlay .py file: where a reader finds it, where it is placed, its text."""

    path: str  # shown in problems: the repo file, e.g. connector/connector.py
    dst: str  # tree path, e.g. vllm/distributed/.../mooncake/ext/connector.py
    text: str


@dataclass(frozen=True)
class Problem:
    kind: str  # override-missing | signature | super-call | shadowed | ...
    severity: str  # error | warning
    file: str  # overlay file (repo path)
    line: int
    cls: str | None  # our class
    method: str | None  # our method
    message: str
    name: str | None = None  # the upstream name it concerns

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def subject(self) -> str:
        return ".".join(x for x in (self.cls, self.method) if x)

    def describe(self) -> str:
        subject = f"{self.subject}: " if self.subject else ""
        return f"{self.where}: {subject}{self.message}"

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "where": self.where}


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    classes: list[dict] = field(default_factory=list)  # what was checked, per subclass

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    def summary(self) -> str:
        overrides = sum(len(c["overrides"]) for c in self.classes)
        return (
            f"{len(self.classes)} subclasses of upstream classes and {overrides} "
            "overrides checked"
        )

    def to_json(self) -> dict:
        return {
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "problems": [p.to_json() for p in self.problems],
            "classes": self.classes,
        }


# -- the overlay's upstream subclasses, from the ast ------------------------------------


@dataclass
class _Subclass:
    src: OverlaySource
    node: ast.ClassDef
    bases: list[str]  # qualified upstream bases


def _imports(src: OverlaySource, tree: ast.Module) -> dict[str, str]:
    """Local name -> the qualified name it imports."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                out[local] = a.name if a.asname else local
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(node.module, node.level, package_of(src.dst))
            for a in node.names:
                if module:
                    out[a.asname or a.name] = f"{module}.{a.name}"
    return out


def _qualify(expr: ast.expr, imports: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.insert(0, expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in imports:
        return None
    return ".".join([imports[expr.id], *parts])


def upstream_subclasses(
    sources: Iterable[OverlaySource], top: str, roots: Iterable[str]
) -> list[_Subclass]:
    """The overlay's classes with a base imported from ``top`` outside ``roots``."""
    own = tuple(roots)
    out = []
    for src in sources:
        try:
            tree = ast.parse(src.text)
        except SyntaxError:
            continue
        imports = _imports(src, tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            quals = [q for q in (_qualify(b, imports) for b in node.bases) if q]
            ups = [
                q
                for q in quals
                if q.startswith(top + ".")
                and not any(q == o or q.startswith(o + ".") for o in own)
            ]
            if ups:
                out.append(_Subclass(src, node, ups))
    return out


def _enclosing(tree: ast.AST, line: int) -> tuple[str | None, str | None]:
    """(class, method) around ``line`` (1-based)."""
    cls = method = None
    for node in ast.walk(tree):
        end = getattr(node, "end_lineno", None) or 0
        if not getattr(node, "lineno", 0) <= line <= end:
            continue
        if isinstance(node, ast.ClassDef):
            cls = node.name
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            method = node.name
    return cls, method


def _is_override(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "override")
        or (isinstance(d, ast.Attribute) and d.attr == "override")
        for d in fn.decorator_list
    )


# -- basedpyright -------------------------------------------------------------------------


def run_basedpyright(root: Path, include: list[str]) -> list[dict]:
    """basedpyright's diagnostics for ``include`` (paths under ``root``), the rules of
    ``RULES`` only. Raises OSError when it cannot run."""
    config = {
        "include": include,
        "typeCheckingMode": "off",
        "enableTypeIgnoreComments": True,
        **{rule: "error" for rule in RULES},
    }
    (root / "pyrightconfig.json").write_text(json.dumps(config))
    # The interpreter the virtualenv was made from: the standard library without the
    # virtualenv's packages (torch would triple the time and the memory).
    python = getattr(sys, "_base_executable", None) or sys.executable
    cmd = [sys.executable, "-m", "basedpyright", "--outputjson", "-p", "."]
    try:
        proc = subprocess.run(
            [*cmd, "--pythonpath", python],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"basedpyright ran over {DEADLINE_S} s") from exc
    try:
        return json.loads(proc.stdout)["generalDiagnostics"]
    except (ValueError, KeyError) as exc:
        why = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise OSError(f"basedpyright exited {proc.returncode}: {why[0]}") from exc


def _lines(message: str) -> list[str]:
    """A diagnostic's headline and its reasons (nested detail left out)."""
    lines = message.replace("\xa0", " ").splitlines()
    return [lines[0], *(r.strip() for r in lines[1:] if not r.startswith("   "))]


def _kind(diag: dict, line_text: str, top: str) -> tuple[str, str] | None:
    """(kind, severity) of one diagnostic, None for one this check does not report.
    ``line_text``: the overlay's line it starts on."""
    rule, message = diag.get("rule"), diag["message"]
    if rule is None:
        return "parse", ERROR
    if rule == "reportGeneralTypeIssues" and _OVERRIDE_MISSING.match(message):
        return "override-missing", ERROR
    if rule in (
        "reportIncompatibleMethodOverride",
        "reportIncompatibleVariableOverride",
    ):
        reasons = _lines(message)[1:]
        # Only the return type differs: upstream's callers still reach ours with the
        # arguments it takes (ours may return more, e.g. None for "not yet").
        # A method turned async changes the return type to a coroutine: an error.
        only_return = reasons and all(
            r.startswith("Return type mismatch") for r in reasons
        )
        if only_return and "Coroutine" not in message:
            return "signature", WARNING
        return "signature", ERROR
    if rule == "reportCallIssue":
        upstream_call = "super()" in line_text or re.search(
            r"\.\w+\(\s*self\b", line_text
        )
        return ("super-call" if upstream_call else "call"), ERROR
    if rule == "reportAttributeAccessIssue":
        if "unknown import symbol" in message:
            return "base-missing", ERROR
        return (
            "super-missing"
            if line_text[: diag["range"]["start"]["character"]].endswith("super().")
            else "attribute-missing"
        ), ERROR
    if rule == "reportMissingImports":
        names = _QUOTED.findall(message)
        if names and (names[0] == top or names[0].startswith(top + ".")):
            return "base-missing", ERROR
        return None  # a dependency of the release, not installed for this check
    if rule == "reportImplicitOverride":
        return "shadowed", WARNING
    if rule in ("reportImplicitAbstractClass", "reportAbstractUsage"):
        return "abstract", ERROR
    return "type", ERROR


_ADVICE = {
    "override-missing": "our override is never called: find what replaced it upstream "
    "(renamed, moved, inlined) and port it; if the method is ours, drop `@override`",
    "signature": "make ours take what upstream's callers pass (and pass it on to super())",
    "super-call": "pass what upstream's method now takes",
    "super-missing": "find what replaced it upstream and call that",
    "attribute-missing": "find what upstream renamed or moved it to and port the code",
    "base-missing": "find where upstream moved it and update the import",
    "shadowed": "ours silently replaces upstream's: rename ours, or mark it `@override` "
    "(and call super() where upstream's behaviour is still wanted)",
    "abstract": "our class cannot be instantiated there; implement it (`@override`)",
}


# -- the check ----------------------------------------------------------------------------


def check_overrides(
    sources: Iterable[OverlaySource],
    files: Mapping[str, str | None],
    *,
    read_pinned: Read | None = None,
    top: str = "vllm",
    roots: Iterable[str] = (),
    label: str = "upstream",
    pinned_label: str | None = None,
) -> Report:
    """Every overlay subclass of an upstream class, against the release whose ``.py``
    files under ``top`` are ``files`` (tree path -> text; None: deleted).

    ``read_pinned`` reads the release the overlay was written against (the pin, with
    its series): what an attribute ours sets was for. ``roots``: the overlay's placed
    packages, dotted (``vllm.distributed....mooncake.ext``).
    """
    sources = [s for s in sources if s.dst.endswith(".py")]
    roots = tuple(roots)
    subclasses = upstream_subclasses(sources, top, roots)
    report = Report()
    for sub in subclasses:
        report.classes.append(
            {
                "class": sub.node.name,
                "file": sub.src.path,
                "line": sub.node.lineno,
                "upstream_bases": sub.bases,
                "overrides": [
                    fn.name
                    for fn in statements(sub.node.body)
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and _is_override(fn)
                ],
            }
        )
    checked = {sub.src.dst: sub.src for sub in subclasses}
    for src in sources:
        try:
            ast.parse(src.text)
        except SyntaxError as exc:
            message = (
                f"does not parse ({exc.msg}): its classes cannot be checked; fix it"
            )
            report.problems.append(
                Problem("parse", ERROR, src.path, exc.lineno or 0, None, None, message)
            )
    if not checked:
        return report
    try:
        diagnostics = _diagnostics(sources, files, sorted(checked))
    except OSError as exc:
        message = (
            f"basedpyright could not check the overrides ({exc}), so they are not "
            "passed; install requirements/tools.txt (scripts/setup.sh does)"
        )
        paths = ", ".join(s.path for s in checked.values())
        report.problems.append(
            Problem("unverifiable", ERROR, paths, 0, None, None, message)
        )
        return report
    # each checked file read once (upstream_subclasses parsed every one of them)
    read = {
        dst: (src.text.splitlines(), ast.parse(src.text))
        for dst, src in checked.items()
    }
    for dst, diag in diagnostics:
        src, (lines, tree) = checked[dst], read[dst]
        line = diag["range"]["start"]["line"] + 1
        kind = _kind(diag, lines[line - 1] if line <= len(lines) else "", top)
        if kind is None:
            continue
        cls, method = _enclosing(tree, line)
        message = "; ".join(_lines(diag["message"]))
        name = _OVERRIDE_MISSING.match(diag["message"])
        advice = _ADVICE.get(kind[0])
        if kind == ("signature", WARNING):
            advice = "only what ours returns differs; upstream's callers must handle it"
        report.problems.append(
            Problem(
                kind[0],
                kind[1],
                src.path,
                line,
                cls,
                method,
                f"{message} (in {label})" + (f": {advice}" if advice else ""),
                name.group(1) if name else None,
            )
        )
    for sub in subclasses:
        report.problems += _init_problems(sub, files.get, label)
        if read_pinned is not None:
            report.problems += _attributes_gone(
                sub, files.get, read_pinned, label, pinned_label or "the pin"
            )
    report.problems.sort(key=lambda p: (p.file, p.line, p.kind))
    return report


def _diagnostics(
    sources: list[OverlaySource], files: Mapping[str, str | None], include: list[str]
) -> list[tuple[str, dict]]:
    """(overlay tree path, diagnostic) for ``include``, the overlay placed in ``files``."""
    with tempfile.TemporaryDirectory(prefix="vmp-overrides-") as tmp:
        root = Path(tmp)
        placed = {**files, **{s.dst: s.text for s in sources}}
        for path, text in placed.items():
            if text is None or not path.endswith(".py"):
                continue
            dest = root / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        out = []
        for diag in run_basedpyright(root, include):
            path = Path(diag["file"]).resolve().relative_to(root.resolve()).as_posix()
            if path in include:
                out.append((path, diag))
        return out


def _find_class(qualified: str, read: Read, depth: int = 4) -> ast.ClassDef | None:
    """The upstream class ``qualified`` names, following re-exports ``depth`` deep."""
    module, _, name = qualified.rpartition(".")
    for path in module_candidates(module):
        text = read(path)
        if text is None:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return None
        for stmt in statements(tree.body):
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return stmt
            if isinstance(stmt, ast.ImportFrom) and depth:
                for a in stmt.names:
                    if (a.asname or a.name) == name:
                        origin = absolute_module(
                            stmt.module, stmt.level, package_of(path)
                        )
                        if origin:
                            return _find_class(f"{origin}.{a.name}", read, depth - 1)
        return None
    return None


def _method(
    cls: ast.ClassDef, name: str
) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for fn in statements(cls.body):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == name:
            return fn
    return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], set[str]]:
    """(every parameter name but the first, the required ones)."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args][1:]
    required = (
        positional[: len(positional) - len(a.defaults)] if a.defaults else positional
    )
    kwonly_required = [p for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    names = {p.arg for p in [*positional, *a.kwonlyargs]}
    return names, {p.arg for p in [*required, *kwonly_required]}


def _init_problems(sub: _Subclass, read: Read, label: str) -> list[Problem]:
    ours = _method(sub.node, "__init__")
    base = _find_class(sub.bases[0], read)
    theirs = _method(base, "__init__") if base is not None else None
    if ours is None or theirs is None or ours.args.kwarg is not None:
        return []
    (our_names, our_required), (their_names, their_required) = map(
        _params, (ours, theirs)
    )
    what = [
        f"{label}'s requires {p}, which ours does not take"
        for p in sorted(their_required - our_names)
    ]
    what += [
        f"ours requires {p}, which {label}'s does not take"
        for p in sorted(our_required - their_names)
    ]
    if not what:
        return []
    message = (
        f"__init__ vs {sub.bases[0].rpartition('.')[2]}.__init__: {'; '.join(what)}. vLLM "
        f"constructs ours with its base's arguments: {_ADVICE['signature']}"
    )
    return [
        Problem(
            "signature",
            ERROR,
            sub.src.path,
            ours.lineno,
            sub.node.name,
            "__init__",
            message,
        )
    ]


def _attribute_names(cls: ast.ClassDef | None) -> set[str]:
    if cls is None:
        return set()
    names = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)}
    return names | {
        n.name
        for n in statements(cls.body)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _attributes_gone(
    sub: _Subclass, read: Read, read_pinned: Read, label: str, pinned_label: str
) -> list[Problem]:
    gone: set[str] = set()
    for base in sub.bases:
        before = _find_class(base, read_pinned)
        if before is not None:
            gone |= _attribute_names(before) - _attribute_names(_find_class(base, read))
    out, seen = [], set()
    for node in ast.walk(sub.node):
        if not (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr in gone
            and node.attr not in seen
        ):
            continue
        seen.add(node.attr)
        _, method = _enclosing(sub.node, node.lineno)
        out.append(
            Problem(
                "attribute-missing",
                ERROR,
                sub.src.path,
                node.lineno,
                sub.node.name,
                method,
                f"sets self.{node.attr}, which {pinned_label}'s {', '.join(sub.bases)} "
                f"used and {label}'s does not: ours would set a name nothing reads "
                f"there. {_ADVICE['attribute-missing'].capitalize()}",
                node.attr,
            )
        )
    return out
