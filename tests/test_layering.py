"""Packages import only downwards: runtime at the bottom, then chunks, stores and methods, then the
engine, then eval, tuning and the server, then training, then the CLI. Every import counts, including
those inside functions and `importlib.import_module` calls on a constant name; and no two packages
import each other, even within one layer (a cycle between packages is a cycle however it is layered)."""

from __future__ import annotations

import ast
from pathlib import Path

import cachetune

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS = [
    {"errors", "config", "lru", "atomic"},  # leaf modules: no cachetune imports
    {"model"},
    {"runtime"},
    {"chunks", "c2kv", "kvlink", "blockattn"},
    {"store"},
    {"methods"},
    {"engine"},
    {"eval", "server", "tuning"},
    {"train", "vllm"},
    {"cli"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
ROOT = Path(cachetune.__file__).parent


def _imports(path: Path, root: Path):
    """(line, imported module) for every import in `path`, relative imports resolved."""
    package = ".".join(("cachetune", *path.relative_to(root).with_suffix("").parts))
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and _called_name(node.func) == "import_module" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base == "cachetune":  # `from cachetune import methods` names subpackages
                yield from ((node.lineno, f"cachetune.{alias.name}") for alias in node.names)
            else:
                yield node.lineno, base


def _called_name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def layering_violations(root: Path) -> list[str]:
    """Every import in the package tree at `root` that goes to a layer above its module's own."""
    violations = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root)
        if where == Path("__init__.py"):
            continue  # the package facade re-exports the public API from every layer
        own = where.parts[0].removesuffix(".py")
        if own not in RANK:
            violations.append(f"{where}: package {own!r} has no layer in LAYERS")
            continue
        for line, module in _imports(path, root):
            if module != "cachetune" and not module.startswith("cachetune."):
                continue
            target = _layer(module)
            if module == "cachetune" or target not in RANK:
                violations.append(f"{where}:{line} imports {module} (not a layer)")
            elif RANK[target] > RANK[own]:
                violations.append(f"{where}:{line} ({own}) imports {module} ({target}, above)")
    return violations


def package_cycles(root: Path) -> list[str]:
    """Every cycle of imports between the top-level packages (and modules) of the tree at `root`,
    each as "a -> b -> ... -> a", found by a depth-first search of the package import graph."""
    edges: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root)
        if where == Path("__init__.py"):
            continue
        own = where.parts[0].removesuffix(".py")
        for _, module in _imports(path, root):
            if module.startswith("cachetune.") and _layer(module) != own:
                edges.setdefault(own, set()).add(_layer(module))
    cycles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for target in sorted(edges.get(node, ())):
            if target in path:
                cycle = path[path.index(target):] + [target]
                if frozenset(cycle) not in done:
                    done.add(frozenset(cycle))
                    cycles.append(" -> ".join(cycle))
            elif target not in finished:
                visit(target, [*path, target])
        finished.add(node)

    finished: set[str] = set()
    for start in sorted(edges):
        if start not in finished:
            visit(start, [start])
    return cycles


def test_no_module_imports_a_layer_above_its_own():
    violations = layering_violations(ROOT)
    assert not violations, "\n".join(violations)


def test_the_layering_check_reports_upward_and_unknown_imports(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "probe.py").write_text("def f():\n    from ..engine.engine import Engine\n")
    (tmp_path / "chunks").mkdir()
    (tmp_path / "chunks" / "ok.py").write_text("from cachetune.runtime.forward import forward_active\n")
    (tmp_path / "web.py").write_text("import os\n")
    assert layering_violations(tmp_path) == [
        "runtime/probe.py:2 (runtime) imports cachetune.engine.engine (engine, above)",
        "web.py: package 'web' has no layer in LAYERS",
    ]


def test_no_two_packages_import_each_other():
    cycles = package_cycles(ROOT)
    assert not cycles, "\n".join(cycles)


def test_the_cycle_check_finds_a_cycle_within_one_layer_and_through_import_module(tmp_path):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.py").write_text("import importlib\nm = importlib.import_module('cachetune.server.app')\n")
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "app.py").write_text("def f():\n    from cachetune.tuning.search import search\n")
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "search.py").write_text("from ..eval import report\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.py").write_text("from cachetune.runtime import forward\n")
    assert package_cycles(tmp_path) == ["eval -> server -> tuning -> eval"]
    assert layering_violations(tmp_path) == ["model/a.py:1 (model) imports cachetune.runtime (runtime, above)"]
