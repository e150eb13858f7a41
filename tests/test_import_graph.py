"""No two modules of the package import each other, directly or through others, even inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tatblimp_callback"


def package_imports(source: str, module_names: set[str]) -> set[str]:
    """The package modules that ``source`` imports anywhere (module level or inside functions)."""
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import y / from . import x
            if node.module:
                imported.add(node.module.split(".")[0])
            else:
                imported |= {alias.name if alias.name in module_names else "__init__" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tatblimp_callback"):
            parts = node.module.split(".")
            imported.add(parts[1] if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tatblimp_callback":
                    imported.add(parts[1] if len(parts) > 1 else "__init__")
    return imported


def import_graph() -> dict[str, set[str]]:
    modules = {path.stem: path for path in PACKAGE.glob("*.py")}
    graph = {name: package_imports(path.read_text(encoding="utf-8"), set(modules)) for name, path in modules.items()}
    unknown = {name: targets - set(modules) for name, targets in graph.items() if targets - set(modules)}
    assert not unknown, f"imports of modules that do not exist: {unknown}"
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of module names (first == last), or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        path = [*path, node]
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target, path)):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"cli", "sweep", "loading", "tokenization"} <= set(graph)
    assert "loading" in graph["cli"] and "loading" in graph["sweep"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_hidden_cycle():
    sources = {
        "a": "from .b import f\n",
        "b": "def f():\n    from .c import g\n    return g\n",
        "c": "def g():\n    from . import a\n",
    }
    graph = {name: package_imports(text, set(sources)) for name, text in sources.items()}
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
