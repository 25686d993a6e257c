"""The package's import graph, read from the sources with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` of a ``lightning_moe_overlap`` module counts, at module level, inside functions and under
``if TYPE_CHECKING:``.

How an import becomes an edge:

- ``import lightning_moe_overlap.a.b`` and ``from lightning_moe_overlap.a.b import name`` are edges to ``a/b.py``
  (or ``a/b/__init__.py`` when ``a.b`` is a package).
- ``from lightning_moe_overlap.a import b`` where ``b`` is a submodule is an edge to ``a/b.py``; where ``b`` is a
  name that ``a/__init__.py`` defines or re-exports, it is an edge to ``a/__init__.py``.
- The parent packages that Python runs on the way to a submodule are not edges: a submodule is imported from
  inside its package's ``__init__`` while that ``__init__`` is already in ``sys.modules``. A module that names
  its own package (``from lightning_moe_overlap.a import name`` inside ``a/x.py``) is an edge to
  ``a/__init__.py``, and it is a cycle when that ``__init__`` imports ``a/x.py`` back: a real one, since which
  of the two runs first decides whether ``name`` exists yet.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_moe_overlap

PACKAGE = "lightning_moe_overlap"
ROOT = Path(lightning_moe_overlap.__file__).parent


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    files: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module name of ``from <node.module> import ...``, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that ``module`` imports anywhere in its file."""
    targets: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, is_package)
            if source not in modules:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else source)
    targets.discard(module)
    return targets


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (see the module docstring for what counts)."""
    files = module_files(root)
    return {module: _imports(module, path, set(files)) for module, path in files.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (Tarjan's components of more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per group of modules that import each other, each as a closed path."""
    return [cycle_in(graph, set(component)) for component in strongly_connected(graph)]


def cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest closed path through the component's first module (breadth-first, inside the component)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if succ not in parent:
                    parent[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / PACKAGE
