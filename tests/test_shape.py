"""Shape of the library, read with `ast` (DESIGN decision 10, STYLE habits 1 and 8).

* Every import counts: module level, inside functions and under `TYPE_CHECKING`.
  The import graph has no cycle.
* The live code is split by the process that runs it. A side (`producer`, `leader`,
  `worker`, `child`, `exporter`) imports its own package, `wire`, `store`, the pure layers and
  the support modules only; `wire` and `store` import no side; `plugin.py`, `cli`
  and `demo` compose the sides.
* No package holds more than a quarter of the lines; modules stay under 400 lines,
  functions under 40 (outside `cli` and `demo`, whose commands read as scripts), and
  no class has more than 30 methods, counting those of its in-package bases.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "celery_ojs_ml"
NAME = "celery_ojs_ml"
PURE = frozenset({"spec", "capabilities", "matching", "allocator", "scheduler"})
SUPPORT = frozenset({"errors", "lru", "checkpoint", "celery_internals"})
SIDES = frozenset({"producer", "leader", "worker", "child", "exporter"})
MAY_IMPORT = {
    **{side: {side, "wire", "store"} | PURE | SUPPORT for side in SIDES},
    "wire": {"wire", "errors", "lru"} | PURE,
    "store": {"store", "wire", "errors", "lru"} | PURE,
    "checkpoint": {"checkpoint", "store", "wire", "errors", "lru"} | PURE,
}
MAX_SHARE, MAX_MODULE, MAX_FUNCTION, MAX_METHODS = 0.25, 400, 40, 30


@cache
def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _target(name: str) -> str | None:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules():
        parts.pop()
    return ".".join(parts) if parts else None


def _imported(module: str, path: Path) -> Iterator[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in modules() else base


@cache
def graph() -> dict[str, frozenset[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules().items():
        for name in _imported(module, path):
            if name.startswith(NAME) and (target := _target(name)) and target != module:
                edges[module].add(target)
    return {m: frozenset(edges[m]) for m in modules()}


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph():
        if root in index:
            continue
        work = [(root, iter(sorted(graph()[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph()[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles() == []


def test_the_graph_sees_function_level_and_type_checking_imports() -> None:
    assert "celery_ojs_ml.checkpoint" in graph()["celery_ojs_ml.cli.jobs"]  # inside a function
    assert "celery_ojs_ml.plugin" in graph()["celery_ojs_ml"]  # under TYPE_CHECKING


def test_each_side_imports_only_wire_store_and_the_pure_layers() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        if _part(module) in MAY_IMPORT
        for target in targets
        if _part(target) not in MAY_IMPORT[_part(module)]
    ]
    assert wrong == []


def test_no_package_holds_more_than_a_quarter_of_the_lines() -> None:
    lines: dict[str, int] = defaultdict(int)
    for module, path in modules().items():
        part = _part(module)
        lines[part if (PACKAGE / part).is_dir() else ""] += len(path.read_text().splitlines())
    total = sum(lines.values())
    assert {p: round(n / total, 3) for p, n in lines.items() if n > MAX_SHARE * total} == {}


def test_no_module_is_over_400_lines() -> None:
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def _functions() -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield module, node


def test_no_function_is_over_40_lines_outside_the_cli_and_the_demo() -> None:
    long = {
        f"{module}.{node.name}": size
        for module, node in _functions()
        if _part(module) not in ("cli", "demo")
        and (size := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION
    }
    assert long == {}


def _classes() -> dict[str, tuple[set[str], list[str]]]:
    found: dict[str, tuple[set[str], list[str]]] = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {
                    b.name
                    for b in node.body
                    if isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef)
                }
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                found.setdefault(node.name, (methods, bases))
    return found


def _methods(name: str, classes: dict[str, tuple[set[str], list[str]]]) -> set[str]:
    own, bases = classes.get(name, (set(), []))
    return own.union(*(_methods(b, classes) for b in bases if b in classes and b != name))


def test_no_class_has_more_than_30_methods_counting_its_in_package_bases() -> None:
    classes = _classes()
    big = {n: k for n in classes if (k := len(_methods(n, classes))) > MAX_METHODS}
    assert big == {}
