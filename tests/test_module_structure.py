"""The package's shape: small modules with one job, and layers that import downward only.

(a) No module under ``dporl/`` is longer than ``MAX_LINES``, except the few listed in ``LONG_MODULES`` that are
    being split (the list may only shrink: a listed module that has become short fails the test too).
(b) No import cycle among ``dporl`` modules, counting imports made inside functions (they hide a cycle from the
    interpreter's start-up order, not from the design). Imports under ``if TYPE_CHECKING:`` never run and are not
    counted. The cycles in ``KNOWN_CYCLES`` are being removed (the list may only shrink); any other cycle fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dporl"
MAX_LINES = 550
LONG_MODULES: set[str] = set()
KNOWN_CYCLES: list[set[str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The dporl modules ``tree`` (module ``name``) imports anywhere in its body, functions included."""
    found: set[str] = set()

    def resolve(target: str) -> None:
        while target and target not in modules:  # `import dporl.a.b.name` of a non-module name: its module
            target = target.rpartition(".")[0]
        if target.startswith("dporl"):
            found.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:  # `from dporl.a import b`: b may be a module of its own
                resolve(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _imported(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", modules)
        for name, path in modules.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return components


def test_no_module_over_the_line_limit():
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    too_long = {path: n for path, n in lengths.items() if n > MAX_LINES and path not in LONG_MODULES}
    assert not too_long, f"modules over {MAX_LINES} lines (split them along their seams): {too_long}"
    stale = sorted(path for path in LONG_MODULES if lengths.get(path, 0) <= MAX_LINES)
    assert not stale, f"no longer over {MAX_LINES} lines (or gone): remove from LONG_MODULES: {stale}"


def test_no_import_cycle_even_through_function_level_imports():
    found = import_cycles(import_graph())
    cycles = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not cycles, f"import cycles among dporl modules (function-level imports counted): {cycles}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"no longer a cycle: remove from KNOWN_CYCLES: {gone}"


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [{"a", "b"}]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [{"a", "b", "c"}]),
    ],
)
def test_cycle_finder(graph, expected):
    assert import_cycles(graph) == expected


def test_function_level_and_relative_imports_are_edges():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from dporl.c import X\n"
        "def f():\n    from dporl.b import thing\n"
        "from . import d\n"
    )
    modules = {name: Path() for name in ("dporl", "dporl.a", "dporl.b", "dporl.c", "dporl.d")}
    assert _imported(ast.parse(source), "dporl.a", False, modules) == {"dporl.b", "dporl.d"}
