"""``patchset/overrides.py``: our subclasses of upstream classes, checked per release.

Synthetic upstream texts and overlay files, no sdist: ``read`` is a dict lookup. The
last tests go through ``build.py check`` on a synthetic sdist (offline, like
test_check.py); the compat grid's case is in test_compat_grid.py.
"""

from __future__ import annotations

import json

from conftest import OVERLAY_DST, UPSTREAM_FILES, Project, patch_text, udiff

from patchset import overrides
from patchset.overrides import OverlaySource, check_overrides

MOONCAKE = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake"
CONNECTOR = f"{MOONCAKE}/mooncake_connector.py"
CONNECTOR_MODULE = CONNECTOR[:-3].replace("/", ".")
ROOTS = [OVERLAY_DST.replace("/", ".")]

BASE = """\
class Base:
    def get_finished(self, x):
        return x

    def start_load_kv(self, metadata):
        pass
"""

OURS = f"""\
from {CONNECTOR_MODULE} import Base


class Ext(Base):
    def get_finished(self, x):
        return super().get_finished(x)

    def start_load_kv(self, metadata):
        super().start_load_kv(metadata)

    def has_requests(self) -> bool:  # vmp: new
        return False
"""


def reader(files: dict[str, str]):
    return files.get


def overlay(text: str = OURS, rel: str = "ext.py") -> list[OverlaySource]:
    return [OverlaySource(f"connector/{rel}", f"{OVERLAY_DST}/{rel}", text)]


def check(
    target: str,
    *,
    pinned: str | None = BASE,
    sources=None,
    extra=None,
    pinned_extra=None,
):
    """Our overlay against ``target`` as the release's connector, ``pinned`` as the pin's
    (None: no pinned release, as in build.py check); ``extra``: more upstream files."""
    files = {CONNECTOR: target, **(extra or {})}
    pinned_files = {
        CONNECTOR: pinned,
        **((extra if pinned_extra is None else pinned_extra) or {}),
    }
    return check_overrides(
        sources or overlay(),
        reader(files),
        read_pinned=reader(pinned_files) if pinned is not None else None,
        roots=ROOTS,
        label="vllm 0.20.0",
        pinned_label="vllm 0.18.1",
    )


def kinds(report) -> list[tuple[str, str, str | None]]:
    return [(p.kind, p.severity, p.method) for p in report.problems]


def test_an_unchanged_upstream_has_no_problems() -> None:
    report = check(BASE)
    assert report.problems == []
    (cls,) = report.classes
    assert cls["class"] == "Ext" and cls["upstream_bases"] == [
        f"{CONNECTOR_MODULE}.Base"
    ]
    assert cls["overrides"] == ["get_finished", "start_load_kv"]
    assert cls["new"] == ["has_requests"] and cls["super_calls"] == 2
    assert "1 subclasses of upstream classes, 2 overrides and 2 super() calls" in (
        report.summary()
    )


def test_a_renamed_upstream_method_is_an_override_never_called() -> None:
    renamed = BASE.replace("def get_finished(", "def get_finished_reqs(")
    report = check(renamed)
    assert kinds(report) == [
        ("override-missing", "error", "get_finished"),
        ("super-missing", "error", "get_finished"),
    ]
    missing, call = report.problems
    assert missing.where == "connector/ext.py:5" and missing.cls == "Ext"
    assert missing.upstream == CONNECTOR
    assert "overrides Base.get_finished `def get_finished(self, x)` of vllm 0.18.1" in (
        missing.message
    )
    assert "vllm 0.20.0 has no get_finished on Base: our override is never called" in (
        missing.message
    )
    assert call.line == 6 and "calls super().get_finished(...)" in call.message


def test_check_alone_sees_a_rename_through_super_and_the_override_marker() -> None:
    """Without a pinned release (build.py check), the override looks new: the super()
    call still catches it, and `# vmp: override` makes the intent checkable."""
    renamed = BASE.replace("def get_finished(", "def get_finished_reqs(")
    assert kinds(check(renamed, pinned=None)) == [
        ("super-missing", "error", "get_finished")
    ]
    marked = OURS.replace(
        "    def get_finished(self, x):\n        return super().get_finished(x)\n",
        "    def get_finished(self, x):  # vmp: override\n        return x\n",
    )
    report = check(renamed, pinned=None, sources=overlay(marked))
    assert kinds(report) == [("override-missing", "error", "get_finished")]
    assert "is marked `# vmp: override`" in report.problems[0].message


