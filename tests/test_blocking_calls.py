"""Nothing in burstmpi blocks where the watchdog cannot end it (issue 52).

Every wait on other ranks must end within its deadline (``burstmpi._transport.watchdog``).
Two kinds of MPI call defeat that:

- mpi4py's pickled collectives (``comm.allreduce(x)``, ``comm.bcast(x)``, ...) block inside
  MPI, and its reductions hold the GIL while they do on their first call on a communicator
  (measured with mpi4py 4.1.2: ``allreduce``, ``reduce``, ``scan`` and ``exscan``, whatever
  the operation; ``allgather``, ``gather``, ``bcast``, ``scatter``, ``alltoall``, ``barrier``
  and the buffer collectives let the GIL go), so not even the monitor thread can end them.
  burstmpi uses the watchdog's (``watchdog.allgather(comm, x, timeout, what)``, ...) or a
  ``watchdog.GuardedComm``, whose methods of those names are the watchdog's.
- blocking buffer collectives and the calls that make communicators or shared windows
  (``Barrier``, ``Allgather``, ``Split_type``, ``Dup``, ``Allocate_shared``, ...): they must
  run inside ``watchdog.guard``, whose monitor thread holds their deadline.

This test reads burstmpi's source with ``ast``, not its behaviour at run time: mpi4py's
communicator types cannot be patched (``MPI.Intracomm.allreduce = ...`` raises TypeError:
the type is immutable) and their methods are Cython functions, which ``sys.setprofile`` does
not report (no ``c_call`` event: measured), so a run-time guard could only wrap the
communicators burstmpi makes, and would see only the code paths a CPU-only test run takes.
The source scan sees every path, the GPU set-up's and the bench's included, and names the
line. A receiver counts as a ``GuardedComm`` where the scan sees it made one (a name bound
to ``watchdog.guarded(...)`` in its function or an enclosing one) and, by the bench's
convention, as a parameter ``comm`` or ``world`` of a function in ``burstmpi/bench/`` (the
commands make theirs with ``watchdog.guarded``; a bench function handed a plain one is what
this scan cannot see).
"""

import ast
import functools
from pathlib import Path

from burstmpi._transport.watchdog import GuardedComm

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "burstmpi"
BENCH = PACKAGE / "bench"

# mpi4py's pickled collectives (lowercase methods of Intracomm).
PICKLED = {"allgather", "allreduce", "alltoall", "barrier", "bcast", "exscan", "gather", "reduce", "scan", "scatter",
           "neighbor_allgather", "neighbor_alltoall"}
# Blocking calls with no deadline of their own: buffer collectives, the calls that make
# communicators and shared windows, blocking point-to-point, waits.
BLOCKING = {"Barrier", "Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw", "Bcast", "Exscan",
            "Gather", "Gatherv", "Reduce", "Reduce_scatter", "Reduce_scatter_block", "Scan", "Scatter", "Scatterv",
            "Dup", "Dup_with_info", "Clone", "Split", "Split_type", "Create", "Create_group", "Create_cart",
            "Create_graph", "Create_dist_graph", "Create_dist_graph_adjacent", "Create_intercomm",
            "Allocate", "Allocate_shared", "Create_dynamic", "Send", "Ssend", "Recv", "Sendrecv", "Probe", "Mprobe",
            "Wait", "Waitall", "Waitany", "Waitsome"}
# The bench's convention: its functions' parameters of these names are its communicators,
# made by ``watchdog.guarded`` where the commands start.
BENCH_PARAMETERS = {"comm", "world"}
# Functions whose blocking calls run under a guard their callers hold where the scan cannot
# see it (a call through ``getattr``), each with where.
CALLED_UNDER_A_GUARD = {
    ("burstmpi/_transport/shm.py", "ShmTransport._alloc"):
        "Runtime.channels's guard, through Runtime._arena_of's getattr(transport, 'arena')",
}
# Calls known to break the rules whose files are being changed elsewhere (issue 52): each
# entry must still match a call (``test_the_exceptions_are_still_needed``), so the entry goes
# when the call does.
PENDING = {}


def _called(node):
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _is_guard(item):
    """``with guard(...)``, ``with watchdog.guard(...)``, the bench's ``guard(comm, ...)``."""
    return isinstance(item.context_expr, ast.Call) and _called(item.context_expr) == "guard"


class _Scope:
    """What a function (or the module) binds: names made ``guarded`` communicators, names
    bound otherwise, its parameters, imported names."""

    def __init__(self, name, params=()):
        self.name, self.params = name, set(params)
        self.guarded, self.other, self.imported = set(), set(), set()


def _own_nodes(node):
    """The nodes of ``node``'s body outside the functions and classes it defines."""
    todo, out = list(ast.iter_child_nodes(node)), []
    while todo:
        n = todo.pop()
        out.append(n)
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(n))
    return out


