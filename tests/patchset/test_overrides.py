"""``patchset/overrides.py``: our subclasses of upstream classes, checked per release.

Synthetic upstream texts and overlay files, no sdist; basedpyright runs for real on
them (about 2 s a case). The last tests go through ``build.py check`` on a synthetic
sdist (offline, like test_check.py); the compat grid's case is in test_compat_grid.py.
"""

from __future__ import annotations

import json
import sys

from conftest import OVERLAY_DST, UPSTREAM_FILES, Project, patch_text, udiff

from patchset.overrides import OverlaySource, check_overrides

MOONCAKE = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake"
CONNECTOR = f"{MOONCAKE}/mooncake_connector.py"
CONNECTOR_MODULE = CONNECTOR[:-3].replace("/", ".")
ROOTS = [OVERLAY_DST.replace("/", ".")]

BASE = """\
class Base:
    def __init__(self, config):
        self.config = config

    def get_finished(self, x):
        return x

    def start_load_kv(self, metadata):
        pass
"""

OURS = f"""\
from typing_extensions import override

from {CONNECTOR_MODULE} import Base


class Ext(Base):
    @override
    def get_finished(self, x):
        return super().get_finished(x)

    @override
    def start_load_kv(self, metadata):
        super().start_load_kv(metadata)

    def has_requests(self) -> bool:
        return False
"""


def overlay(text: str = OURS, rel: str = "ext.py") -> list[OverlaySource]:
    return [OverlaySource(f"connector/{rel}", f"{OVERLAY_DST}/{rel}", text)]


def check(target: str, *, pinned: str | None = None, sources=None, extra=None):
    """Our overlay against ``target`` as the release's connector module; ``pinned``:
    the pin's (for the attributes ours sets); ``extra``: more upstream files."""
    files = {CONNECTOR: target, f"{MOONCAKE}/__init__.py": "", **(extra or {})}
    pinned_files = {**files, CONNECTOR: pinned}
    return check_overrides(
        sources or overlay(),
        files,
        read_pinned=pinned_files.get if pinned is not None else None,
        roots=ROOTS,
        label="vllm 0.20.0",
        pinned_label="vllm 0.18.1",
    )


def kinds(report) -> list[tuple[str, str, str | None]]:
    return [(p.kind, p.severity, p.method) for p in report.problems]


def test_an_unchanged_upstream_has_no_problems() -> None:
    report = check(BASE, pinned=BASE)
    assert report.problems == []
    (cls,) = report.classes
    assert cls["class"] == "Ext" and cls["upstream_bases"] == [
        f"{CONNECTOR_MODULE}.Base"
    ]
    assert cls["overrides"] == ["get_finished", "start_load_kv"]
    assert "1 subclasses of upstream classes and 2 overrides" in report.summary()


def test_a_renamed_upstream_method_is_an_override_never_called() -> None:
    renamed = BASE.replace("def get_finished(", "def get_finished_reqs(")
    report = check(renamed)
    assert kinds(report) == [
        ("override-missing", "error", "get_finished"),
        ("super-missing", "error", "get_finished"),
    ]
    missing, call = report.problems
    assert missing.where == "connector/ext.py:8" and missing.cls == "Ext"
    assert missing.name == "get_finished"
    assert "marked as override, but no base method" in missing.message
    assert "(in vllm 0.20.0): our override is never called" in missing.message
    assert call.line == 9 and 'attribute "get_finished"' in call.message
    # without super(): the marker alone catches it
    no_super = OURS.replace("return super().get_finished(x)", "return x")
    assert kinds(check(renamed, sources=overlay(no_super))) == [
        ("override-missing", "error", "get_finished")
    ]


def test_a_new_required_parameter_is_a_signature_problem() -> None:
    changed = BASE.replace("(self, metadata)", "(self, metadata, forward_context)")
    report = check(changed)
    assert kinds(report) == [
        ("signature", "error", "start_load_kv"),
        ("super-call", "error", "start_load_kv"),
    ]
    sig, call = report.problems
    assert "Positional parameter count mismatch" in sig.message
    assert 'Argument missing for parameter "forward_context"' in call.message
    # a catch-all of ours takes upstream's new keyword parameters
    catch_all = OURS.replace(
        "def start_load_kv(self, metadata):",
        "def start_load_kv(self, metadata, **kwargs):",
    ).replace(
        "super().start_load_kv(metadata)", "super().start_load_kv(metadata, **kwargs)"
    )
    new_kw = BASE.replace("(self, metadata)", "(self, metadata, *, forward_context)")
    assert check(new_kw, sources=overlay(catch_all)).problems == []


