"""The package's floors (docs/architecture.md) hold: every import points down, and no
module imports another that imports it back, lazy imports inside functions included.

Read from the source with ``ast``; nothing is imported.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "burstmpi"

# Each unit (a top-level module or a subpackage) and its floor, as docs/architecture.md draws them.
FLOORS = {
    "bench": 7, "model": 7,
    "api": 6, "decode": 6, "torch": 6, "jax": 6,
    "plan": 5, "heads": 5,
    "runtime": 4,
    "backends": 3, "ring": 3,
    "validate": 2, "reference": 2,
    "transport": 1,
    "gpu": 0, "masks": 0, "interop": 0, "config": 0,
}
# Imports between units of one floor, each the one way it may go.
SIDEWAYS = {("plan", "heads"), ("model", "bench")}
# The package's face re-exports, and the command alias runs gpu/kernelcheck.py: above every floor.
FACES = {"__init__", "kernelcheck"}


def _module(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(dotted):
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports():
    """{(importer, imported)} over burstmpi's modules, each imported name resolved to the
    module that defines it (``from .ring import flat`` is ``burstmpi.ring.flat``)."""
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        me = _module(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if not target.startswith("burstmpi"):
                    continue
                while not _exists(target):
                    target = target.rpartition(".")[0]
                if target != me:
                    edges.add((me, target))
    return edges


def unit(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_floor():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert units - FACES == set(FLOORS), "give each new module or folder a floor (and a row in docs/architecture.md)"


def test_imports_point_down():
    wrong = []
    for a, b in sorted(imports()):
        ua, ub = unit(a), unit(b)
        if ua == ub or ua in FACES or ub == "__init__":
            continue
        if FLOORS[ub] > FLOORS[ua] or (FLOORS[ub] == FLOORS[ua] and (ua, ub) not in SIDEWAYS):
            wrong.append(f"{a} (floor {FLOORS[ua]}) imports {b} (floor {FLOORS[ub]})")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_back():
    edges = imports()
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        return False

    # A package's __init__ that re-exports its modules is not a cycle through them.
    cycles = [f"{a} -> {b}" for a, b in sorted(edges)
              if not b.endswith(("burstmpi", "__init__")) and _module_is_not_package(b) and reaches(b, a)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _module_is_not_package(dotted):
    return not (PACKAGE.parent.joinpath(*dotted.split(".")) / "__init__.py").is_file()


def test_no_module_over_about_500_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 525}
    assert not long, f"split these (one sitting's reading is about 500 lines): {long}"
