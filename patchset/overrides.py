"""Our subclasses of upstream classes: do their overrides and ``super()`` calls still land?

The overlay derives classes from upstream's (``class ExtMooncakeConnectorWorker(
MooncakeConnectorWorker)``), overrides whole methods and calls ``super()``. When upstream
renames a method or changes its signature nothing fails at import: the override is simply
never called again, or called with other arguments. This module finds, with ``ast`` only
(nothing is imported or run), for every overlay class whose bases resolve to an upstream
class (through ``from vllm... import X``, ``import vllm....``, or relative imports that
climb out of the overlay), against the upstream base's MRO (followed across upstream
modules, best effort):

- ``override-missing`` (error): a method of ours that overrides an upstream method in the
  pinned release (or is marked ``# vmp: override``) has no upstream counterpart any more;
- ``super-missing`` (error): ``super().name`` (or ``UpstreamBase.name(self, ...)``) names
  nothing upstream;
- ``signature`` (error; a warning for an optional parameter we lack): our override and
  upstream's method disagree on a positional parameter's name, a parameter one side requires
  and the other does not pass, sync/async or method/property;
- ``super-call`` (error): a ``super()`` call's arguments no longer fit upstream's signature;
- ``shadowed`` (warning): a method that is ours (marked ``# vmp: new``, or not an upstream
  method in the pinned release) is now also defined upstream: ours silently replaces it;
- ``base-missing`` (error): an upstream base class is gone;
- ``pragma``, ``parse`` (error), ``unverifiable`` (warning): a misspelt marker, an overlay
  file that does not parse, an upstream file that does not.

Markers are comments on the ``def`` line, its decorators, or the line just above::

    def has_requests(self) -> bool:  # vmp: new       (ours; must not exist upstream)
    def get_finished(self):  # vmp: override          (must exist upstream, even at the pin)

Upstream sources come from ``read(path) -> text | None`` (tree paths, ``vllm/a/b.py``); the
caller decides what upstream is (the pinned sdist with the series applied, a newer release).
Policy and logic only: no tarball, no git, no network.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import io
import re
import tokenize
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from .pynames import absolute_module, is_self, module_candidates, package_of, statements

Read = Callable[[str], "str | None"]

ERROR = "error"
WARNING = "warning"
PRAGMA = re.compile(r"#\s*vmp:\s*([A-Za-z_-]+)")
PRAGMAS = ("new", "override")
# Bases that add no method an override could target.
TRIVIAL_BASES = frozenset(
    {
        "builtins.object",
        "abc.ABC",
        "typing.Generic",
        "typing.Protocol",
        "typing_extensions.Protocol",
    }
)
MAX_DEPTH = 8  # re-exports followed when resolving a name
PROPERTY_DECORATORS = ("property", "cached_property")


# -- inputs and outputs --------------------------------------------------------------


@dataclass(frozen=True)
class OverlaySource:
    """One overlay .py file: where a reader finds it, where it is placed, its text."""

    path: str  # shown in problems: the repo file, e.g. connector/connector.py
    dst: str  # tree path, e.g. vllm/distributed/.../mooncake/ext/connector.py
    text: str

    @property
    def module(self) -> str:
        parts = list(PurePosixPath(self.dst).with_suffix("").parts)
        if parts and parts[-1] == "__init__":
            parts.pop()
        return ".".join(parts)

    @property
    def package(self) -> list[str]:
        """The package a relative import in this file starts from."""
        return package_of(self.dst)


@dataclass(frozen=True)
class Problem:
    kind: str  # override-missing | super-missing | signature | super-call | shadowed | ...
    severity: str  # error | warning
    file: str  # overlay file (repo path)
    line: int
    cls: str | None  # our class
    method: str | None  # our method
    message: str  # names both signatures and what to do
    upstream: str | None = None  # the upstream file it concerns, in the release checked
    upstream_line: int | None = None
    # the upstream name it concerns (a method, a super() call's)
    name: str | None = None
    ours: str | None = None  # our signature (or call)
    theirs: str | None = None  # upstream's signature

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
        calls = sum(c["super_calls"] for c in self.classes)
        return (
            f"{len(self.classes)} subclasses of upstream classes, {overrides} overrides "
            f"and {calls} super() calls checked"
        )

    def to_json(self) -> dict:
        return {
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "problems": [p.to_json() for p in self.problems],
            "classes": self.classes,
        }


# -- signatures ----------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    default: str | None  # source text of the default; None when required

    @property
    def required(self) -> bool:
        return self.default is None

    def render(self) -> str:
        if self.default is None:
            return self.name
        default = self.default if len(self.default) <= 24 else "..."
        return f"{self.name}={default}"


@dataclass(frozen=True)
class Signature:
    name: str
    kind: str  # method | staticmethod | classmethod | property | attribute
    positional: tuple[Param, ...] = ()  # positional-only + positional-or-keyword
    posonly: int = 0
    vararg: str | None = None
    kwonly: tuple[Param, ...] = ()
    kwarg: str | None = None
    is_async: bool = False

    @property
    def bound(self) -> bool:
        """Whether the first positional parameter is bound (self, cls)."""
        return self.kind in ("method", "classmethod", "property")

    @property
    def names(self) -> set[str]:
        return {p.name for p in self.positional} | {p.name for p in self.kwonly}

    def render(self) -> str:
        if self.kind == "attribute":
            return f"{self.name} (a class attribute)"
        parts = [p.render() for p in self.positional]
        if self.posonly:
            parts.insert(self.posonly, "/")
        if self.vararg:
            parts.append(f"*{self.vararg}")
        elif self.kwonly:
            parts.append("*")
        parts += [p.render() for p in self.kwonly]
        if self.kwarg:
            parts.append(f"**{self.kwarg}")
        prefix = {"staticmethod": "@staticmethod ", "classmethod": "@classmethod "}.get(
            self.kind, "@property " if self.kind == "property" else ""
        )
        return f"{prefix}{'async ' if self.is_async else ''}def {self.name}({', '.join(parts)})"


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return None


def signature_of(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Signature:
    kind = "method"
    for dec in fn.decorator_list:
        name = _dotted(dec) or ""
        last = name.rsplit(".", 1)[-1]
        if last in ("staticmethod", "classmethod"):
            kind = last
        elif last in PROPERTY_DECORATORS or last in ("setter", "getter", "deleter"):
            kind = "property"
    args = fn.args
    pos = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(pos) - len(args.defaults))
    defaults += list(args.defaults)
    return Signature(
        name=fn.name,
        kind=kind,
        positional=tuple(
            Param(a.arg, None if d is None else ast.unparse(d))
            for a, d in zip(pos, defaults)
        ),
        posonly=len(args.posonlyargs),
        vararg=args.vararg.arg if args.vararg else None,
        kwonly=tuple(
            Param(a.arg, None if d is None else ast.unparse(d))
            for a, d in zip(args.kwonlyargs, args.kw_defaults)
        ),
        kwarg=args.kwarg.arg if args.kwarg else None,
        is_async=isinstance(fn, ast.AsyncFunctionDef),
    )


def compare(ours: Signature, theirs: Signature) -> list[tuple[str, str]]:
    """How our override disagrees with upstream's method: (severity, what) pairs."""
    if theirs.kind == "attribute":
        return []
    if ours.kind != theirs.kind:
        return [(ERROR, f"upstream's is a {theirs.kind}, ours a {ours.kind}")]
    if ours.kind == "property":
        return []
    out: list[tuple[str, str]] = []
    if ours.is_async != theirs.is_async:
        which = "upstream's" if theirs.is_async else "ours"
        out.append((ERROR, f"only {which} is async"))
    start = 1 if ours.bound else 0  # self / cls: its name does not matter
    op, tp = ours.positional, theirs.positional
    for i in range(start, min(len(op), len(tp))):
        if op[i].name != tp[i].name:
            out.append(
                (ERROR, f"ours has `{op[i].name}` where upstream's has `{tp[i].name}`")
            )
    their_kwonly = {k.name for k in theirs.kwonly}
    for p in op[len(tp) :]:
        if p.required and not theirs.vararg and p.name not in their_kwonly:
            out.append(
                (
                    ERROR,
                    f"ours requires `{p.name}`, which upstream's callers do not pass",
                )
            )
    # upstream's parameters ours lacks (a *args or **kwargs of ours takes them)
    lacking = [p for p in tp[len(op) :] if not (ours.vararg or ours.kwarg)]
    lacking += [p for p in theirs.kwonly if not ours.kwarg]
    for p in lacking:
        if p.name in ours.names:
            continue
        if p.required:
            out.append(
                (ERROR, f"upstream's has the required `{p.name}`, which ours lacks")
            )
        else:
            what = f"upstream's has the optional `{p.name}`, which ours lacks"
            out.append((WARNING, f"{what}: a caller passing it fails"))
    for p in ours.kwonly:
        if p.required and p.name not in theirs.names and not theirs.kwarg:
            what = f"ours requires the keyword `{p.name}`"
            out.append((ERROR, f"{what}, which upstream's callers do not pass"))
    return out