def test_a_new_required_parameter_is_a_signature_problem_naming_both() -> None:
    changed = BASE.replace("(self, metadata)", "(self, metadata, forward_context)")
    report = check(changed)
    assert kinds(report) == [
        ("signature", "error", "start_load_kv"),
        ("super-call", "error", "start_load_kv"),
    ]
    sig, call = report.problems
    assert sig.ours == "def start_load_kv(self, metadata)"
    assert sig.theirs == "def start_load_kv(self, metadata, forward_context)"
    assert sig.upstream == CONNECTOR and sig.upstream_line == 5
    assert (
        "ours `def start_load_kv(self, metadata)` vs vllm 0.20.0's "
        "`def start_load_kv(self, metadata, forward_context)`" in sig.message
    )
    assert (
        "upstream's has the required `forward_context`, which ours lacks" in sig.message
    )
    assert "does not pass the required `forward_context`" in call.message


def test_signature_details() -> None:
    optional = BASE.replace("(self, metadata)", "(self, metadata, wait=False)")
    assert kinds(check(optional)) == [("signature", "warning", "start_load_kv")]
    renamed_param = BASE.replace("(self, x)", "(self, req_ids)")
    (problem,) = check(renamed_param).problems
    assert "ours has `x` where upstream's has `req_ids`" in problem.message
    made_async = BASE.replace("    def start_load_kv", "    async def start_load_kv")
    assert "only upstream's is async" in check(made_async).problems[0].message
    # a catch-all of ours takes upstream's new parameters
    catch_all = OURS.replace(
        "def start_load_kv(self, metadata):",
        "def start_load_kv(self, metadata, **kwargs):",
    ).replace(
        "super().start_load_kv(metadata)", "super().start_load_kv(metadata, **kwargs)"
    )
    new_kw = BASE.replace("(self, metadata)", "(self, metadata, *, forward_context)")
    assert check(new_kw, sources=overlay(catch_all)).problems == []


def test_a_method_of_ours_now_also_upstream_is_shadowed() -> None:
    grown = BASE + "\n    def has_requests(self) -> bool:\n        return True\n"
    report = check(grown)
    assert kinds(report) == [("shadowed", "warning", "has_requests")]
    assert report.errors == []
    (problem,) = report.warnings
    assert (
        "marked `# vmp: new`, but vllm 0.20.0 defines Base.has_requests"
        in problem.message
    )
    assert "silently replaces it" in problem.message
    # unmarked, and absent from the pin: the same risk
    unmarked = overlay(OURS.replace("  # vmp: new", ""))
    problem = check(grown, sources=unmarked).problems[0]
    assert problem.kind == "shadowed" and "not an upstream method in vllm 0.18.1" in (
        problem.message
    )
    # marked new but upstream at the pin already has it (build.py check): also reported
    assert kinds(check(grown, pinned=None)) == [("shadowed", "warning", "has_requests")]


def test_relative_and_module_imports_reach_upstream() -> None:
    relative = OURS.replace(
        f"from {CONNECTOR_MODULE} import Base", "from ...mooncake_connector import Base"
    )
    nested = overlay(relative, rel="sub/mod.py")  # ext/sub/: climbs out of ext/ twice
    assert check(BASE, sources=nested).classes[0]["overrides"] == [
        "get_finished",
        "start_load_kv",
    ]
    renamed = BASE.replace("def get_finished(", "def get_finished_reqs(")
    assert "override-missing" in [
        p.kind for p in check(renamed, sources=nested).problems
    ]
    dotted = OURS.replace(
        f"from {CONNECTOR_MODULE} import Base", f"import {CONNECTOR_MODULE} as mc"
    ).replace("class Ext(Base):", "class Ext(mc.Base):")
    assert kinds(check(renamed, sources=overlay(dotted)))[0][0] == "override-missing"
    # our own classes in between: A(Base) in one file, Ext(A) in another
    a = f"from {CONNECTOR_MODULE} import Base\n\n\nclass A(Base):\n    pass\n"
    ext = OURS.replace(
        f"from {CONNECTOR_MODULE} import Base", "from .a import A"
    ).replace("class Ext(Base):", "class Ext(A):")
    report = check(renamed, sources=overlay(a, "a.py") + overlay(ext))
    assert ("override-missing", "error", "get_finished") in kinds(report)


