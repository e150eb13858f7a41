"""No two modules of the package import each other, directly or through others, even inside functions; and the
layers of the package (its subpackages) import only from the layers below them, in the order the architecture page
gives."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tatblimp_callback"

# Bottom to top, as docs/architecture.md tells them: the subpackages, and two modules of the package's top (the
# custom-loop API, and the command line that wires every sub-command); "top" holds __init__ and __main__.
LAYERS = [
    "reading",
    "tokenized",
    "engine",
    "results",
    "evaluation",
    "chat",
    "commands",
    "reports",
    "harness",
    "training",
    "cli",
    "top",
]


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module by dotted name below the package: ``engine.scoring``; a subpackage's own is ``engine``, the top's ``__init__``."""
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def package_imports(source: str, module_names: set[str], current: str = "") -> set[str]:
    """The package modules that ``source`` (the module ``current``) imports anywhere (module level or inside functions)."""
    here = current.split(".")[:-1] if current and current != "__init__" else []
    if current in module_names and (PACKAGE / current.replace(".", "/") / "__init__.py").exists():
        here = current.split(".")  # a subpackage's own module: its imports are relative to itself

    def known(parts: list[str]) -> str:
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in module_names:
                return ".".join(parts[:end])
        return "__init__"

    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
            if node.module:
                imported.add(known([*base, *node.module.split(".")]))
            else:
                imported |= {known([*base, alias.name]) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tatblimp_callback":
            parts = node.module.split(".")[1:]
            imported |= {known([*parts, alias.name]) for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tatblimp_callback":
                    imported.add(known(parts[1:]))
    imported.discard(current)
    return imported


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    graph = {name: package_imports(path.read_text(encoding="utf-8"), set(modules), name) for name, path in modules.items()}
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


def layer_of(module: str) -> str:
    first = module.split(".")[0]
    return first if first in LAYERS else "top"


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"cli", "commands.sweep", "commands.loading", "tokenized.tokenization", "engine.scoring"} <= set(graph)
    assert "commands.loading" in graph["cli"] and "commands.loading" in graph["commands.sweep"]
    assert "engine.scoring" in graph["evaluation"] and "reading.data" in graph["__init__"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_each_layer_imports_only_from_the_layers_below_it():
    graph = import_graph()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        # the package's __init__ is loaded first whatever is imported: modules read __version__ from it
        if target != "__init__" and LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(module))
    )
    assert not upward, "imports from a higher layer: " + ", ".join(upward)
    subpackages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert subpackages == set(LAYERS) - {"evaluation", "cli", "top"}


def test_the_cycle_finder_finds_a_hidden_cycle():
    sources = {
        "a": "from .b import f\n",
        "b": "def f():\n    from .c import g\n    return g\n",
        "c": "def g():\n    from . import a\n",
    }
    graph = {name: package_imports(text, set(sources), name) for name, text in sources.items()}
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_relative_imports_are_resolved_from_the_module_s_own_subpackage():
    modules = {"engine.scoring", "engine.packing", "results.metrics", "__init__", "engine"}
    source = "from .packing import x\nfrom ..results.metrics import y\nfrom .. import __version__\n"
    assert package_imports(source, modules, "engine.scoring") == {"engine.packing", "results.metrics", "__init__"}