def _scope_of(node, name, params=()):
    scope = _Scope(name, params)
    for sub in _own_nodes(node):
        if isinstance(sub, (ast.Import, ast.ImportFrom)):
            scope.imported |= {(a.asname or a.name).split(".")[0] for a in sub.names}
        if isinstance(sub, ast.Assign):
            pairs = [(t, sub.value) for t in sub.targets]
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            pairs = [(sub.target, sub.value)]
        elif isinstance(sub, (ast.For, ast.comprehension)):
            pairs = [(sub.target, None)]
        elif isinstance(sub, ast.withitem) and sub.optional_vars is not None:
            pairs = [(sub.optional_vars, None)]
        else:
            continue
        while pairs:
            target, value = pairs.pop()
            if isinstance(target, ast.Tuple):  # a, b = x, y: each its own; a, b = f(): neither known
                values = value.elts if isinstance(value, ast.Tuple) else [None] * len(target.elts)
                pairs += zip(target.elts, values)
                continue
            if not isinstance(target, ast.Name):
                continue
            if isinstance(value, ast.Call) and _called(value) in ("guarded", "_guarded"):
                scope.guarded.add(target.id)
            else:
                scope.other.add(target.id)
    return scope


class _Calls(ast.NodeVisitor):
    """Every method call, with the function it is in (``Class.method`` for methods),
    whether a ``guard`` block holds it and what its receiver is; and every call of every
    function or method name (a class's name calls its ``__init__``)."""

    def __init__(self, path, bench):
        self.path, self.bench = path, bench in path.parents
        self.scopes, self.classes, self.guards = [], [], 0
        self.found, self.calls = [], []

    def visit_Module(self, node):
        self.scopes.append(_scope_of(node, "the module"))
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node):
        a = node.args
        params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [v for v in (a.vararg, a.kwarg) if v]]
        name = node.name
        if self.classes and len(self.scopes) == 1:  # a method
            name = self.classes[-1] if name == "__init__" else f"{self.classes[-1]}.{name}"
        self.scopes.append(_scope_of(node, name, params))
        guards, self.guards = self.guards, 0  # a function body runs where it is called
        self.generic_visit(node)
        self.scopes.pop()
        self.guards = guards

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_With(self, node):
        guarded = any(_is_guard(i) for i in node.items)
        for item in node.items:
            self.visit(item)
        self.guards += guarded
        for stmt in node.body:
            self.visit(stmt)
        self.guards -= guarded

    def receiver(self, expr):
        """"guarded" (a GuardedComm), "module" (an imported name) or None, for a receiver."""
        if not isinstance(expr, ast.Name):
            return None
        for scope in reversed(self.scopes):
            if expr.id in scope.imported:
                return "module"
            if expr.id in scope.guarded and expr.id not in scope.other:
                return "guarded"
            if expr.id in scope.other:
                return None
            if expr.id in scope.params:  # the bench's functions take its guarded communicators
                return "guarded" if self.bench and expr.id in BENCH_PARAMETERS else None
        return None

    def visit_Call(self, node):
        name = _called(node)
        fn = self.scopes[-1].name if len(self.scopes) > 1 else None
        where = (self.path, node.lineno, fn, self.guards > 0)
        if isinstance(node.func, ast.Attribute):
            self.found.append((name, ast.unparse(node.func.value), self.receiver(node.func.value), where))
        if name:
            self.calls.append((name, where))
        self.generic_visit(node)


def _scan():
    return _scan_of(PACKAGE, BENCH)


@functools.lru_cache(maxsize=2)  # once per package: each test reads the same calls
def _scan_of(package, bench):
    found, calls = [], []
    for path in sorted(package.rglob("*.py")):
        v = _Calls(path, bench)
        v.visit(ast.parse(path.read_text()))
        found += v.found
        calls += v.calls
    return found, calls


def _where(path, line, fn):
    return f"{path.relative_to(ROOT)}:{line} (in {fn or 'the module'})"


def _pending(path, fn, receiver, name):
    return (str(path.relative_to(ROOT)), fn, f"{receiver}.{name}") in PENDING


def _allowed(name, receiver, kind):
    """Not an mpi4py communicator's method: an imported module's function (``watchdog.
    allgather``, ``functools.reduce``), burstmpi's transports' ``allgather`` (completed
    within their deadline), ``MPI.Info.Create`` (local); or a ``GuardedComm``'s own."""
    return (kind == "module" or (name == "allgather" and (receiver == "super()" or receiver.endswith("transport")))
            or receiver == "MPI.Info" or (kind == "guarded" and name in vars(GuardedComm)))