def test_upstream_bases_are_followed_across_modules() -> None:
    root = "class Root:\n    def shutdown(self):\n        pass\n"
    base = f"from {MOONCAKE.replace('/', '.')}.root import Root\n\n\n" + BASE.replace(
        "class Base:", "class Base(Root):"
    )
    ours = OURS + (
        "\n    def shutdown(self):\n        super().shutdown()\n        super().__init__()\n"
    )
    extra = {f"{MOONCAKE}/root.py": root}
    report = check(base, pinned=base, sources=overlay(ours), extra=extra)
    assert report.problems == []  # object's __init__ is not judged
    assert (
        report.classes[0]["upstream_bases"][-1]
        == f"{MOONCAKE.replace('/', '.')}.root.Root"
    )
    gone = {f"{MOONCAKE}/root.py": root.replace("shutdown", "close")}
    report = check(
        base, pinned=base, sources=overlay(ours), extra=gone, pinned_extra=extra
    )
    assert kinds(report) == [
        ("override-missing", "error", "shutdown"),
        ("super-missing", "error", "shutdown"),
    ]
    # a base outside the package: its methods are unknown, so super() calls are not judged
    external = "import torch\n\n\nclass Base(torch.nn.Module):\n    pass\n"
    assert check(external, pinned=None, sources=overlay(ours)).problems == []


def test_an_explicit_upstream_call_is_checked_like_super() -> None:
    ours = OURS.replace("super().get_finished(x)", "Base.get_finished(self, x)")
    assert check(BASE, sources=overlay(ours)).problems == []
    renamed = BASE.replace("def get_finished(", "def get_finished_reqs(")
    report = check(renamed, pinned=None, sources=overlay(ours))
    (problem,) = report.problems
    assert problem.kind == "super-missing" and problem.line == 6
    assert (
        "calls Base.get_finished(self, ...), but vllm 0.20.0 has no get_finished"
        in (problem.message)
    )
    extra_arg = OURS.replace("super().get_finished(x)", "Base.get_finished(self, x, 1)")
    (problem,) = check(BASE, sources=overlay(extra_arg)).problems
    assert problem.kind == "super-call"
    assert "passes 3 positional arguments, upstream's takes 2" in problem.message


def test_a_vanished_base_and_a_misspelt_marker() -> None:
    report = check("class Other:\n    pass\n")
    assert kinds(report) == [("base-missing", "error", None)]
    assert f"base {CONNECTOR_MODULE}.Base (named by" in report.problems[0].message
    typo = overlay(OURS.replace("# vmp: new", "# vmp: nwe"))
    assert ("pragma", "error", "has_requests") in kinds(check(BASE, sources=typo))


def test_wanted_paths_and_fingerprint() -> None:
    wanted = overrides.wanted_paths(overlay())
    assert CONNECTOR in wanted and f"{MOONCAKE}/__init__.py" in wanted
    plain = OverlaySource(
        "connector/store.py", f"{OVERLAY_DST}/store.py", "class S:\n    pass\n"
    )
    assert [row[0] for row in overrides.fingerprint(overlay() + [plain])] == [
        f"{OVERLAY_DST}/ext.py"
    ]


# -- through build.py check -------------------------------------------------------------


def _project(tmp_path, monkeypatch, ours: str, **upstream: str) -> Project:
    """A project whose sdist holds ``upstream`` (name -> text, under mooncake/)."""
    files = {**UPSTREAM_FILES, f"{MOONCAKE}/__init__.py": ""}
    files.update({f"{MOONCAKE}/{name}.py": text for name, text in upstream.items()})
    proj = Project(tmp_path, files)
    monkeypatch.setenv("VMP_CACHE_DIR", str(proj.cache))
    monkeypatch.setenv("VMP_SDIST_URL", str(proj.source))
    monkeypatch.delenv("VMP_ROOT", raising=False)
    (proj.root / "connector" / "ext.py").write_text(ours)
    assert proj.run("fetch").code == 0
    return proj