def check_call(call: ast.Call, sig: Signature, *, self_passed: bool) -> list[str]:
    """Why ``call`` no longer fits ``sig`` (empty when it does, or cannot be told)."""
    if sig.kind in ("property", "attribute"):
        return []
    params = list(sig.positional)
    if sig.kind == "classmethod" or (sig.kind == "method" and not self_passed):
        params = params[1:]  # bound by super() / the class
    star = any(isinstance(a, ast.Starred) for a in call.args)
    dstar = any(k.arg is None for k in call.keywords)
    npos = sum(1 for a in call.args if not isinstance(a, ast.Starred))
    out = []
    if npos > len(params) and not sig.vararg:
        out.append(
            f"passes {npos} positional arguments, upstream's takes {len(params)}"
        )
    given = {k.arg for k in call.keywords if k.arg}
    keywords = {p.name for p in params[sig.posonly :]} | {p.name for p in sig.kwonly}
    for name in sorted(given):
        if name not in keywords and not sig.kwarg:
            out.append(f"passes `{name}=`, which upstream's does not take")
    if not dstar:
        missing = (
            []
            if star
            else [p.name for p in params[npos:] if p.required and p.name not in given]
        )
        missing += [p.name for p in sig.kwonly if p.required and p.name not in given]
        if missing:
            out.append(
                f"does not pass the required {', '.join(f'`{m}`' for m in missing)}"
            )
    return out


