"""Shape: the pure layers import no Celery, kombu, billiard or Redis, and imports point one way.

spec -> capabilities -> matching -> allocator -> scheduler: a module may import
its own layer and the layers before it, never a later one, and never the
integration layer. (DESIGN.md, "Layers"; `capabilities.probe` and
`capabilities.profiles` are the layer's only I/O: NVML, psutil and files.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "celery_ojs_ml"
ORDER = ("spec", "capabilities", "matching", "allocator", "scheduler")
FORBIDDEN = (
    "celery",
    "kombu",
    "billiard",
    "redis",
    "celery_ojs_ml.plugin",
    "celery_ojs_ml.producer",
    "celery_ojs_ml.leader",
    "celery_ojs_ml.worker",
    "celery_ojs_ml.child",
)


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def modules() -> list[tuple[str, Path]]:
    return [(layer, p) for layer in ORDER for p in sorted((PACKAGE / layer).rglob("*.py"))]


@pytest.mark.parametrize(
    ("layer", "path"), modules(), ids=lambda v: str(v).split("celery_ojs_ml/")[-1]
)
def test_a_pure_module_imports_no_celery_and_no_later_layer(layer: str, path: Path) -> None:
    rank = ORDER.index(layer)
    for name in imports(path):
        assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), (
            f"{path.name} imports {name}"
        )
        parts = name.split(".")
        if parts[0] == "celery_ojs_ml" and len(parts) > 1 and parts[1] in ORDER:
            assert ORDER.index(parts[1]) <= rank, f"{layer}/{path.name} imports later {name}"


def test_the_import_reader_sees_imports() -> None:
    found = imports(PACKAGE / "allocator" / "core.py")
    assert {"celery_ojs_ml.capabilities", "celery_ojs_ml.matching"} <= found
    assert "celery" in imports(PACKAGE / "worker" / "core.py") | {
        n.split(".")[0] for n in imports(PACKAGE / "worker" / "core.py")
    }