def test_build_py_check_reports_override_problems(tmp_path, monkeypatch) -> None:
    ours = OURS.replace("(self, metadata):", "(self, meta):").replace(
        "start_load_kv(metadata)", "start_load_kv(meta)"
    )
    proj = _project(tmp_path, monkeypatch, ours, mooncake_connector=BASE)
    r = proj.run("check")
    assert r.code == 1, r.text
    assert (
        "problem [override]: signature: connector/ext.py:8: Ext.start_load_kv: ours "
        "`def start_load_kv(self, meta)` vs vllm 0.18.1's `def start_load_kv(self, "
        "metadata)`" in r.out
    )
    assert "overrides: 1 subclasses of upstream classes, 2 overrides" in r.out
    r = proj.run("check", "--json")
    (problem,) = json.loads(r.out)["problems"]
    assert problem["kind"] == "override" and problem["detail"]["kind"] == "signature"
    assert problem["detail"]["theirs"] == "def start_load_kv(self, metadata)"


def test_build_py_check_reads_upstream_as_the_series_leaves_it(
    tmp_path, monkeypatch
) -> None:
    """The base's own base lives in a module the overlay never imports (read in a second
    pass); a method a patch adds upstream is there for our override; a method of ours
    that upstream also has is a warning (exit 0)."""
    root = "class Root:\n    def close(self):\n        pass\n"
    base = f"from {MOONCAKE.replace('/', '.')}.root import Root\n\n\n" + BASE.replace(
        "class Base:", "class Base(Root):"
    )
    ours = OURS + (
        "\n    def close(self, now):\n        pass\n"
        "\n    def drain(self):  # vmp: override\n        super().drain()\n"
    )
    proj = _project(tmp_path, monkeypatch, ours, mooncake_connector=base, root=root)
    patched = base + "\n    def drain(self):\n        pass\n"
    diff = udiff(CONNECTOR, base, patched)
    proj.add_patch("0001-drain.patch", patch_text("Add drain", diff))
    r = proj.run("check", "--json")
    data = json.loads(r.out)
    problems = [p["detail"] for p in data["problems"]]
    assert [(p["kind"], p["method"]) for p in problems] == [("signature", "close")], (
        problems
    )
    assert problems[0]["upstream"] == f"{MOONCAKE}/root.py"
    assert "upstream's callers do not pass" in problems[0]["message"]
    assert data["overrides"]["classes"][0]["overrides"] == [
        "get_finished",
        "start_load_kv",
        "close",
        "drain",
    ]
    fixed = ours.replace("def close(self, now):", "def close(self):")
    fixed = fixed.replace(
        "def drain(self):  # vmp: override", "def drain(self):  # vmp: new"
    )
    (proj.root / "connector" / "ext.py").write_text(fixed)
    r = proj.run("check")
    assert r.code == 0, r.text
    assert (
        "warning [override]: shadowed: connector/ext.py:17: Ext.drain: marked" in r.out
    )


def test_an_abstract_method_upstream_adds_is_named_if_nothing_defines_it() -> None:
    """A new @abstractmethod on an upstream base: our subclass could no longer be
    instantiated ("Can't instantiate abstract class"), whether or not ours calls
    super() anywhere. Defined by ours (or a class between): no problem."""
    abstract = (
        "from abc import ABC, abstractmethod\n\n\n"
        + BASE.replace("class Base:", "class Base(ABC):")
        + "\n    @abstractmethod\n    def get_block_ids_with_load_errors(self):\n        ...\n"
    )
    report = check(abstract)
    assert kinds(report) == [("abstract", "error", "get_block_ids_with_load_errors")]
    (problem,) = report.problems
    assert "Base.get_block_ids_with_load_errors is abstract in vllm 0.20.0" in (
        problem.message
    )
    assert problem.upstream == CONNECTOR and problem.upstream_line == 12
    defined = OURS + (
        "\n    def get_block_ids_with_load_errors(self):  # vmp: override\n"
        "        return set()\n"
    )
    assert check(abstract, pinned=abstract, sources=overlay(defined)).problems == []