# -- modules and classes -------------------------------------------------------------


@dataclass
class _Module:
    name: str  # dotted
    path: str  # shown: repo path (overlay) or tree path (upstream)
    origin: str  # overlay | upstream
    package: list[str]
    imports: dict[str, str] = field(default_factory=dict)  # local name -> qualified
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    aliases: dict[str, ast.expr] = field(default_factory=dict)  # Name = <expr>


@dataclass(frozen=True)
class _Member:
    name: str
    line: int
    sig: Signature
    abstract: bool = False  # decorated @abstractmethod (abc)


@dataclass
class _Class:
    module: _Module
    node: ast.ClassDef

    @property
    def key(self) -> tuple[str, str]:
        return (self.module.name, self.node.name)

    @property
    def label(self) -> str:
        return f"{self.module.name}.{self.node.name}"

    @property
    def origin(self) -> str:
        return self.module.origin

    @functools.cached_property
    def members(self) -> dict[str, _Member]:
        return _members(self.node)


def _members(node: ast.ClassDef) -> dict[str, _Member]:
    out: dict[str, _Member] = {}
    for stmt in statements(node.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sig = signature_of(stmt)
            if stmt.name in out and out[stmt.name].sig.kind == "property":
                continue  # @x.setter after @property x
            out[stmt.name] = _Member(stmt.name, stmt.lineno, sig, _is_abstract(stmt))
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    out[t.id] = _Member(t.id, stmt.lineno, Signature(t.id, "attribute"))
    return out


def _is_abstract(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None))
        in ("abstractmethod", "abstractproperty")
        for d in fn.decorator_list
    )


def _parse_module(
    name: str, path: str, origin: str, package: list[str], text: str
) -> _Module:
    tree = ast.parse(text, filename=path)
    mod = _Module(name, path, origin, package)
    for stmt in statements(tree.body):
        if isinstance(stmt, ast.ClassDef):
            mod.classes[stmt.name] = stmt
        elif isinstance(stmt, ast.Import):
            for a in stmt.names:
                if a.asname:
                    mod.imports[a.asname] = a.name
                else:
                    head = a.name.split(".")[0]
                    mod.imports[head] = head
        elif isinstance(stmt, ast.ImportFrom):
            base = absolute_module(stmt.module, stmt.level, package)
            if base is None:
                continue
            for a in stmt.names:
                if a.name != "*":
                    mod.imports[a.asname or a.name] = f"{base}.{a.name}"
        elif (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        ):
            mod.aliases[stmt.targets[0].id] = stmt.value
    return mod


