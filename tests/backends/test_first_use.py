"""The first use of the compiled CPU loops (``jit_cache.first_use``): rank 0 says what compiles,
that it is once per install and where it is cached, and how long it took; nothing when the
cache is warm; the ranks of a node compile one at a time (the others load what the first
wrote).

A module of one small numba function stands in for the tile loops where the cache must
start cold (the real loops take about 20 s to compile); the real ones are checked warm.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from burstmpi._backends import jit_cache

from conftest import NRANKS

ROOT = Path(__file__).resolve().parents[2]
alone = pytest.mark.skipif(NRANKS > 1, reason="starts its own processes; run once")

TINY = textwrap.dedent('''
    import time
    from numba import njit, types

    @njit(cache=True)
    def twice(x):
        return 2.0 * x

    _SIGNATURES = {twice: (types.float64,)}
    _warm = None

    def warm():
        global _warm
        if _warm is None:
            t0 = time.perf_counter()
            twice.compile((types.float64,))
            _warm = time.perf_counter() - t0
        return _warm
''')
RUN = textwrap.dedent('''
    import sys
    from mpi4py import MPI
    from burstmpi._backends import jit_cache
    import tiny
    cold = not jit_cache.cached(tiny.twice, (types_f64 := tiny._SIGNATURES[tiny.twice]))
    printed = jit_cache.first_use("the tiny loops", [tiny])
    hits = sum(tiny.twice.stats.cache_hits.values())
    print(f"rank {MPI.COMM_WORLD.Get_rank()} cold {cold} printed {printed} loaded {hits > 0} "
          f"cached-after {jit_cache.cached(tiny.twice, types_f64)}", flush=True)
''')
NOTICE = re.compile(r"^burstmpi: compiling the tiny loops \(numba; once per install, cached in (\S+); about \d+ s\)\.\.\.$")
DONE = re.compile(r"^burstmpi: compiled the tiny loops in [\d.]+ s; later runs load them from (\S+)$")


def _tiny(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "run.py").write_text(RUN)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return env


def _notices(stderr):
    return [l for l in stderr.splitlines() if l.startswith("burstmpi: compil")]


@alone
@pytest.mark.timeout(120)
def test_a_cold_cache_is_announced_once_and_a_warm_one_is_silent(tmp_path):
    env = _tiny(tmp_path)
    run = lambda: subprocess.run([sys.executable, "run.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=100)
    first = run()
    assert first.returncode == 0, first.stderr
    assert "cold True printed True loaded False cached-after True" in first.stdout, first.stdout + first.stderr
    start, done = _notices(first.stderr)
    where = NOTICE.match(start).group(1)
    assert DONE.match(done).group(1) == where and where.startswith(str(tmp_path / "cache"))
    second = run()
    assert second.returncode == 0 and "cold False printed False loaded True" in second.stdout, second.stdout
    assert _notices(second.stderr) == []


@alone
@pytest.mark.timeout(150)
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_ranks_compile_one_at_a_time_and_only_rank_0_says_so(tmp_path):
    env = _tiny(tmp_path)
    res = subprocess.run(["mpiexec", "-n", "3", sys.executable, "run.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # Each rank's record found wherever it is: mpiexec merges the ranks' output, and a line
    # may arrive split around another rank's (seen under load: "...Truerank 2 ...").
    ranks = sorted(re.findall(r"rank \d+ cold (?:True|False) printed (?:True|False) loaded (?:True|False) "
                           r"cached-after (?:True|False)", res.stdout))
    assert len(ranks) == 3 and all("cached-after True" in l for l in ranks), res.stdout
    # Under the lock one rank compiled; the others found its code in the cache.
    assert sum("loaded False" in l for l in ranks) == 1, res.stdout
    printed = [l for l in ranks if "printed True" in l]
    assert all(l.startswith("rank 0 ") for l in printed), res.stdout  # rank 0 only (if it found the cache cold)
    assert len(_notices(res.stderr)) == 2 * len(printed), res.stderr


@alone
@pytest.mark.timeout(300)
def test_the_real_tile_loops_are_silent_once_cached(tmp_path):
    """The CPU backend's loops (the package's own cache): a first process may compile them
    (and then says so), the next loads them without a word."""
    code = ("from burstmpi._backends.cpu import CpuBackend; from burstmpi._backends.cpu import tiles as cpu_tiles; "
            "CpuBackend(kernels='numba'); print('loaded', cpu_tiles._warm[1])")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env.pop("NUMBA_CACHE_DIR", None)
    run = lambda: subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=140)
    first = run()
    assert first.returncode == 0, first.stderr
    assert len(_notices(first.stderr)) in (0, 2), first.stderr
    if _notices(first.stderr):
        assert "compiling the CPU tile loops (numba; once per install, cached in " in first.stderr
    second = run()
    assert second.returncode == 0 and "loaded True" in second.stdout, second.stdout + second.stderr
    assert _notices(second.stderr) == [], second.stderr


def test_the_notice_says_what_where_and_how_long():
    start = jit_cache.notice("the CPU tile loops", "/x/__pycache__")
    assert start == (f"burstmpi: compiling the CPU tile loops (numba; once per install, cached in /x/__pycache__; "
                     f"about {jit_cache.TYPICAL_SECONDS} s)...")
    assert jit_cache.notice("the CPU tile loops", "/x", 18.25) == ("burstmpi: compiled the CPU tile loops in 18.2 s; "
                                                                   "later runs load them from /x")


def test_nothing_to_warm_prints_nothing(capsys):
    class Warm:
        _warm = (0.1, True)
        _SIGNATURES = {}

    assert jit_cache.first_use("anything", [Warm]) is False and capsys.readouterr().err == ""


def test_the_rank_comes_from_the_launcher_without_mpi():
    """A process that has not started MPI reads its rank from the launcher's variables (the
    module alone, from its file: importing burstmpi starts MPI)."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('jc', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m._rank(), 'mpi4py.MPI' in sys.modules)")
    for var, value, want in (("PMI_RANK", "3", "3"), ("OMPI_COMM_WORLD_RANK", "2", "2"), (None, None, "0")):
        env = {k: v for k, v in os.environ.items()
               if k not in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")}
        if var:
            env[var] = value
        res = subprocess.run([sys.executable, "-c", code, jit_cache.__file__], env=env, capture_output=True, text=True,
                             timeout=60)
        assert res.stdout.split() == [want, "False"], res.stdout + res.stderr


@alone
def test_threads_that_first_use_the_loops_at_once_all_get_them():
    """Threads of one process (JAX's, torch's, at MPI_THREAD_MULTIPLE) calling the loops
    first at the same moment: one compiles (or loads) them, the others wait for it; none
    fails on a loop whose compilation the first one already closed."""
    script = textwrap.dedent("""
        import threading
        from burstmpi._backends.cpu import kernels, packed, tiles
        errors, go = [], threading.Barrier(4)
        def first_use():
            go.wait()
            try:
                tiles.warm()
                if packed.available():
                    packed.warm()
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=first_use) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        print("all warm")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0 and "all warm" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
