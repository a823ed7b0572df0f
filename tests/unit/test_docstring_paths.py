"""Every file a docstring or comment of the product's code names exists.

A module that names another by its file (``common/peer_client.py``,
``docs/faults.md``, vLLM's ``block_pool.py``) sends its reader there; a name
left behind by a rename sends them nowhere. A name is found relative to the
module's folder, the connector's root or the repository, by its path inside
vLLM's tree, or, for a bare file name, as a file of the connector or of vLLM's
tree. No name may point outside the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from harness.vllm_series import SUPPORTED, series

ROOT = Path(__file__).resolve().parents[2]
CODE = ("connector", "harness")
NAME = re.compile(r"(?<![\w./-])((?:\.\./)*(?:[\w.-]+/)*[\w-]+\.(?:py|md|toml|sh))\b")
# vLLM files the connector's modules name by their bare file name (each must be
# in vLLM's tree); any other bare name in connector/ is a connector module, so
# a module renamed without its mentions (``client.py`` for ``peer_client.py``)
# is caught even where vLLM happens to have a file of the old name.
UPSTREAM_NAMES = {"block_pool.py", "mooncake_connector.py"}


def upstream_trees() -> list[Path]:
    return sorted(
        p for p in (ROOT / "third_party").glob("vllm*") if (p / "vllm").is_dir()
    )


def names_in(path: Path) -> list[tuple[int, str]]:
    return [
        (n, m.group(1))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for m in NAME.finditer(line)
    ]


def repo_files() -> set[str]:
    found = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True
    ).stdout.split()
    return {Path(f).name for f in found}


def resolves(module: Path, name: str, known: dict[str, set[str]]) -> bool:
    """``name`` as written in ``module``: a path from its folder, the connector's
    root, the repository or a vLLM tree; or a bare name (``known``: the bare
    names each code folder may use)."""
    bases = [module.parent, ROOT / "connector", ROOT, *upstream_trees()]
    if "/" in name:  # a path: a file inside the repository, from one of the bases
        return any(
            (b / name).exists() and (b / name).resolve().is_relative_to(ROOT)
            for b in bases
        )
    folder = module.relative_to(ROOT).parts[0]
    here = (module.parent / name).exists() or (ROOT / name).exists()
    return here or name in known[folder]


@pytest.fixture(scope="module")
def known() -> dict[str, set[str]]:
    trees = upstream_trees()
    if not trees:
        pytest.skip("no vLLM tree (python build.py apply): vLLM's names unresolvable")
    upstream = {p.name for t in trees for p in t.rglob("*.py") if ".git" not in p.parts}
    assert upstream >= UPSTREAM_NAMES, UPSTREAM_NAMES - upstream
    connector = {p.name for p in (ROOT / "connector").rglob("*.py")}
    return {
        "connector": connector | UPSTREAM_NAMES,
        "harness": repo_files() | upstream,
    }


def in_a_missing_tree(name: str) -> bool:
    """A path that may be in the tree of a supported release not built here: the
    0.18.1 run of scripts/test.sh comes before 0.32.0's tree exists (its run, with
    both trees, judges these names)."""
    missing = [v for v in SUPPORTED if not series(v).tree.is_dir()]
    top = name.split("/", 1)[0]
    return bool(missing) and any((t / top).is_dir() for t in upstream_trees())


def test_every_file_a_module_names_exists(known) -> None:
    stale = [
        f"{path.relative_to(ROOT)}:{n}: {name}"
        for folder in CODE
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, name in names_in(path)
        if not resolves(path, name, known)
        and not ("/" in name and in_a_missing_tree(name))
    ]
    assert not stale, (
        "names of files that do not exist (rename them, or for a vLLM file the "
        "connector names bare, add it to UPSTREAM_NAMES):\n" + "\n".join(stale)
    )


def test_a_renamed_module_and_a_name_outside_are_found(known) -> None:
    module = ROOT / "connector" / "push" / "decode_scheduler.py"
    assert resolves(module, "peer_client.py", known)
    assert resolves(module, "common/peer_client.py", known)
    assert resolves(module, "docs/faults.md", known)
    assert resolves(module, "block_pool.py", known)
    assert not resolves(module, "client.py", known)  # vLLM has one; not this one
    assert not resolves(module, "push/client.py", known)
    netns = ROOT / "harness" / "netns.py"
    assert not resolves(netns, "../shared/cpu-runtime.md", known)
