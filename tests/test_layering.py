"""Packages import only downwards: runtime at the bottom, then chunks, stores and methods, then the
engine, then eval, tuning, training and the server, then the CLI. Every import counts, including those inside functions."""

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
    {"eval", "train", "server", "tuning"},
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
        if isinstance(node, ast.Import):
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
