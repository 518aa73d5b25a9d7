"""``jit_cache.guard``: a cached numba function that compiles in code from another file is
rebuilt when that file changes (numba alone keys the cache on the function's own file and
keeps running the old code), and loaded from the cache when nothing changed.

Each step runs in its own interpreter, as a new process loading the disk cache would; they
run once, not on every rank of the MPI rerun."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import NRANKS

pytestmark = pytest.mark.skipif(NRANKS > 1, reason="spawns its own interpreters; once is enough")

_DEP = """
from numba import njit

@njit(inline="always", cache=True)
def f():
    return {value}
"""

_USER = """
import sys
from numba import njit
from burstmpi._backends import jit_cache
from . import dep

@njit(cache=True)
def g():
    return dep.f() + 10

{guard}
"""


def _package(root, value, guarded):
    """Write ``dep.py`` returning ``value``; ``user.py`` the first time only (rewriting it
    would change its own stamp, which numba does see)."""
    pkg = root / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "dep.py").write_text(textwrap.dedent(_DEP.format(value=value)))
    if not (pkg / "user.py").exists():
        (pkg / "__init__.py").write_text("")
        guard = "flushed = jit_cache.guard(sys.modules[__name__], [dep])" if guarded else "flushed = None"
        (pkg / "user.py").write_text(textwrap.dedent(_USER.format(guard=guard)))


def _run(root):
    """(g(), whether the guard flushed, whether g came from the disk cache) in a new interpreter."""
    code = "from pkg import user; print(user.g(), user.flushed, sum(user.g.stats.cache_hits.values()) > 0)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    env.pop("NUMBA_CACHE_DIR", None)  # next to the sources, in root
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    value, flushed, hit = res.stdout.split()
    return int(value), flushed, hit == "True"


def test_numba_alone_keeps_a_stale_callee(tmp_path):
    """Why the guard exists: without it the edited callee's old value comes back."""
    _package(tmp_path, 1, guarded=False)
    assert _run(tmp_path)[0] == 11
    _package(tmp_path, 2, guarded=False)
    assert _run(tmp_path)[0] == 11  # numba's own behaviour; if it ever changes, the guard is moot


def test_guard_rebuilds_after_a_dependency_changes(tmp_path):
    _package(tmp_path, 1, guarded=True)
    assert _run(tmp_path) == (11, "True", False)   # no digest yet: flushed, compiled, cached
    assert _run(tmp_path) == (11, "False", True)   # unchanged: loaded from the cache
    _package(tmp_path, 2, guarded=True)
    assert _run(tmp_path) == (12, "True", False)   # the callee changed: compiled afresh
    assert _run(tmp_path) == (12, "False", True)