def test_signature_details() -> None:
    keyword_only = BASE.replace("(self, metadata)", "(self, *, metadata)")
    assert ("super-call", "error", "start_load_kv") in kinds(check(keyword_only))
    made_async = BASE.replace("    def start_load_kv", "    async def start_load_kv")
    assert kinds(check(made_async)) == [("signature", "error", "start_load_kv")]
    # ours returns more than upstream declares: a warning, upstream still calls ours
    typed = BASE.replace(
        "def get_finished(self, x):", "def get_finished(self, x) -> int:"
    )
    ours = OURS.replace(
        "def get_finished(self, x):", "def get_finished(self, x) -> int | None:"
    )
    report = check(typed, sources=overlay(ours))
    assert kinds(report) == [("signature", "warning", "get_finished")]
    assert "Return type mismatch" in report.problems[0].message


def test_a_method_of_ours_now_also_upstream_is_shadowed() -> None:
    grown = BASE + "\n    def has_requests(self) -> bool:\n        return True\n"
    report = check(grown)
    assert kinds(report) == [("shadowed", "warning", "has_requests")]
    assert report.errors == []
    assert "ours silently replaces upstream's" in report.warnings[0].message


def test_relative_and_module_imports_reach_upstream() -> None:
    renamed = BASE.replace("def get_finished(", "def get_finished_reqs(")
    relative = OURS.replace(
        f"from {CONNECTOR_MODULE} import Base", "from ...mooncake_connector import Base"
    )
    nested = overlay(relative, rel="sub/mod.py")  # ext/sub/: climbs out of ext/ twice
    assert check(BASE, sources=nested).classes[0]["overrides"] == [
        "get_finished",
        "start_load_kv",
    ]
    assert ("override-missing", "error", "get_finished") in kinds(
        check(renamed, sources=nested)
    )
    dotted = OURS.replace(
        f"from {CONNECTOR_MODULE} import Base", f"import {CONNECTOR_MODULE} as mc"
    ).replace("class Ext(Base):", "class Ext(mc.Base):")
    assert kinds(check(renamed, sources=overlay(dotted)))[0][0] == "override-missing"


def test_upstream_bases_are_followed_across_modules() -> None:
    root = "class Root:\n    def shutdown(self):\n        pass\n"
    base = f"from {MOONCAKE.replace('/', '.')}.root import Root\n\n\n" + BASE.replace(
        "class Base:", "class Base(Root):"
    )
    ours = OURS + (
        "\n    @override\n    def shutdown(self):\n        super().shutdown()\n"
    )
    extra = {f"{MOONCAKE}/root.py": root}
    assert check(base, sources=overlay(ours), extra=extra).problems == []
    gone = {f"{MOONCAKE}/root.py": root.replace("shutdown", "close")}
    assert kinds(check(base, sources=overlay(ours), extra=gone)) == [
        ("override-missing", "error", "shutdown"),
        ("super-missing", "error", "shutdown"),
    ]


def test_an_explicit_upstream_call_is_checked_like_super() -> None:
    extra_arg = OURS.replace("super().get_finished(x)", "Base.get_finished(self, x, 1)")
    (problem,) = check(BASE, sources=overlay(extra_arg)).problems
    assert (problem.kind, problem.line) == ("super-call", 9)
    assert "Expected 2 positional arguments" in problem.message


def test_a_vanished_base_or_module() -> None:
    report = check("class Other:\n    pass\n")
    assert ("base-missing", "error", None) in kinds(report)
    assert '"Base" is unknown import symbol' in report.problems[0].message
    moved = OURS.replace(CONNECTOR_MODULE, f"{CONNECTOR_MODULE}_v2")
    assert ("base-missing", "error", None) in kinds(check(BASE, sources=overlay(moved)))


def test_an_abstract_method_upstream_adds_is_named_if_nothing_defines_it() -> None:
    """A new @abstractmethod on an upstream base: our subclass could no longer be
    instantiated ("Can't instantiate abstract class"). Defined by ours: no problem."""
    abstract = (
        "from abc import ABC, abstractmethod\n\n\n"
        + BASE.replace("class Base:", "class Base(ABC):")
        + "\n    @abstractmethod\n    def get_block_ids_with_load_errors(self) -> set[str]:\n        ...\n"
    )
    report = check(abstract)
    assert kinds(report) == [("abstract", "error", None)]
    assert '"Base.get_block_ids_with_load_errors" is not implemented' in (
        report.problems[0].message
    )
    defined = OURS + (
        "\n    @override\n    def get_block_ids_with_load_errors(self):\n"
        "        return set()\n"
    )
    assert check(abstract, sources=overlay(defined)).problems == []


def test_a_new_required_parameter_of_the_constructor_vllm_calls() -> None:
    """vLLM constructs our class with its base's arguments; a type checker's override
    rules leave ``__init__`` out, so this one is ours."""
    ours = OURS + (
        "\n    def __init__(self, config):\n        super().__init__(config)\n"
    )
    assert check(BASE, sources=overlay(ours)).problems == []
    grown = BASE.replace("(self, config)", "(self, config, kv_cache_config)")
    report = check(grown, sources=overlay(ours))
    assert ("signature", "error", "__init__") in kinds(report)
    (problem,) = [
        p for p in report.problems if p.method == "__init__" and p.kind == "signature"
    ]
    assert "requires kv_cache_config, which ours does not take" in problem.message
    catch_all = ours.replace("(self, config):", "(self, config, **kwargs):").replace(
        "super().__init__(config)", "super().__init__(config, **kwargs)"
    )
    assert check(grown, sources=overlay(catch_all)).problems == []


