"""The package's module graph has no cycle.

Read from the sources by ``tests/helpers/import_graph.py``, whose docstring says which imports count and how an
import becomes an edge.
"""

from __future__ import annotations

import ast

from tests.helpers.import_graph import (
    PACKAGE,
    ROOT,
    cycle_in,
    module_files,
    write_package,
    find_cycles,
    import_graph,
    strongly_connected,
)


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    found = [
        f"{' -> '.join(cycle_in(graph, set(component)))}  (modules importing each other: {', '.join(component)})"
        for component in strongly_connected(graph)
    ]
    assert not found, "import cycles (see this file's docstring for what counts):\n" + "\n".join(found)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "from lightning_moe_overlap.a import A\n",
        "a/__init__.py": "from lightning_moe_overlap.a.x import A\n",
        "a/x.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from lightning_moe_overlap.b import B\n"
            "def f():\n    import lightning_moe_overlap.c\n"
            "from . import y\nfrom ..b import z\nA = 1\n"
        ),
        "a/y.py": "",
        "b/__init__.py": "B = 1\n",
        "b/z.py": "",
        "c.py": "import os\n",
    })
    graph = import_graph(root)
    assert graph[PACKAGE] == {f"{PACKAGE}.a"}
    assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.a.x"}
    assert graph[f"{PACKAGE}.a.x"] == {f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.a.y", f"{PACKAGE}.b.z"}
    assert find_cycles(graph) == []


def test_a_submodule_naming_its_own_package_that_imports_it_back_is_a_cycle(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "from lightning_moe_overlap.a.x import X\nY = 1\n",
        "a/x.py": "X = 1\n",
        "a/w.py": "from lightning_moe_overlap.a import Y\n",  # __init__ does not import w: no cycle
        "b.py": "def f():\n    from lightning_moe_overlap.a.x import X\n",
        "c.py": "from lightning_moe_overlap.b import f\n",
    })
    assert find_cycles(import_graph(root)) == []
    (root / "a" / "x.py").write_text("from lightning_moe_overlap.a import Y\nX = 1\n")
    (root / "b.py").write_text("def f():\n    from lightning_moe_overlap.c import g\n")
    cycles = find_cycles(import_graph(root))
    assert cycles == [
        [f"{PACKAGE}.a", f"{PACKAGE}.a.x", f"{PACKAGE}.a"],
        [f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.b"],
    ]


def test_only_the_console_script_parses_command_lines() -> None:
    """``argparse`` and the ``cli`` package are imported by the console script's modules only (``cli/``,
    ``__main__.py``): a library module (a checkpoint converter, the HF export) offers functions, and each subcommand
    is a module of ``cli/`` that parses its arguments and calls them."""
    offenders = []
    for module, path in module_files(ROOT).items():
        if module.startswith(f"{PACKAGE}.cli") or module == f"{PACKAGE}.__main__":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [f"{module}: {n}" for n in names if n == "argparse" or n.startswith(f"{PACKAGE}.cli")]
    assert offenders == [], offenders
