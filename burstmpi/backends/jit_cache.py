"""numba's disk cache, keyed on every source a compiled function is built from.

numba keys a cached function on its own file alone (that file's modification time and
size). The tile loops compile in code from other files: ``cpu_tiles`` and ``cpu_packed``
inline ``cpu_kernels``' sweeps, ``cpu_packed`` ``cpu_micro``'s micro-kernel. After an edit
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
"""

import hashlib
import inspect
import os

__all__ = ["digest", "guard"]


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
