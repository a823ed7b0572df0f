"""connector/ imports its own modules relatively, never by the absolute name they
have once placed into vLLM's tree: the same files then run inside the tree and are
followed by editors and import-graph tools in the repository."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLACED = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext"


def absolute_overlay_imports(root: Path) -> list[str]:
    """``file:line`` of every import of the placed overlay by its absolute name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n == PLACED or n.startswith(PLACED + ".") for n in names):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_the_connector_imports_its_own_modules_relatively():
    found = absolute_overlay_imports(ROOT / "connector")
    assert found == [], (
        f"import these relatively (from ..common.config import ...): {found}"
    )


def test_an_absolute_import_of_the_overlay_is_found(tmp_path):
    pkg = tmp_path / "connector"
    pkg.mkdir()
    (pkg / "a.py").write_text(f"from {PLACED}.common.config import ExtConfig\n")
    (pkg / "b.py").write_text("from .common.config import ExtConfig\n")
    assert absolute_overlay_imports(pkg) == ["connector/a.py:1"]
