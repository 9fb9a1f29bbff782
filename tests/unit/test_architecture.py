"""The package's layers, checked: imports point one way (a lower layer never imports a higher one), production
code never imports the test peers, and no two modules import each other (directly or round a circle).

Read with ``ast`` (every import, also the lazy ones inside functions), so nothing is executed. The layers are the
ones ``docs/architecture.md`` draws; change both together.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import ROOT

PKG = ROOT / "kvcap"

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"__init__", "errors"}),
    frozenset({"units", "aio", "procs"}),
    frozenset({"specs"}),
    frozenset({"workload", "plan", "rundir"}),
    frozenset({"telemetry", "serve"}),
    frozenset({"analysis"}),
    frozenset({"loadgen", "sim", "report", "testing", "audit"}),
    frozenset({"ab", "calibrate", "search"}),
    frozenset({"cli"}),
    frozenset({"__main__"}),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
DATA_ONLY = {"scenarios"}
"""Packages that hold data files, not code."""


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    """``kvcap.sim.engine`` → ``sim``; ``kvcap`` → ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        and isinstance(test.value, ast.Name) and test.value.id == "typing")


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(imported kvcap module, line, at module level?) for every import in a file. An import under a
    module-level ``if TYPE_CHECKING:`` counts as module level: the type checker (and mypyc, which compiles
    against those types) follows it, so it ties the two modules together as much as a plain import does."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    top |= {id(node) for stmt in tree.body if isinstance(stmt, ast.If) and _is_type_checking(stmt.test)
            for node in stmt.body}
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names if a.name.split(".")[0] == "kvcap"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] == "kvcap":
                out.append((target, node.lineno, id(node) in top))
    return out


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def test_every_package_part_has_a_layer():
    parts = {part_of(m) for m in all_modules()} - DATA_ONLY
    assert parts - RANK.keys() == set(), "add the new package or module to LAYERS (and docs/architecture.md)"


def test_imports_point_down_the_layers():
    bad = []
    for module, path in all_modules().items():
        src = part_of(module)
        for target, line, _ in imports_of(path):
            dst = part_of(target)
            if dst == src or dst in DATA_ONLY:
                continue
            if RANK[dst] >= RANK[src]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {src} (layer {RANK[src]}) imports {target} "
                           f"(layer {RANK[dst]})")
    assert not bad, "\n".join(bad)


def test_production_code_never_imports_the_test_peers():
    bad = [f"{path.relative_to(ROOT)}:{line}: {target}"
           for module, path in all_modules().items() if part_of(module) != "testing"
           for target, line, _ in imports_of(path) if part_of(target) == "testing"]
    assert not bad, "\n".join(bad)


def import_cycle(modules: dict[str, Path]) -> list[str] | None:
    """The first circle of module-level imports among ``modules`` (name → file), as ``a → b → … → a``; None if
    there is none."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for target, _, top in imports_of(path):
            while target not in modules and "." in target:  # ``from kvcap.x import name`` of a non-module name
                target = target.rpartition(".")[0]
            if top and target in modules and target != module and not module.startswith(target + "."):
                graph[module].add(target)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n):], n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(modules):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycles_between_modules():
    """Module-level imports only, ``if TYPE_CHECKING:`` ones included (a lazy import inside a function cannot
    form a cycle at import time, but the layer test above still holds it to the layers)."""
    cycle = import_cycle(all_modules())
    if cycle:
        pytest.fail("import cycle: " + " → ".join(cycle))


def test_the_checker_sees_a_violation(tmp_path):
    """The walker itself: a relative import and a lazy import are both found."""
    pkg = tmp_path / "kvcap" / "specs"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("from ..sim import engine\n\ndef g():\n    import kvcap.cli\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        found = imports_of(f)
    finally:
        ROOT = old
    assert ("kvcap.sim", 1, True) in found and ("kvcap.cli", 4, False) in found


def test_the_checker_sees_a_cycle_under_type_checking(tmp_path):
    """A back edge hidden under ``if TYPE_CHECKING:`` (either spelling) closes a circle the checker reports; the
    same import inside a function does not."""
    pkg = tmp_path / "kvcap" / "sim"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvcap.sim.b import B\n")
    (pkg / "b.py").write_text("import typing\n\nif typing.TYPE_CHECKING:\n    from kvcap.sim.c import C\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from kvcap.sim.a import A\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        modules = {module_name(p): p for p in sorted((tmp_path / "kvcap").rglob("*.py"))}
        found = import_cycle(modules)
        (pkg / "c.py").write_text("def g():\n    from kvcap.sim.a import A\n")
        lazy = import_cycle(modules)
    finally:
        ROOT = old
    assert found == ["kvcap.sim.a", "kvcap.sim.b", "kvcap.sim.c", "kvcap.sim.a"]
    assert lazy is None