class _Index:
    """Modules (the overlay's, then upstream's through ``read``) and their classes."""

    def __init__(
        self,
        overlay: dict[str, OverlaySource],
        roots: tuple[str, ...],
        read: Read,
        top: str,
    ) -> None:
        self.overlay = overlay  # module -> source
        self.roots = roots
        self.read = read
        self.top = top
        self._modules: dict[str, _Module | None] = {}
        self.unparsable: dict[str, str] = {}  # upstream path -> error

    def ours(self, qualified: str) -> bool:
        return any(qualified == r or qualified.startswith(r + ".") for r in self.roots)

    def upstream(self, qualified: str) -> bool:
        return qualified.startswith(self.top + ".") and not self.ours(qualified)

    def module(self, name: str) -> _Module | None:
        if name in self._modules:
            return self._modules[name]
        mod = None
        src = self.overlay.get(name)
        if src is not None:
            try:
                mod = _parse_module(name, src.path, "overlay", src.package, src.text)
            except SyntaxError:
                mod = None  # reported by the scan of the overlay
        elif name == self.top or name.startswith(self.top + "."):
            for path in module_candidates(name):
                text = self.read(path)
                if text is None:
                    continue
                try:
                    mod = _parse_module(name, path, "upstream", package_of(path), text)
                except SyntaxError as exc:
                    self.unparsable[path] = str(exc)
                break
        self._modules[name] = mod
        return mod

    def qualify(self, mod: _Module, expr: ast.expr, depth: int = 0) -> str | None:
        """The qualified name a base expression or a ``X.attr`` receiver stands for."""
        if isinstance(expr, ast.Subscript):  # Generic[T], Base[Meta]
            return self.qualify(mod, expr.value, depth)
        if isinstance(expr, ast.Name):
            if expr.id in mod.classes:
                return f"{mod.name}.{expr.id}"
            if expr.id in mod.imports:
                return mod.imports[expr.id]
            if expr.id in mod.aliases and depth < MAX_DEPTH:
                return self.qualify(mod, mod.aliases[expr.id], depth + 1)
            if expr.id == "object":
                return "builtins.object"
            return None
        if isinstance(expr, ast.Attribute):
            head = self.qualify(mod, expr.value, depth)
            return f"{head}.{expr.attr}" if head else None
        return None

    def find_class(self, qualified: str, depth: int = 0) -> _Class | None:
        parts = qualified.split(".")
        for i in range(len(parts) - 1, 0, -1):
            mod = self.module(".".join(parts[:i]))
            if mod is None:
                continue
            return self._lookup(mod, parts[i:], depth)
        return None

    def _lookup(self, mod: _Module, rest: list[str], depth: int) -> _Class | None:
        name = rest[0]
        if name in mod.classes:
            node = mod.classes[name]
            for inner in rest[1:]:  # nested classes
                node = next(
                    (
                        s
                        for s in node.body
                        if isinstance(s, ast.ClassDef) and s.name == inner
                    ),
                    None,
                )
                if node is None:
                    return None
            return _Class(mod, node)
        if depth >= MAX_DEPTH:
            return None
        target = None
        if name in mod.imports:
            target = mod.imports[name]
        elif name in mod.aliases:
            target = self.qualify(mod, mod.aliases[name], depth + 1)
        if target is None:
            return None
        return self.find_class(".".join([target, *rest[1:]]), depth + 1)


@dataclass
class _Ancestry:
    # in lookup order (best-effort MRO), the class itself excluded
    classes: list[_Class]
    open: list[str]  # bases whose methods are unknown (outside the package, unresolved)
    missing: list[
        tuple[_Class, str]
    ]  # (class naming it, qualified): upstream bases gone

    def lookup(self, name: str) -> tuple[_Class, _Member] | None:
        for cls in self.classes:
            member = cls.members.get(name)
            if member is not None:
                return cls, member
        return None

    @property
    def upstream(self) -> list[_Class]:
        return [c for c in self.classes if c.origin == "upstream"]


def ancestry(index: _Index, cls: _Class) -> _Ancestry:
    """The classes ``cls`` inherits from, depth first, each kept at its last occurrence
    (what C3 gives for the usual diamonds)."""
    order: list[_Class] = []
    result = _Ancestry([], [], [])
    visiting: set[tuple[str, str]] = set()

    def visit(c: _Class) -> None:
        if c.key in visiting:
            return
        visiting.add(c.key)
        for base in c.node.bases:
            q = index.qualify(c.module, base)
            if q is None:
                result.open.append(ast.unparse(base))
                continue
            if q in TRIVIAL_BASES:
                continue
            found = index.find_class(q)
            if found is None:
                if index.upstream(q) and not _unverifiable(index, q):
                    result.missing.append((c, q))
                else:
                    result.open.append(q)
                continue
            order.append(found)
            visit(found)
        visiting.discard(c.key)

    visit(cls)
    seen: set[tuple[str, str]] = set()
    for c in reversed(order):
        if c.key not in seen:
            seen.add(c.key)
            result.classes.insert(0, c)
    return result


