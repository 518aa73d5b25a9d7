"""The functional API's cost per call against one reused plan's (issue 45).

    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m burstmpi.bench.overhead
    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m burstmpi.bench.overhead -N 1K --calls 100

Times ``--calls`` calls of ``burstmpi.attention(q, k, v, ...)`` against as many calls of
``BurstAttention(...).forward`` on one plan made beforehand, on the same sharded arrays,
after a warm-up of both, in ``--rounds`` rounds that alternate which goes first. Each
figure is a round's wall time over the ranks' maximum, per call; the line ``ratio`` is the
median over rounds of (functional / plan). ``burstmpi.attention`` reuses a cached plan
(``burstmpi._plan_cache``), so the ratio should be close to 1; before the cache it made a
plan (a new runtime, node discovery, a cold workspace) on every call.

Runs as a plain script too (``python -m mpi4py path/to/overhead.py``), against whichever
``burstmpi`` is first on ``sys.path``: that is how it measures an older checkout.

Its barriers and its reduction of the times wait within the watchdog's deadline
(``BURSTMPI_TIMEOUT``): the communicator is ``watchdog.guarded``, where the ``burstmpi``
measured has one (a rank that dies ends the job with exit 75, not a hang).
"""

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import burstmpi
from burstmpi import reference as ref

__all__ = ["main", "measure"]


def _size(text):
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def _cpu_line():
    try:
        from burstmpi.bench.common import cpu_line
        return cpu_line()
    except ImportError:  # pragma: no cover - an older checkout
        return "#  CPU: unknown"


def _guarded(comm):
    """``comm`` with the watchdog's deadline on its barrier and pickled collectives; as it is
    where the ``burstmpi`` measured predates the watchdog (an older checkout)."""
    try:
        from burstmpi._config import settings
        from burstmpi._transport.watchdog import GuardedComm, guarded
    except ImportError:  # pragma: no cover - an older checkout
        return comm
    if isinstance(comm, GuardedComm):
        return comm
    return guarded(comm, settings().timeout, who="burstmpi.bench.overhead")


def measure(comm, *, N=1024, B=1, H=8, D=64, dtype="float32", causal=True, layout="zigzag", calls=100,
            rounds=4, warmup=5):
    """Per-call ms (maximum over ranks) of each round: ``{"api": [...], "plan": [...]}``.
    The calls run on ``comm``; the barriers and the maximum on a ``watchdog.guarded`` one."""
    waits = _guarded(comm)  # the calls on ``comm`` itself, as a user's program makes them
    q, k, v, _ = ref.random_problem(B, N, H, H, D, dtype=np.dtype(dtype), seed=0)
    q, k, v = (burstmpi.shard(x, comm=comm, layout=layout) for x in (q, k, v))
    opts = dict(causal=causal, layout=layout)
    plan = burstmpi.BurstAttention(comm, **opts)

    def api():
        return burstmpi.attention(q, k, v, comm=comm, **opts)

    def one_plan():
        return plan.forward(q, k, v)[0]

    runs = {"api": api, "plan": one_plan}
    for _ in range(warmup):
        api()
        one_plan()
    times = {"api": [], "plan": []}
    for r in range(rounds):
        for name in (("api", "plan") if r % 2 == 0 else ("plan", "api")):
            run = runs[name]
            waits.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                run()
            dt = waits.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            times[name].append(dt / calls * 1e3)
    release = getattr(burstmpi, "release_cached", None)
    if release is not None:
        release(comm)
    plan.release()
    return times


def main(argv=None):
    p = argparse.ArgumentParser(prog="burstmpi.bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("-N", "--tokens", default="1K", type=_size, help="global sequence length (default 1K)")
    p.add_argument("-B", "--batch", default=1, type=int)
    p.add_argument("-H", "--heads", default=8, type=int)
    p.add_argument("-D", "--head-dim", default=64, type=int)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="full attention, contiguous")
    p.add_argument("--calls", default=100, type=int, help="calls per round (default 100)")
    p.add_argument("--rounds", default=4, type=int, help="rounds, alternating which goes first (default 4)")
    p.add_argument("--warmup", default=5, type=int)
    a = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    layout = "zigzag" if a.causal else "contiguous"
    times = measure(comm, N=a.tokens, B=a.batch, H=a.heads, D=a.head_dim, dtype=a.dtype, causal=a.causal,
                    layout=layout, calls=a.calls, rounds=a.rounds, warmup=a.warmup)
    if comm.Get_rank() == 0:
        print(_cpu_line())
        print(f"#  burstmpi from {os.path.dirname(burstmpi.__file__)}; {comm.Get_size()} ranks; "
              f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}")
        print(f"#  N={a.tokens} B={a.batch} H={a.heads} D={a.head_dim} {a.dtype} causal={a.causal} "
              f"layout={layout}; {a.calls} calls a round, {a.rounds} rounds; ms per call, max over ranks")
        print(f"{'round':>5} {'first':>5} {'attention()':>12} {'plan.forward':>12} {'ratio':>7}")
        ratios = []
        for r in range(a.rounds):
            ratio = times["api"][r] / times["plan"][r]
            ratios.append(ratio)
            print(f"{r:5d} {'api' if r % 2 == 0 else 'plan':>5} {times['api'][r]:12.3f} {times['plan'][r]:12.3f} "
                  f"{ratio:7.3f}")
        print(f"median: attention() {statistics.median(times['api']):.3f} ms, plan.forward "
              f"{statistics.median(times['plan']):.3f} ms; ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