def test_an_upstream_attribute_ours_reads_that_the_release_no_longer_sets() -> None:
    ours = OURS.replace(
        "return super().get_finished(x)",
        "return super().get_finished(len(self.config))",
    )
    assert check(BASE, sources=overlay(ours)).problems == []
    renamed = BASE.replace("self.config = config", "self.vllm_config = config")
    report = check(renamed, sources=overlay(ours))
    assert kinds(report) == [("attribute-missing", "error", "get_finished")]
    assert 'attribute "config"' in report.problems[0].message


def test_an_upstream_attribute_ours_sets_that_the_release_no_longer_uses() -> None:
    """Ours sets self.limit, which Base reads at the pin; the release renamed it:
    ours would set a name nothing reads (no error at run time, no effect)."""
    base = BASE.replace(
        "    def get_finished",
        "    def allowed(self, n):\n        return n < self.limit\n\n    def get_finished",
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
    assert report.problems[0].name == "limit"


def test_without_basedpyright_the_check_does_not_pass(monkeypatch, tmp_path) -> None:
    """A python without basedpyright: one error, never a silent pass."""
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    bare.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bare))
    report = check(BASE)
    assert kinds(report) == [("unverifiable", "error", None)]
    assert "basedpyright could not check the overrides" in report.problems[0].message


def test_an_overlay_file_that_does_not_parse() -> None:
    broken = overlay(OURS + "\n    def oops(self:\n")
    assert ("parse", "error", None) in kinds(check(BASE, sources=broken))


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
    ours = OURS.replace("(self, metadata):", "(self, meta, extra):").replace(
        "start_load_kv(metadata)", "start_load_kv(meta)"
    )
    proj = _project(tmp_path, monkeypatch, ours, mooncake_connector=BASE)
    r = proj.run("check")
    assert r.code == 1, r.text
    assert (
        "problem [override]: signature: connector/ext.py:12: Ext.start_load_kv: "
        'Method "start_load_kv" overrides class "Base" in an incompatible manner'
    ) in r.out
    assert "overrides: 1 subclasses of upstream classes and 2 overrides" in r.out
    r = proj.run("check", "--json")
    (problem,) = json.loads(r.out)["problems"]
    assert problem["kind"] == "override" and problem["detail"]["kind"] == "signature"


def test_build_py_check_reads_upstream_as_the_series_leaves_it(
    tmp_path, monkeypatch
) -> None:
    """The base's own base lives in a module the overlay never imports; a method a
    patch adds upstream is there for our override; a method of ours that upstream
    also has is a warning (exit 0)."""
    root = "class Root:\n    def close(self):\n        pass\n"
    base = f"from {MOONCAKE.replace('/', '.')}.root import Root\n\n\n" + BASE.replace(
        "class Base:", "class Base(Root):"
    )
    ours = OURS + (
        "\n    @override\n    def close(self, now):\n        pass\n"
        "\n    @override\n    def drain(self):\n        super().drain()\n"
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
    assert data["overrides"]["classes"][0]["overrides"] == [
        "get_finished",
        "start_load_kv",
        "close",
        "drain",
    ]
    fixed = ours.replace("def close(self, now):", "def close(self):")
    fixed = fixed.replace("    @override\n    def drain", "    def drain")
    (proj.root / "connector" / "ext.py").write_text(fixed)
    r = proj.run("check")
    assert r.code == 0, r.text
    assert "warning [override]: shadowed: connector/ext.py:22: Ext.drain:" in r.out


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


def test_check_on_a_roll_names_an_override_the_release_lost(
    tmp_path, monkeypatch
) -> None:
    ours = OURS.replace("return super().get_finished(x)", "return x")
    proj = _project(tmp_path, monkeypatch, ours, mooncake_connector=BASE)
    assert proj.run("check").code == 0
    _roll(proj, BASE.replace("def get_finished(", "def get_finished_reqs("))
    r = proj.run("--patches", "rolls/0.19.0", "check")
    assert r.code == 1, r.text
    assert "override-missing: connector/ext.py:8: Ext.get_finished" in r.out, r.out


def test_check_on_a_roll_warns_of_a_pin_hook_the_roll_does_not_carry(
    tmp_path, monkeypatch
) -> None:
    """The pin's own series adds Base.drain (a hook) and ours overrides it; the roll
    does not carry that patch (its release needs no hook): a warning naming the
    patch, not an error."""
    ours = OURS + "\n    @override\n    def drain(self):\n        pass\n"
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