def _unverifiable(index: _Index, qualified: str) -> bool:
    parts = qualified.split(".")
    for i in range(len(parts) - 1, 0, -1):
        for path in module_candidates(".".join(parts[:i])):
            if path in index.unparsable:
                return True
    return False


# -- the overlay's subclasses ---------------------------------------------------------


@dataclass
class _SuperUse:
    method: str  # the method of ours it is in
    name: str  # the upstream name used
    line: int
    call: ast.Call | None
    explicit: _Class | None = None  # ``Base.name(self, ...)``: the class named


def _pragmas(text: str) -> dict[int, str]:
    """line -> marker of every ``# vmp: <marker>`` comment."""
    out: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                m = PRAGMA.search(tok.string)
                if m:
                    out[tok.start[0]] = m.group(1)
    except (tokenize.TokenError, SyntaxError):
        pass
    return out


def _marker(
    fn: ast.FunctionDef | ast.AsyncFunctionDef,
    pragmas: dict[int, str],
    lines: list[str],
) -> tuple[str, int] | None:
    """The marker of ``fn`` and its line: on its decorators or header, or just above."""
    first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    last = max(fn.lineno, fn.body[0].lineno - 1)  # a header split over several lines
    for line in range(first, last + 1):
        if line in pragmas:
            return pragmas[line], line
    above = first - 1
    if above in pragmas and lines[above - 1].lstrip().startswith("#"):
        return pragmas[above], above
    return None


def _super_uses(
    index: _Index, mod: _Module, fn: ast.AST, method: str
) -> list[_SuperUse]:
    uses: list[_SuperUse] = []
    as_func: set[int] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            as_func.add(id(node.func))
            recv = node.func.value
            if _is_super(recv):
                uses.append(_SuperUse(method, node.func.attr, node.lineno, node))
            elif (
                isinstance(recv, (ast.Name, ast.Attribute))
                and node.args
                and is_self(node.args[0])
            ):
                q = index.qualify(mod, recv)
                target = index.find_class(q) if q and index.upstream(q) else None
                if target is not None:
                    uses.append(
                        _SuperUse(method, node.func.attr, node.lineno, node, target)
                    )
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Attribute)
            and id(node) not in as_func
            and _is_super(node.value)
        ):
            uses.append(_SuperUse(method, node.attr, node.lineno, None))
    return sorted(uses, key=lambda u: u.line)


def _is_super(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "super"
    )


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def wanted_paths(sources: Iterable[OverlaySource], top: str = "vllm") -> set[str]:
    """Upstream files the overlay imports from directly: read these first."""
    out: set[str] = set()
    for src in sources:
        if not src.dst.endswith(".py"):
            continue
        try:
            mod = _parse_module(src.module, src.path, "overlay", src.package, src.text)
        except SyntaxError:
            continue
        for qualified in mod.imports.values():
            parts = qualified.split(".")
            if parts[0] != top:
                continue
            for i in range(1, len(parts) + 1):
                out.update(module_candidates(".".join(parts[:i])))
    return out


def fingerprint(sources: Iterable[OverlaySource], top: str = "vllm") -> list[list[str]]:
    """The overlay files whose classes derive from something under ``top``, with their text:
    what this check's result depends on besides upstream (for result caches)."""
    out = []
    for src in sorted(sources, key=lambda s: s.dst):
        if not src.dst.endswith(".py"):
            continue
        try:
            mod = _parse_module(src.module, src.path, "overlay", src.package, src.text)
        except SyntaxError:
            out.append([src.dst, "unparsable"])
            continue
        index = _Index({}, (), lambda _p: None, top)
        for node in mod.classes.values():
            quals = [index.qualify(mod, b) for b in node.bases]
            if any(q and q.startswith(top + ".") for q in quals):
                out.append([src.dst, hashlib.sha256(src.text.encode()).hexdigest()])
                break
    return out


# -- the check -------------------------------------------------------------------------


