"""The package's floors: each top-level package or module imports only from its own floor or the floors below it,
and the packages form no cycle (a package-level check: two packages can import each other through different files
while every file-level import is acyclic, which ``test_import_graph.py`` cannot see).

Read from the sources (``tests/helpers/import_graph.py``: module-level, function-level and ``TYPE_CHECKING``
imports all count). A unit is a top-level sub-package (``moe``) or module (``strategy``); the root ``__init__`` and
``__main__`` are units of their own. A new unit must be given a floor here: that is the decision this test asks for.
"""

from __future__ import annotations

from collections import defaultdict

from tests.helpers.import_graph import PACKAGE, import_graph, strongly_connected, write_package

# Lowest first. Floor by floor: leaves without package imports; settings, FP8 numerics, losses and the low-level
# parallel pieces (dims, meshes, process groups, gradients); the overlap engine and the step loop; the MoE layers and
# dispatchers; what is built on them (FP8 conversion, Hugging Face models, pipeline parallelism, checkpoints); the
# validation rules and the run's processes; the orchestration that parallelises a model; the strategy; the entry
# points (callbacks, the console script, the demos, the package's public names).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("_checks", "_compat", "_install", "_noise", "registry", "step_logs", "resumable_loader"),
    ("config", "float8", "loss", "parallel"),
    ("overlap", "accumulation", "loop"),
    ("moe",),
    ("fp8", "hf", "pipeline", "checkpoint"),
    ("validation", "optim", "precision", "processes"),
    ("parallelize",),
    ("strategy", "ep_choices"),
    ("callbacks", "cli", "demo", "demo_hf", "__init__", "__main__"),
)


def unit_of(module: str) -> str:
    """``lightning_moe_overlap.moe.ep`` -> ``moe``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def unit_graph(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """``(importing unit, imported unit)`` -> the module imports that make the edge, for units that differ."""
    edges: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for module, targets in graph.items():
        for target in targets:
            if unit_of(module) != unit_of(target):
                edges[unit_of(module), unit_of(target)].append((module, target))
    return edges


def layering_problems(graph: dict[str, set[str]], floors: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every unit without a floor, every import that runs up the floors, and every cycle of units."""
    floor = {unit: level for level, units in enumerate(floors) for unit in units}
    units = {unit_of(module) for module in graph}
    problems = [f"`{unit}` has no floor: add it to FLOORS" for unit in sorted(units - set(floor))]
    edges = unit_graph(graph)
    for (low, high), imports in sorted(edges.items()):
        if low in floor and high in floor and floor[high] > floor[low]:
            problems += [f"{a} imports {b}: `{low}` (floor {floor[low]}) runs up to `{high}` (floor {floor[high]})"
                         for a, b in sorted(imports)]  # fmt: skip
    unit_edges = {unit: {b for (a, b) in edges if a == unit} for unit in units}
    problems += [f"units importing each other: {', '.join(c)}" for c in strongly_connected(unit_edges)]
    return problems


def test_the_package_keeps_its_floors():
    problems = layering_problems(import_graph(), FLOORS)
    assert problems == [], "layering (see this file's docstring):\n" + "\n".join(problems)


def test_an_upward_import_and_a_package_cycle_are_found(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "X = 1\n",
        "low/b.py": "",
        "mid/__init__.py": "",
        "mid/c.py": "from lightning_moe_overlap.low.a import X\n",
        "high.py": "def f():\n    from lightning_moe_overlap.mid import c\n",
    })
    floors = (("low",), ("mid",), ("high", "__init__"))
    assert layering_problems(import_graph(root), floors) == []
    # a function-level import from the low package up to the middle one: runs up the floors, and the two packages
    # now import each other although no module imports itself back
    (root / "low" / "b.py").write_text("def g():\n    from lightning_moe_overlap.mid.c import X\n")
    problems = layering_problems(import_graph(root), floors)
    assert problems == [
        f"{PACKAGE}.low.b imports {PACKAGE}.mid.c: `low` (floor 0) runs up to `mid` (floor 1)",
        "units importing each other: low, mid",
    ]
    (root / "extra.py").write_text("")
    assert layering_problems(import_graph(root), floors)[0] == "`extra` has no floor: add it to FLOORS"
