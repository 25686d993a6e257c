"""No module outside ``lightning_moe_overlap/_compat/`` names a private attribute of Lightning or torch.

The check parses every module with ``ast`` (names in strings and docstrings are not code) and reports:

- ``import torch._x`` / ``from torch._x import y`` / ``from torch import _x`` (and the same for Lightning);
- an attribute ``_x`` (one leading underscore, not a dunder) anywhere on a chain rooted at a name imported from
  torch or Lightning: ``torch._C``, ``dist._x``, ``F._x``, ``torch.cuda._sleep``, ``Trainer._x``;
- ``obj._x`` where ``obj`` is a name or attribute this package uses only for Lightning's or torch's objects
  (``LIBRARY_OBJECTS``: ``trainer._logger_connector``, ``self.trainer.fit_loop._x``, ``module._forward_hooks``);
- ``super()._x`` in a class that derives from a torch or Lightning class;
- ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr`` with a literal ``"_x"`` on any of the above.

``self._x`` and ``cls._x`` are the package's own state and are not reported. A hit that is fine goes into
``ALLOWED`` with the reason; everything else belongs in ``_compat/lightning.py`` or ``_compat/torch.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_moe_overlap"
LIBRARIES = frozenset({"torch", "lightning", "pytorch_lightning", "lightning_fabric"})

# Names (variables, parameters, attributes) that in this package only ever hold Lightning's or torch's objects.
LIBRARY_OBJECTS = frozenset(
    {
        # Lightning
        "trainer", "pl_module", "lightning_module", "strategy", "precision_plugin", "accelerator", "launcher",
        "checkpoint_io", "cluster_environment", "fit_loop", "epoch_loop", "automatic_optimization",
        "optim_progress", "logger", "loggers", "logger_connector", "checkpoint_connector", "callback_connector",
        # torch
        "module", "optimizer", "optimizers", "lr_scheduler", "scheduler", "work", "process_group", "pg", "store",
        "device_mesh", "mesh", "grad_fn", "stream", "event",
    }
)  # fmt: skip

# "path relative to the package:attribute" -> why this use of a private name is fine outside `_compat`.
_LAUNCHER_HOOK = (
    "Lightning's contract for a strategy that brings its own launcher: override `_configure_launcher` and set "
    "`self._launcher` (its own DDPStrategy and FSDPStrategy do the same; no public route exists)"
)
ALLOWED: dict[str, str] = {
    "strategy.py:_configure_launcher": _LAUNCHER_HOOK,
    "strategy.py:_launcher": _LAUNCHER_HOOK,
    "parallel/tp_styles.py:_apply": "torch's ParallelStyle contract: a style defines the abstract `_apply(module, "
    "device_mesh)`, which `parallelize_module` calls (torch's own styles and its docs do the same)",
}

_PRIVATE_SELF_NAME = re.compile(r"self\.(_[A-Za-z]\w*)|__setattr__\(\s*[\"'](_[A-Za-z]\w*)[\"']")


@dataclass(frozen=True)
class Hit:
    path: str  # relative to the package
    line: int
    name: str  # the private attribute or module path
    code: str  # the offending source segment

    @property
    def key(self) -> str:
        return f"{self.path}:{self.name}"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.code}"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _root(node: ast.expr) -> ast.expr:
    """The start of an attribute chain: ``torch`` for ``torch.cuda.current_stream().x[0]``."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _chain(node: ast.expr) -> list[str] | None:
    """``["torch", "nn", "Module"]`` for ``torch.nn.Module``; ``None`` for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


@functools.cache
def _private_members(klass: type) -> frozenset[str]:
    """Private methods, class attributes and instance attributes (``self._x`` in its source) of a library class."""
    names = {name for name in vars(klass) if _is_private(name)}
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):  # a C extension type: its instance attributes are not visible from Python
        return frozenset(names)
    return frozenset(names | {a or b for a, b in _PRIVATE_SELF_NAME.findall(source)})


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        self.library_names: set[str] = set()  # names bound to torch / Lightning modules and objects
        self.origins: dict[str, tuple[str, str | None]] = {}  # name -> (module, attribute) it was imported from
        self.objects = set(LIBRARY_OBJECTS)  # plus this module's variables and attributes assigned such objects
        self.inherited: list[set[str]] = []  # per enclosing class: private members of its library base classes
        self.hits: list[Hit] = []

    def check(self, tree: ast.Module) -> list[Hit]:
        for node in ast.walk(tree):  # imports anywhere bind names (approximate scoping is enough here)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.asname or alias.name.split(".")[0]
                    self.origins[name] = (alias.name if alias.asname else name, None)
                    if alias.name.split(".")[0] in LIBRARIES:
                        self.library_names.add(name)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.origins[alias.asname or alias.name] = (node.module, alias.name)
                    if node.module.split(".")[0] in LIBRARIES:
                        self.library_names.add(alias.asname or alias.name)
        for _ in range(2):  # `self._auto = trainer.fit_loop...`, then `auto = self._auto`
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if self._library_object(node.value):
                        self.objects.update(t.id if isinstance(t, ast.Name) else t.attr for t in targets
                                            if isinstance(t, (ast.Name, ast.Attribute)))  # fmt: skip
        self.visit(tree)
        return self.hits

    def _hit(self, node: ast.AST, name: str) -> None:
        code = ast.get_source_segment(self.source, node) or name
        self.hits.append(Hit(self.path, node.lineno, name, code.splitlines()[0]))

    def _library_object(self, node: ast.expr) -> bool:
        """Whether ``node`` evaluates to one of Lightning's or torch's objects (as far as the names tell)."""
        root = _root(node)
        if isinstance(root, ast.Name) and root.id in self.library_names:
            return True
        while isinstance(node, ast.Subscript):  # `self.trainer.optimizers[0]`
            node = node.value
        if isinstance(node, ast.Name):
            return node.id in self.objects
        return isinstance(node, ast.Attribute) and node.attr in self.objects

    def _library_base(self, base: ast.expr) -> bool:
        """Whether ``base`` (the object whose private attribute is read) is Lightning's or torch's."""
        is_super = isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
        if is_super:
            return bool(self.inherited) and bool(self.inherited[-1])
        return self._library_object(base)

    def _library_classes(self, bases: list[ast.expr]) -> list[type]:
        """The torch / Lightning classes in the MRO of ``bases`` (also when reached through ``_compat``)."""
        classes: list[type] = []
        for base in bases:
            chain = _chain(base)
            if not chain or chain[0] not in self.origins:
                continue
            module, attribute = self.origins[chain[0]]
            if module.split(".")[0] not in LIBRARIES and not module.startswith("lightning_moe_overlap._compat"):
                continue
            try:
                value = importlib.import_module(module)
                for part in ([attribute] if attribute else []) + chain[1:]:
                    value = getattr(value, part)
            except (ImportError, AttributeError):
                continue
            if isinstance(value, type):
                classes += [k for k in value.__mro__ if k.__module__.split(".")[0] in LIBRARIES]
        return classes

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] in LIBRARIES and any(_is_private(p) for p in parts):
                self._hit(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.module or node.level != 0 or node.module.split(".")[0] not in LIBRARIES:
            return
        if any(_is_private(p) for p in node.module.split(".")):
            self._hit(node, node.module)
        for alias in node.names:
            if _is_private(alias.name):
                self._hit(node, alias.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        inherited = set().union(*map(_private_members, self._library_classes(node.bases)))
        for item in node.body:  # overriding a private method of the library class
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in inherited:
                self._hit(item, item.name)
        self.inherited.append(inherited)
        self.generic_visit(node)
        self.inherited.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _is_private(node.attr):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if own and self.inherited and node.attr in self.inherited[-1]:
                self._hit(node, node.attr)  # a private member that the library base class defines
            elif not own and self._library_base(node.value):
                self._hit(node, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in {"getattr", "hasattr", "setattr", "delattr"}:
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
                if isinstance(name, str) and _is_private(name) and self._library_base(node.args[0]):
                    self._hit(node, name)
        self.generic_visit(node)


def private_names(source: str, path: str = "<snippet>") -> list[Hit]:
    """Every use of a private torch / Lightning name in ``source``."""
    return _Checker(path, source).check(ast.parse(source))


@functools.cache
def package_hits() -> tuple[Hit, ...]:
    hits: list[Hit] = []
    for file in sorted(PACKAGE.rglob("*.py")):
        relative = file.relative_to(PACKAGE).as_posix()
        if not relative.startswith("_compat/"):
            hits += private_names(file.read_text(), relative)
    return tuple(hits)


# --- the checker itself ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source,names",
    [
        ("import torch\ntorch._foo()", ["_foo"]),
        ("import torch\nx = torch._C._autograd.y", ["_autograd", "_C"]),
        ("import torch.distributed as dist\ndist._store_x", ["_store_x"]),
        ("import torch.nn.functional as F\nF._pad(x)", ["_pad"]),
        ("import torch\ntorch.cuda._sleep(1)", ["_sleep"]),
        ("from lightning.pytorch import Trainer\nTrainer._x", ["_x"]),
        ("def f(trainer):\n    return trainer._logger_connector", ["_logger_connector"]),
        ("class C:\n    def f(self):\n        return self.trainer.fit_loop._x", ["_x"]),
        ("def f(module):\n    return module._forward_hooks", ["_forward_hooks"]),
        ("from torch._utils import x", ["torch._utils"]),
        ("from torch.utils import _pytree", ["_pytree"]),
        ("import torch._dynamo", ["torch._dynamo"]),
        ("from lightning.fabric.utilities.distributed import _init_dist_connection", ["_init_dist_connection"]),
        ("import torch\nhasattr(torch, '_grouped_mm')", ["_grouped_mm"]),
        ("from torch import nn\nclass M(nn.Module):\n    def f(self):\n        super()._apply(1)", ["_apply"]),
        ("from torch import nn\nclass M(nn.Module):\n    def f(self):\n        return self._parameters", ["_parameters"]),
        ("from torch import nn\nclass M(nn.Module):\n    def _apply(self, fn, recurse=True):\n        pass", ["_apply"]),
        ("import lightning.pytorch as pl\nclass C(pl.Callback):\n    def _x(self):\n        pass", []),
        (
            "class L:\n    def __init__(self, trainer):\n        self._auto = trainer.fit_loop.epoch_loop.automatic_optimization"
            "\n    def f(self):\n        self._auto._skip_backward = True",
            ["_skip_backward"],
        ),
    ],
)
def test_checker_flags_private_library_names(source: str, names: list[str]) -> None:
    assert [hit.name for hit in private_names(source)] == names


@pytest.mark.parametrize(
    "source",
    [
        "class C:\n    def f(self):\n        return self._x",
        "class C:\n    @classmethod\n    def f(cls):\n        return cls._x",
        '"""torch._C._current_graph_task_id and trainer._logger_connector, in a docstring."""',
        "import torch\ns = 'torch._grouped_mm'",
        "import torch\ntorch.Tensor.__init__",
        "from lightning_moe_overlap._compat import torch as torch_compat\ntorch_compat.grouped_mm",
        "from lightning_moe_overlap._compat import lightning as pl_compat\npl_compat._SubprocessScriptLauncher",
        "def f(handle):\n    return handle._splits",
        "class C:\n    def f(self):\n        super()._setup()",
        "from torch import nn\nclass M(nn.Module):\n    def f(self):\n        return self._x",
    ],
)
def test_checker_ignores_own_state_and_text(source: str) -> None:
    assert private_names(source) == []


# --- the package -------------------------------------------------------------------------------------------------


def test_allow_lists_have_no_stale_entries() -> None:
    keys = {hit.key for hit in package_hits()}
    stale = sorted(set(ALLOWED) - keys)
    assert not stale, f"allow-list entries that no longer match a private name in the package: {stale}; remove them"


def test_no_private_library_names_outside_compat() -> None:
    hits = [hit for hit in package_hits() if hit.key not in ALLOWED]
    assert not hits, (
        "private torch / Lightning names outside lightning_moe_overlap/_compat/ (route each through a function in "
        "_compat/torch.py or _compat/lightning.py with a test, or add it to ALLOWED with the reason):\n"
        + "\n".join(map(str, hits))
    )