def check_overrides(
    sources: Iterable[OverlaySource],
    read: Read,
    *,
    read_pinned: Read | None = None,
    top: str = "vllm",
    roots: Iterable[str] | None = None,
    label: str = "upstream",
    pinned_label: str | None = None,
) -> Report:
    """Every overlay subclass of an upstream class, against upstream as ``read`` gives it.

    ``read_pinned`` is the release the overlay was written against (the pin, with the
    series); without it ``read`` is both. ``roots``: the overlay's placed packages
    (``vllm.distributed....mooncake.ext``); by default each overlay file's own module.
    """
    sources = [s for s in sources if s.dst.endswith(".py")]
    by_module = {s.module: s for s in sources}
    roots_t = tuple(roots) if roots is not None else tuple(by_module)
    target = _Index(by_module, roots_t, read, top)
    pinned = _Index(by_module, roots_t, read_pinned, top) if read_pinned else target
    pinned_label = pinned_label or label
    report = Report()
    for src in sorted(sources, key=lambda s: s.path):
        try:
            ast.parse(src.text, filename=src.path)
        except SyntaxError as exc:
            report.problems.append(
                Problem(
                    "parse",
                    ERROR,
                    src.path,
                    exc.lineno or 0,
                    None,
                    None,
                    f"does not parse ({exc.msg}): its classes cannot be checked; fix it",
                )
            )
            continue
        mod = target.module(src.module)
        if mod is None:
            continue
        lines = src.text.splitlines()
        pragmas = _pragmas(src.text)
        for node in mod.classes.values():
            _check_class(
                _Class(mod, node),
                target,
                pinned,
                lines,
                pragmas,
                report,
                label,
                pinned_label,
            )
    for path, error in sorted({**pinned.unparsable, **target.unparsable}.items()):
        report.problems.append(
            Problem(
                "unverifiable",
                WARNING,
                path,
                0,
                None,
                None,
                f"upstream file does not parse ({error}): classes it defines were not checked",
                upstream=path,
            )
        )
    return report


def _at(cls: _Class, member: _Member) -> str:
    return f"{cls.module.path}:{member.line}"


@dataclass
class _ClassCheck:
    """One overlay subclass against the pinned and the target upstream."""

    cls: _Class
    now: _Ancestry  # in the target
    before: _Ancestry  # in the pinned release
    target: _Index
    label: str
    pinned_label: str
    report: Report
    checked: dict

    def add(
        self,
        kind: str,
        severity: str,
        line: int,
        method: str | None,
        message: str,
        *,
        at: tuple[_Class, _Member] | None = None,
        name: str | None = None,
        ours: str | None = None,
        theirs: str | None = None,
    ) -> None:
        upstream = upstream_line = None
        if at is not None:
            upstream, upstream_line = at[0].module.path, at[1].line
        elif self.now.upstream:
            upstream = self.now.upstream[0].module.path
        self.report.problems.append(
            Problem(
                kind,
                severity,
                self.cls.module.path,
                line,
                self.cls.node.name,
                method,
                message,
                upstream,
                upstream_line,
                name or method,
                ours,
                theirs,
            )
        )

    def bases(self, scope: _Ancestry | None = None) -> str:
        return (
            ", ".join(c.node.name for c in (scope or self.now).upstream) or "its bases"
        )

    def method(
        self, fn: ast.FunctionDef | ast.AsyncFunctionDef, declared: str | None
    ) -> None:
        method, sig = fn.name, signature_of(fn)
        found = self.now.lookup(method)
        was = self.before.lookup(method)
        now = found if found and found[0].origin == "upstream" else None
        before = was if was and was[0].origin == "upstream" else None
        if declared == "new" or not (declared == "override" or before):
            self.checked["new"].append(method)
            if now is None or (declared is None and _is_dunder(method)):
                return
            c, m = now
            why = (
                "marked `# vmp: new`"
                if declared
                else f"not an upstream method in {self.pinned_label}"
            )
            self.add(
                "shadowed",
                WARNING,
                fn.lineno,
                method,
                f"{why}, but {self.label} defines {c.node.name}.{method} "
                f"`{m.sig.render()}` at {_at(c, m)}: ours `{sig.render()}` silently "
                "replaces it. Rename ours, or make it an override (call super() where "
                "upstream's behaviour is still wanted)",
                at=now,
                ours=sig.render(),
                theirs=m.sig.render(),
            )
            return
        self.checked["overrides"].append(method)
        if now is None:
            if before is not None:
                c, m = before
                what = (
                    f"overrides {c.node.name}.{method} `{m.sig.render()}` of "
                    f"{self.pinned_label} ({_at(c, m)})"
                )
            else:
                what = "is marked `# vmp: override`"
            self.add(
                "override-missing",
                ERROR,
                fn.lineno,
                method,
                f"{what}, but {self.label} has no {method} on {self.bases()}: our "
                "override is never called. Find what replaced it upstream (renamed, "
                "moved, inlined) and port the override; if the method is ours, mark it "
                "`# vmp: new`",
                # where the method was (the pin's file) when the release has none
                at=before,
                ours=sig.render(),
                theirs=before[1].sig.render() if before else None,
            )
            return
        c, m = now
        issues = compare(sig, m.sig)
        for severity in (ERROR, WARNING):
            found_ = [what for sev, what in issues if sev == severity]
            if found_:
                self.add(
                    "signature",
                    severity,
                    fn.lineno,
                    method,
                    f"ours `{sig.render()}` vs {self.label}'s `{m.sig.render()}` "
                    f"({_at(c, m)}): {'; '.join(found_)}. Make ours take what upstream's "
                    "callers pass (and pass it on to super())",
                    at=now,
                    ours=sig.render(),
                    theirs=m.sig.render(),
                )

    def super_use(self, use: _SuperUse) -> None:
        if use.explicit is not None:
            scope = ancestry(self.target, use.explicit)
            own = use.explicit.members.get(use.name)
            found = (use.explicit, own) if own else scope.lookup(use.name)
            spelled = f"{use.explicit.node.name}.{use.name}(self, ...)"
        else:
            scope = self.now
            found = scope.lookup(use.name)
            spelled = f"super().{use.name}" + ("(...)" if use.call else "")
        if found is None:
            if _is_dunder(use.name) or scope.open:
                return  # object's, or from a base this check cannot read
            self.add(
                "super-missing",
                ERROR,
                use.line,
                use.method,
                f"calls {spelled}, but {self.label} has no {use.name} on "
                f"{self.bases(scope)}: it raises AttributeError. Find what replaced it "
                "upstream and call that",
                name=use.name,
            )
            return
        c, m = found
        if c.origin != "upstream" or use.call is None:
            return
        issues = check_call(use.call, m.sig, self_passed=use.explicit is not None)
        if issues:
            call = ast.unparse(use.call)
            call = call if len(call) <= 80 else call[:77] + "..."
            self.add(
                "super-call",
                ERROR,
                use.line,
                use.method,
                f"`{call}` vs {self.label}'s `{m.sig.render()}` ({_at(c, m)}): "
                f"{'; '.join(issues)}. Pass what upstream's method now takes",
                at=found,
                name=use.name,
                ours=call,
                theirs=m.sig.render(),
            )