def _roll(proj: Project, connector: str) -> None:
    """rolls/0.19.0: an empty series on a cached 0.19.0 sdist whose connector module
    is ``connector``."""
    from test_compat_grid import make_sdist

    files = {**UPSTREAM_FILES, f"{MOONCAKE}/__init__.py": "", CONNECTOR: connector}
    sha = make_sdist(proj.cache / "vllm-0.19.0.tar.gz", "0.19.0", files)
    roll = proj.root / "rolls" / "0.19.0"
    roll.mkdir(parents=True)
    manifest = (proj.root / "patches" / "upstream.toml").read_text()
    (roll / "upstream.toml").write_text(
        manifest.replace("0.18.1", "0.19.0").replace(proj.sha, sha)
    )
    (roll / "series").write_text("")


def test_check_on_a_roll_names_an_override_of_the_pin_the_roll_lost(
    tmp_path, monkeypatch
) -> None:
    """Ours overrides get_finished without super() and without a marker. The roll's
    release renamed it upstream: checked alone, ours there looks like a new method
    of its own; against the pin's overrides it is one that lost its upstream."""
    ours = OURS.replace("return super().get_finished(x)", "return x")
    proj = _project(tmp_path, monkeypatch, ours, mooncake_connector=BASE)
    assert proj.run("check").code == 0
    _roll(proj, BASE.replace("def get_finished(", "def get_finished_reqs("))
    r = proj.run("--patches", "rolls/0.19.0", "check")
    assert r.code == 1, r.text
    assert "Ext.get_finished" in r.out and "get_finished" in r.out, r.out
    assert "vllm 0.18.1 (the pin)" in r.out, r.out


def test_check_on_a_roll_warns_of_a_pin_hook_the_roll_does_not_carry(
    tmp_path, monkeypatch
) -> None:
    """The pin's own series adds Base.drain (a hook) and ours overrides it; the roll
    does not carry that patch (its release needs no hook): a warning naming the
    patch, not an error."""
    ours = OURS + "\n    def drain(self):  # vmp: override\n        pass\n"
    proj = _project(tmp_path, monkeypatch, ours, mooncake_connector=BASE)
    hooked = BASE + "\n    def drain(self):\n        pass\n"
    proj.add_patch(
        "0001-drain.patch", patch_text("Add drain", udiff(CONNECTOR, BASE, hooked))
    )
    assert proj.run("check").code == 0
    _roll(proj, BASE)
    r = proj.run("--patches", "rolls/0.19.0", "check")
    assert r.code == 0, r.text
    assert "warning [override]: override-missing" in r.out, r.out
    assert "only through 0001-drain.patch, which this roll does not carry" in r.out


def test_an_upstream_attribute_ours_reads_that_the_release_no_longer_sets() -> None:
    """Ours reads self.pending, which Base sets; the release renamed it: every call
    of ours would raise AttributeError there. What ours sets itself, and what a base
    defines as a member, is not reported."""
    base = BASE.replace(
        "class Base:\n",
        "class Base:\n    def __init__(self):\n        self.pending = {}\n"
        "        self.count = 0\n\n",
    )
    ours = OURS.replace(
        "return super().get_finished(x)",
        "self.mine = len(self.pending) + self.count\n"
        "        self.count += 1\n"
        "        return super().get_finished(self.mine)",
    )
    assert check(base, pinned=base, sources=overlay(ours)).problems == []
    renamed = base.replace("self.pending = {}", "self.waiting = {}")
    report = check(renamed, pinned=base, sources=overlay(ours))
    assert kinds(report) == [("attribute-missing", "error", "get_finished")]
    (problem,) = report.problems
    assert "self.pending" in problem.message and "vllm 0.20.0" in problem.message
    assert problem.name == "pending"


def test_an_upstream_attribute_ours_sets_that_the_release_no_longer_uses() -> None:
    """Ours sets self.limit, which Base reads at the pin; the release renamed it:
    ours would set a name nothing reads (no error at run time, no effect)."""
    base = BASE.replace(
        "class Base:\n",
        "class Base:\n    def allowed(self, n):\n        return n < self.limit\n\n",
    )
    ours = OURS.replace(
        "return super().get_finished(x)",
        "self.limit = 8\n        return super().get_finished(x)",
    )
    assert check(base, pinned=base, sources=overlay(ours)).problems == []
    renamed = base.replace("self.limit", "self.max_pending")
    report = check(renamed, pinned=base, sources=overlay(ours))
    assert kinds(report) == [("attribute-missing", "error", "get_finished")]
    assert "sets self.limit" in report.problems[0].message
