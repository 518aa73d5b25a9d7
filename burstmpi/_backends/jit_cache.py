"""numba's disk cache, keyed on every source a compiled function is built from.

numba keys a cached function on its own file alone (that file's modification time and
size). The tile loops compile in code from other files: ``cpu.tiles`` and ``cpu.packed``
inline ``cpu.kernels``' sweeps, ``cpu.packed`` ``cpu.micro``'s micro-kernel. After an edit
to one of those, the loops would load their old machine code from the cache and run it, a
silently different kernel (a two-file package shows it: the caller kept returning the
callee's old value).

``guard(module, depends)`` keeps, beside ``module``'s cache, a digest of the sources of
``module`` and the modules it compiles in. Where it differs from theirs now, every cached
function of ``module`` is flushed (numba's own ``Cache.flush``, an empty index), so it
compiles afresh on first use and caches the new code, and the new digest is written. Ranks
that start together may each flush: the later ones then compile once more, which numba's
cache allows (a missing entry is a miss). An installed package's files change only on
reinstall; this is for a checkout that is being edited.

``first_use(what, modules)`` compiles (or loads) the modules' functions on a first use, one
rank of a node at a time, and says so on rank 0 when they are not in the cache yet: a new
install otherwise sat silent for the whole compile. Ranks compiling each on their own
share the node's cores and take about twice as long as one compile. Under a file lock in
the cache folder the first rank compiles and writes the cache, and the others, waiting on
the lock, then load it.
"""

import contextlib
import fcntl
import hashlib
import inspect
import os
import sys
import time

__all__ = ["digest", "guard", "cached", "first_use", "notice"]

# What ``notice`` promises: one compile on this project's 2-core CI machine took 17.5 s
# (above); a slower core or a busy node takes longer.
TYPICAL_SECONDS = 20


def digest(modules):
    """SHA-256 of the modules' source files, in the given order."""
    h = hashlib.sha256()
    for mod in modules:
        with open(inspect.getsourcefile(mod), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _caches(module):
    """The disk caches of ``module``'s numba functions compiled with ``cache=True``."""
    out = []
    for obj in vars(module).values():
        cache = getattr(obj, "_cache", None)
        if getattr(obj, "py_func", None) is not None and getattr(cache, "_cache_path", None):
            if obj.py_func.__module__ == module.__name__:
                out.append(cache)
    return out


def guard(module, depends):
    """Flush ``module``'s cached functions if it or a module in ``depends`` changed since
    they were cached (call it at the end of ``module``, before any of them is used).
    Returns True when it flushed."""
    caches = _caches(module)
    if not caches:
        return False
    now = digest([module, *depends])
    stamp = os.path.join(caches[0]._cache_path, module.__name__.rsplit(".", 1)[-1] + ".sources")
    try:
        with open(stamp) as f:
            if f.read().strip() == now:
                return False
    except OSError:
        pass
    for cache in caches:
        cache.flush()
    try:  # written whole or not at all: another rank may be reading it
        tmp = f"{stamp}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(now + "\n")
        os.replace(tmp, stamp)
    except OSError:  # a cache we cannot write to: numba then compiles in memory anyway
        pass
    return True


def cached(dispatcher, signature):
    """Will ``dispatcher.compile(signature)`` load machine code from numba's disk cache rather
    than compile? Reads the cache's index as numba does (the same key: the signature, the
    CPU's code-generation tuple and the function's bytecode). numba keeps this private, so
    anything unexpected counts as not cached: a notice too many, never a silent compile.
    The entry's data file must be there too: numba writes the index first, and a rank that
    read it in between would go on to compile beside the one writing (seen once in a test)."""
    cache = getattr(dispatcher, "_cache", None)
    try:
        key = cache._index_key(signature, dispatcher.targetctx.codegen())
        name = cache._cache_file._load_index().get(key)
        return name is not None and os.path.exists(os.path.join(cache._cache_path, name))
    except Exception:
        return False


def _rank():
    """This process's rank in MPI_COMM_WORLD, without starting MPI: a process that has not
    imported mpi4py reads its launcher's variables (MPICH/hydra, Open MPI, PMIx, Slurm)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_rank()
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def notice(what, where, seconds=None):
    """The line rank 0 prints before a first compile (``seconds`` None) and after it."""
    if seconds is None:
        return (f"burstmpi: compiling {what} (numba; once per install, cached in {where}; "
                f"about {TYPICAL_SECONDS} s)...")
    return f"burstmpi: compiled {what} in {seconds:.1f} s; later runs load them from {where}"


@contextlib.contextmanager
def _locked(folder):
    """Hold an exclusive lock on ``folder``'s compile lock file; nothing where the folder
    cannot hold one (numba then compiles in memory anyway)."""
    try:
        fd = os.open(os.path.join(folder, ".burstmpi-compile.lock"), os.O_CREAT | os.O_RDWR, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: every rank compiles, as before
            pass
        yield
    finally:
        os.close(fd)  # and with it the lock


def first_use(what, modules, stream=None):
    """Compile (or load from the disk cache) ``modules`` on their first use in this process:
    each has ``warm()``, ``_warm`` (None until warmed) and ``_SIGNATURES`` (dispatcher ->
    signature). ``what`` names them in the notice, which rank 0 writes to ``stream``
    (stderr) only when something will compile. Returns True when it printed."""
    pending = [m for m in modules if getattr(m, "_warm", None) is None]
    if not pending:
        return False
    fns = [(fn, sig) for m in pending for fn, sig in m._SIGNATURES.items()]
    where = getattr(getattr(fns[0][0], "_cache", None), "_cache_path", None) if fns else None
    cold = not all(cached(fn, sig) for fn, sig in fns)
    loud = cold and _rank() == 0
    stream = sys.stderr if stream is None else stream
    if loud:
        print(notice(what, where), file=stream, flush=True)
    t0 = time.perf_counter()
    with _locked(where) if cold and where else contextlib.nullcontext():
        for m in pending:
            m.warm()
    if loud:
        print(notice(what, where, time.perf_counter() - t0), file=stream, flush=True)
    return loud