def _check_class(
    cls: _Class,
    target: _Index,
    pinned: _Index,
    lines: list[str],
    pragmas: dict[int, str],
    report: Report,
    label: str,
    pinned_label: str,
) -> None:
    now = ancestry(target, cls)
    if pinned is target:
        before = now
    else:
        before = ancestry(pinned, pinned.find_class(cls.label) or cls)
    if not (now.upstream or now.missing or before.upstream):
        return  # no upstream class among its bases
    checked: dict = {
        "class": cls.node.name,
        "file": cls.module.path,
        "line": cls.node.lineno,
        "upstream_bases": [c.label for c in now.upstream],
        "overrides": [],
        "new": [],
        "super_calls": 0,
    }
    report.classes.append(checked)
    check = _ClassCheck(cls, now, before, target, label, pinned_label, report, checked)
    for owner, q in now.missing:
        check.add(
            "base-missing",
            ERROR,
            cls.node.lineno,
            None,
            f"its upstream base {q} (named by {owner.label}) is not in {label}: none of its "
            "overrides can be checked. Find where upstream moved it and update the import",
            name=q,
        )
    if now.missing:
        return  # every override would be reported missing: the import is the fix
    ours_in_between = {
        n for c in now.classes if c.origin == "overlay" for n in c.members
    }
    methods = [
        s
        for s in statements(cls.node.body)
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    for fn in methods:
        marker = _marker(fn, pragmas, lines)
        if marker and marker[0] not in PRAGMAS:
            check.add(
                "pragma",
                ERROR,
                marker[1],
                fn.name,
                f"unknown marker `# vmp: {marker[0]}`; use `# vmp: new` (ours, must not "
                "exist upstream) or `# vmp: override` (must exist upstream)",
            )
            marker = None
        if fn.name not in ours_in_between:  # else it overrides ours: checked there
            check.method(fn, marker[0] if marker else None)
    for fn in methods:
        for use in _super_uses(target, cls.module, fn, fn.name):
            checked["super_calls"] += 1
            check.super_use(use)
    for fn, attr, line in _upstream_attributes_missing(cls, now):
        check.add(
            "attribute-missing",
            ERROR,
            line,
            fn,
            f"reads self.{attr}, which no class of {label} among {check.bases()} sets "
            f"or defines (nor does {cls.node.name}): it would raise AttributeError "
            "there. Find what upstream renamed or moved it to and port the code",
            name=attr,
        )
    for fn, attr, line in _upstream_attributes_gone(cls, now, before):
        check.add(
            "attribute-missing",
            ERROR,
            line,
            fn,
            f"sets self.{attr}, which {pinned_label}'s {check.bases(before)} set or "
            f"read and no class of {label} does: ours would set a name nothing "
            "reads there. Find what upstream renamed or moved it to and port the code",
            name=attr,
        )
    for owner, name in _abstract_left(cls, now):
        check.add(
            "abstract",
            ERROR,
            cls.node.lineno,
            name,
            f"{owner.label}.{name} is abstract in {label} and neither "
            f"{cls.node.name} nor a class between defines it: {cls.node.name} cannot "
            'be instantiated ("Can\'t instantiate abstract class"); implement it '
            "(`# vmp: override`)",
            at=(owner, owner.members[name]),
            name=name,
        )


def _abstract_left(cls: _Class, now: _Ancestry) -> list[tuple[_Class, str]]:
    """Abstract methods of upstream classes in ``cls``'s ancestry that nothing
    before them in the lookup order (``cls`` first) defines: (declaring class,
    name). Nothing is said when a base is unknown (it may define them)."""
    if now.open:
        return []
    out = []
    for owner in now.upstream:
        for name, member in owner.members.items():
            if not member.abstract or any(name == n for _, n in out):
                continue
            first = cls.members.get(name)
            found = (cls, first) if first is not None else now.lookup(name)
            if found is not None and found[1].abstract:
                out.append((found[0], name))
    return out


def _self_attributes(
    node: ast.AST,
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """((attribute, line) of each self.<attribute> ``node`` sets, of each it reads)."""
    sets: list[tuple[str, int]] = []
    reads: list[tuple[str, int]] = []
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and is_self(n.value):
            (sets if isinstance(n.ctx, ast.Store) else reads).append((n.attr, n.lineno))
    return sets, reads


def _first_uses(
    cls: _Class, stores: bool, wanted: Callable[[str], bool]
) -> list[tuple[str, str, int]]:
    """(our method, attribute, line) of the first self.<attribute> our class sets
    (``stores``) or reads, for each attribute ``wanted`` picks."""
    out, seen = [], set()
    for fn in statements(cls.node.body):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for attr, line in _self_attributes(fn)[0 if stores else 1]:
            if attr not in seen and wanted(attr):
                seen.add(attr)
                out.append((fn.name, attr, line))
    return out


def _upstream_attributes_missing(
    cls: _Class, now: _Ancestry
) -> list[tuple[str, str, int]]:
    """(our method, attribute, line) for each self.<attribute> our class reads that
    neither it, a class between, nor any upstream class of its ancestry sets (in
    any method) or defines (a member): an upstream attribute the release renamed or
    dropped. Nothing is said when a base is unknown (it may set them)."""
    if now.open or not now.upstream:
        return []
    known: set[str] = set(cls.members)
    for c in [cls, *now.classes]:
        known |= set(c.members)
        known |= {attr for attr, _ in _self_attributes(c.node)[0]}
    return _first_uses(
        cls, False, lambda attr: attr not in known and not _is_dunder(attr)
    )


def _upstream_attributes_gone(
    cls: _Class, now: _Ancestry, before: _Ancestry
) -> list[tuple[str, str, int]]:
    """(our method, attribute, line) for each self.<attribute> our class sets that
    the upstream classes of the pinned release set, read or define and those of
    the release checked do not: ours would write a name upstream no longer uses."""
    if now.open or before.open or not before.upstream:
        return []

    def upstream_names(scope: _Ancestry) -> set[str]:
        names: set[str] = set()
        for c in scope.upstream:
            sets, reads = _self_attributes(c.node)
            names |= set(c.members) | {a for a, _ in sets} | {a for a, _ in reads}
        return names

    gone = upstream_names(before) - upstream_names(now)
    if not gone:
        return []
    return _first_uses(cls, True, lambda attr: attr in gone)
