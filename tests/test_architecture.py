"""The package's floors hold: every import points down, as docs/architecture.md draws it.

The page's table is the one source: for each row, its floor, its files and folders, and the
units they import. The test reads every import of the code with ``ast`` (those inside
functions too; nothing is imported) and fails on an import that points up, on an import the
page does not list or a listed one the code no longer makes, on a module or folder the page
does not place, on a cycle between modules, and on a module over about 500 lines.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "burstmpi"
PAGE = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| (\d+) \| ([^|]+) \| .* \| ([^|]+) \|$")


def _unit_name(text):
    """``bench/`` -> bench, ``api.py`` -> api, ``__init__.py`` -> __init__."""
    return text.strip().strip("`").rstrip("/").removesuffix(".py")


def table():
    """{unit: (floor, documented imports)} from the page's table; a row naming several units
    gives each the row's floor and imports."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        m = ROW.match(line)
        if not m:
            continue
        floor = int(m.group(1))
        units = [_unit_name(u) for u in re.findall(r"`([^`]+)`", m.group(2))]
        listed = re.sub(r"\([^)]*\)", "", m.group(3))  # "(what for)" notes are not names
        imported = {_unit_name(u) for u in re.findall(r"`([^`]+)`", listed)}
        row = (floor, imported)  # one object per row: its units share it
        for u in units:
            rows[u] = row
    assert rows, f"no table rows found in {PAGE}"
    return rows


def _module(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(dotted):
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports():
    """{(importer, imported)} over burstmpi's modules, each imported name resolved to the
    module that defines it (``from ._ring import flat`` is ``burstmpi._ring.flat``)."""
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


def test_the_page_places_every_module_and_folder():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if p.suffix == ".py" or (p / "__init__.py").is_file()}
    placed = set(table())
    assert units == placed, (f"missing from docs/architecture.md's table: {sorted(units - placed)}; "
                             f"on the page but not in burstmpi/: {sorted(placed - units)}")


def test_imports_point_down_and_are_the_ones_the_page_lists():
    rows = table()
    made = {}
    for a, b in imports():
        ua, ub = unit(a), unit(b)
        if ua != ub:
            made.setdefault(ua, {}).setdefault(ub, f"{a} imports {b}")
    wrong = []
    for ua, targets in sorted(made.items()):
        for ub, example in sorted(targets.items()):
            if rows[ub][0] > rows[ua][0]:
                wrong.append(f"up: {example} (floor {rows[ua][0]} -> {rows[ub][0]})")
    for u, (floor, documented) in sorted(rows.items()):
        group = {v for v, row in rows.items() if row is rows[u]}  # units sharing the row
        actual = set().union(*(made.get(v, {}) for v in group)) - group
        if actual != documented:
            wrong.append(f"docs/architecture.md, row of {u}: lists {sorted(documented)}, the code imports "
                         f"{sorted(actual)}")
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

    # A package's __init__ re-exports its modules: importing a name from the package is not a
    # cycle through them (the floors above catch an __init__ that imports upward).
    cycles = [f"{a} -> {b}" for a, b in sorted(edges)
              if not (ROOT.joinpath(*b.split(".")) / "__init__.py").is_file() and reaches(b, a)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_over_about_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 525}
    assert not long, f"split these (one sitting's reading is about 500 lines): {long}"


BELOW_THE_PLAN = ("_ring", "_transport", "_backends", "masks")
PLAN_WORDS = {"plan", "BurstAttention", "KVCache"}  # names (and attributes: `x.plan`) that would hold or make a plan
PLAN_ATTRIBUTES = {"runtime", "last_stats", "last_call", "_rings", "_heads", "head_parallel"}  # only a plan has them


def plan_uses(path):
    """Where the module at ``path`` takes or touches a plan: a parameter, variable or name
    ``plan`` (or the plan classes), or an attribute only a plan has. Imports are the other
    test's."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
                if arg.arg in PLAN_WORDS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} takes `{arg.arg}`")
        elif isinstance(node, ast.Name) and node.id in PLAN_WORDS:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses `{node.id}`")
        elif isinstance(node, ast.Attribute) and (node.attr in PLAN_ATTRIBUTES or node.attr in PLAN_WORDS):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads `.{node.attr}`")
    return found


def test_nothing_below_the_plan_takes_or_touches_one():
    """The ring, transports, backends and masks get a call's context (``ring.context.Call``)
    and their own arguments, never the plan: a dependency that points up without an import
    (``tests/ring/test_call_context.py`` watches a plan's attribute reads at run time)."""
    found = [f for d in BELOW_THE_PLAN for p in sorted((PACKAGE / d).rglob("*.py")) for f in plan_uses(p)]
    assert not found, "code below the plan takes or touches one:\n" + "\n".join(found)
