"""The first-party import graph has no loop, counting imports inside functions too.

An import placed inside a function to dodge a cycle hides the loop from Python but not from this graph: every
``import``/``from ... import`` of the tiers' own modules is an edge, wherever it sits, except those under
``if TYPE_CHECKING:`` (type-only, never executed). The graph is read from the source files, so it holds for
whatever layout the packages have. Run as a script it prints the loops and the function-local imports.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("render_service", "token_engine", "splitserve_common", "splitserve_demo")


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the first-party packages."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it runs inside a function; type-only blocks left out."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), in_function)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _imports(node, inner)


def _targets(node: ast.Import | ast.ImportFrom, importer: str, modules: dict[str, Path]) -> set[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer.split(".")
            if modules[importer].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    found: set[str] = set()
    for name in names:
        # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c: each package on the way is an edge
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix != importer:
                found.add(prefix)
    return found


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(module -> modules it imports, [(module, imported, line) for every function-local first-party import])."""
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    local: list[tuple[str, str, int]] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node, in_function in _imports(tree):
            targets = _targets(node, name, modules)
            # a package's own __init__ is not a loop of the module importing its sibling
            targets = {t for t in targets if not name.startswith(t + ".")}
            graph[name] |= targets
            if in_function:
                local.extend((name, target, node.lineno) for target in sorted(targets))
    return graph, local


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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


def test_no_import_loop() -> None:
    graph, _ = import_graph()
    assert len(graph) > 100  # the walk found the packages
    assert loops(graph) == []


def test_graph_sees_a_loop() -> None:
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert loops({"a": {"b"}, "b": set()}) == []


def test_function_local_and_type_only_imports_are_read() -> None:
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.typed\n"
              "def f():\n    import x.local\nimport x.top\n")
    seen = [(node.names[0].name, local) for node, local in _imports(ast.parse(source))
            if isinstance(node, ast.Import)]
    assert seen == [("x.local", True), ("x.top", False)]


if __name__ == "__main__":
    graph, local = import_graph()
    for loop in loops(graph):
        print("loop:", " ".join(loop))
    in_loops = {m for loop in loops(graph) for m in loop}
    for module, target, line in local:
        mark = "  (in a loop)" if module in in_loops and target in in_loops else ""
        print(f"function-local: {module}:{line} -> {target}{mark}")
    print(f"{len(graph)} modules, {len(loops(graph))} loops, {len(local)} function-local first-party imports",
          file=sys.stderr)