def _pickled():
    found, _ = _scan()
    return [f"{_where(p, line, fn)}: {receiver}.{name}(...)" for name, receiver, kind, (p, line, fn, _) in found
            if name in PICKLED and not _allowed(name, receiver, kind) and not _pending(p, fn, receiver, name)]


def test_no_pickled_collective_of_mpi4py():
    wrong = _pickled()
    assert not wrong, ("mpi4py's pickled collectives block where the watchdog cannot end them (its reductions "
                       "hold the GIL); use watchdog.allgather/bcast/barrier(comm, ..., timeout, what) or a "
                       "watchdog.GuardedComm:\n" + "\n".join(wrong))


def _guarded_functions(calls):
    """The functions every call of which (in burstmpi/, by name) is inside a ``guard`` or
    inside such a function: their blocking calls have the caller's deadline."""
    sites = {}
    for name, (path, line, fn, guarded) in calls:
        sites.setdefault(name, []).append((fn, guarded))
    held = {fn for _, fn in CALLED_UNDER_A_GUARD}
    while True:
        more = set()
        for fn in _functions(calls) - held:
            where = sites.get(fn.rpartition(".")[2], [])
            if where and all(guarded or f in held for f, guarded in where):
                more.add(fn)
        if not more:
            return held
        held |= more


def _functions(calls):
    return {fn for _, (_, _, fn, _) in calls if fn}


def _unguarded():
    found, calls = _scan()
    held = _guarded_functions(calls)
    return [f"{_where(p, line, fn)}: {receiver}.{name}(...)" for name, receiver, kind, (p, line, fn, guarded) in found
            if name in BLOCKING and not _allowed(name, receiver, kind) and not guarded and fn not in held
            and not _pending(p, fn, receiver, name)]


def test_every_blocking_call_runs_under_a_guard():
    wrong = _unguarded()
    assert not wrong, ("a blocking MPI call outside every watchdog.guard (nor in a function called only "
                       "inside one): it has no deadline:\n" + "\n".join(wrong))


def test_the_exceptions_are_still_needed():
    """Every entry of ``PENDING`` and ``CALLED_UNDER_A_GUARD`` still names code that exists."""
    found, calls = _scan()
    seen = {(str(p.relative_to(ROOT)), fn, f"{receiver}.{name}") for name, receiver, _, (p, _, fn, _) in found}
    stale = [entry for entry in PENDING if entry not in seen]
    functions = {(str(p.relative_to(ROOT)), fn) for _, (p, _, fn, _) in calls}
    stale += [entry for entry in CALLED_UNDER_A_GUARD if entry not in functions]
    assert not stale, f"no longer in the code: remove from this file's exceptions: {stale}"


def test_the_scan_sees_what_it_looks_for(tmp_path, monkeypatch):
    """The scan itself, on seeded code: a pickled reduction, a split outside a guard and one
    in a function called only inside a guard, the bench's ``comm`` and a communicator made
    ``guarded`` (theirs are GuardedComm's methods), a plain one in the bench."""
    pkg = tmp_path / "burstmpi"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "lib.py").write_text(
        "import functools\n"
        "def bad(comm):\n    return functools.reduce(max, [comm.allreduce(1)])\n"
        "def split(comm):\n    return comm.Split_type(0)\n"
        "def called_guarded(comm):\n    with guard('x'):\n        return split(comm)\n"
        "def loose(comm):\n    return comm.Dup()\n")
    (pkg / "bench" / "mode.py").write_text(
        "from .._transport import watchdog\n"
        "def row(comm):\n    comm.Barrier()\n    return comm.allreduce(1)\n"
        "def main():\n    world = watchdog.guarded(MPI.COMM_WORLD)\n    world.bcast(1)\n"
        "    comm = MPI.COMM_WORLD\n    return comm.bcast(1)\n")
    module = __import__(__name__)
    for name, value in (("ROOT", tmp_path), ("PACKAGE", pkg), ("BENCH", pkg / "bench")):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(module, "PENDING", {})
    monkeypatch.setattr(module, "CALLED_UNDER_A_GUARD", {})
    found, calls = _scan()
    assert [(n, r, k) for n, r, k, _ in found] == [
        ("Barrier", "comm", "guarded"), ("allreduce", "comm", "guarded"), ("guarded", "watchdog", "module"),
        ("bcast", "world", "guarded"), ("bcast", "comm", None),
        ("reduce", "functools", "module"), ("allreduce", "comm", None), ("Split_type", "comm", None),
        ("Dup", "comm", None)]
    held = _guarded_functions(calls)
    assert "split" in held and "loose" not in held
    assert _pickled() == ["burstmpi/bench/mode.py:9 (in main): comm.bcast(...)",
                          "burstmpi/lib.py:3 (in bad): comm.allreduce(...)"]
    assert _unguarded() == ["burstmpi/lib.py:10 (in loose): comm.Dup(...)"]
