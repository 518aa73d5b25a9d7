"""burstmpi-soak: run burstmpi the way a job that lasts for days does, and fail on growth.

    mpiexec -n 2 burstmpi-soak --minutes 0.5          # what CI runs (tests/bench/test_soak.py)
    mpiexec -n 4 burstmpi-soak --hours 8 --report 600 # the nightly job's, or a user's own

Every round makes a communicator (a duplicate of the world, or every other round a split
of it into two halves), and on it: the functional API (``attention`` and
``attention_backward``) with one of the option sets of ``OPTION_SETS`` in turn (masks,
layouts, dtypes, GQA, backward modes, lengths, documents re-sharded for balance), a
``BurstAttention`` made, used and released, a ``KVCache`` prefilled and decoding, the
framework adapters' training steps where torch or JAX is installed (``--adapters``), and
then frees the communicator. Every ``--check-every`` rounds the results are checked against
float64 (``burstmpi.reference``).

Every ``--report`` seconds rank 0 prints a line: the round, resident memory (the largest
rank's), the shared memory the job maps (``/dev/shm``, the largest rank's) and the files
there, how many more communicators MPI can make (``_communicators_left``: MPI's own count,
which a leak burstmpi's counts miss would lower), what burstmpi holds (``_transport.lifetime.live``: states, communicators, windows,
NCCL communicators, summed over ranks) and the plan cache's counts. After the warm-up
(``--warmup`` rounds: every option set runs at least once, so the caches are full) the
first line is the baseline, and the run fails when, at any report or at the end:

- a value is wrong (exit 1);
- MPI can make fewer communicators, what burstmpi holds between rounds differs from the
  baseline, resident memory grew by more than ``--rss-growth`` MB, or the job maps more
  shared memory (exit 3, as the bench's regression mode).

Every wait on other ranks has the watchdog's deadline (``--timeout``; exit 75).
"""

import os
import sys
import time

import click
import numpy as np
from mpi4py import MPI

import burstmpi

from .. import reference
from .._config import settings
from .._plan_cache import MAX_PLANS, stats as cache_stats
from .._transport import lifetime, segments, watchdog
from .._transport.mpi_library import library_version
from ..masks import Sinks
from .common import TOLERANCE
from .memory import rss_bytes

__all__ = ["main", "OPTION_SETS", "soak"]

EXIT_WRONG, EXIT_GROWTH = 1, 3

# One per round, in turn: more than the plan cache keeps (8), so plans are evicted and made
# again all the time, as in a program that varies its calls.
OPTION_SETS = [
    dict(causal=True, layout="zigzag"),
    dict(causal=True, layout="striped", bwd_comm="ring"),
    dict(causal=False, layout="contiguous"),
    dict(window=(24, 0), layout="zigzag"),
    dict(causal=True, layout="zigzag", dtype="float16"),
    dict(causal=True, layout="contiguous", bwd_comm="burst", kv_heads=1),
    dict(causal=True, layout="zigzag", mask=Sinks(4)),
    dict(window=(16, 16), layout="contiguous", dtype="float64"),
    dict(causal=True, layout="zigzag", dtype="bfloat16"),
    dict(causal=True, layout="striped", softmax_scale=0.2),
    dict(causal=False, layout="zigzag", kv_heads=1, bwd_comm="ring"),
    dict(causal=True, layout="contiguous", cu_seqlens=True, balance="zigzag"),  # the re-shard's exchange, irregular
]
LENGTHS = (37, 64, 91)  # tokens per rank of the world: odd and even, different plans' shapes
HEADS, HEAD_DIM = 4, 16


def _shm_files():
    try:
        return len(os.listdir(segments.SHM_DIR))
    except OSError:
        return -1


def _problem(round_no, world_size, options):
    """The round's global problem, the same on every rank."""
    dtype = options.get("dtype", "float32")
    kv = options.get("kv_heads", HEADS)
    N = LENGTHS[round_no % len(LENGTHS)] * world_size
    q, k, v, do = reference.random_problem(1, N, HEADS, kv, HEAD_DIM, dtype=dtype, seed=round_no)
    cu = None
    if options.get("cu_seqlens"):
        cu = np.array([0, N // 3, N // 3 + 1, (3 * N) // 4, N])
    return q, k, v, do, cu


def _wrong(name, ours, exact, dtype):
    """How many values of ``ours`` are outside the bench's tolerance for ``dtype``."""
    atol, rtol = TOLERANCE[str(np.dtype(dtype)) if dtype != "bfloat16" else "bfloat16"]
    ours, exact = np.asarray(ours, np.float64), np.asarray(exact, np.float64)
    bad = int(np.count_nonzero(~(np.abs(ours - exact) <= atol + rtol * np.abs(exact))))
    return (f"{name}: {bad} value(s) wrong, largest error {np.abs(ours - exact).max():.2e}",) if bad else ()


def _functional(comm, round_no, check):
    """attention and attention_backward with the round's option set; the wrong values."""
    opts = dict(OPTION_SETS[round_no % len(OPTION_SETS)])
    dtype, _ = opts.pop("dtype", "float32"), opts.pop("kv_heads", None)
    q, k, v, do, cu = _problem(round_no, MPI.COMM_WORLD.Get_size(), OPTION_SETS[round_no % len(OPTION_SETS)])
    if opts.pop("cu_seqlens", None):
        opts["cu_seqlens"] = cu
    layout = opts["layout"]
    sh = lambda x: burstmpi.shard(x, comm=comm, layout=layout, cu_seqlens=cu)
    ql, kl, vl, dol = (sh(x) for x in (q, k, v, do))
    bwd_comm = opts.pop("bwd_comm", "auto")  # the backward's only
    out, lse = burstmpi.attention(ql, kl, vl, comm=comm, return_lse=True, **opts)
    grads = burstmpi.attention_backward(dol, ql, kl, vl, out, lse, comm=comm, bwd_comm=bwd_comm, **opts)
    if not check:
        return ()
    ref_opts = {n: opts[n] for n in ("causal", "window", "softmax_scale", "mask", "cu_seqlens") if n in opts}
    exact_out, _ = reference.forward(q, k, v, **ref_opts)
    exact_grads = reference.backward(do, q, k, v, **ref_opts)
    full = lambda x: burstmpi.unshard(x, comm=comm, layout=layout, cu_seqlens=cu)
    wrong = _wrong(f"round {round_no} attention {opts}: out", full(out), exact_out, dtype)
    for name, g, e in zip(("dq", "dk", "dv"), grads, exact_grads):
        wrong += _wrong(f"round {round_no} attention_backward: {name}", full(g), e, dtype)
    return wrong


def _objects(comm, round_no, check):
    """A BurstAttention and a KVCache made, used and released on ``comm``."""
    q, k, v, do, _ = _problem(round_no, MPI.COMM_WORLD.Get_size(), {})
    sh = lambda x: burstmpi.shard(x, comm=comm, layout="zigzag")
    ql, kl, vl = sh(q), sh(k), sh(v)
    # Head parallelism (its splits and the groups' ring) where the ranks pair up.
    heads = 2 if comm.Get_size() % 2 == 0 and round_no % 2 == 0 else 1
    plan = burstmpi.BurstAttention(comm, causal=True, layout="zigzag", head_parallel=heads)
    out, _ = plan.forward(ql, kl, vl)
    plan.release()
    N = q.shape[1]
    cache = burstmpi.KVCache(comm, capacity=N + 4, batch=1, kv_heads=HEADS, head_dim=HEAD_DIM)
    cache.prefill(ql, kl, vl, layout="zigzag")
    rng = np.random.default_rng(round_no)
    q1, k1, v1 = (rng.standard_normal((1, 2, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(3))
    out1 = cache.decode(q1, k1, v1)
    cache.release()
    if not check:
        return ()
    keys, values = np.concatenate([k, k1], 1), np.concatenate([v, v1], 1)
    exact1, _, _ = reference.rows(q1, keys, values, np.zeros_like(q1), [N, N + 1], causal=True)
    exact, _ = reference.forward(q, k, v, causal=True)
    return (_wrong(f"round {round_no} BurstAttention.forward: out",
                   burstmpi.unshard(out, comm=comm, layout="zigzag"), exact, "float32")
            + _wrong(f"round {round_no} KVCache.decode: out", out1, exact1, "float32"))


def _adapters(comm, round_no, check, which):
    """A training step through each installed adapter in ``which`` on ``comm``."""
    wrong = ()
    q, k, v, do, _ = _problem(round_no, MPI.COMM_WORLD.Get_size(), {})
    sh = lambda x: burstmpi.shard(x, comm=comm, layout="zigzag")
    exact = reference.backward(do, q, k, v, causal=True) if check else None
    full = lambda x: burstmpi.unshard(np.asarray(x), comm=comm, layout="zigzag")
    if "torch" in which:
        import torch
        import burstmpi.torch as bt
        ts = [torch.from_numpy(sh(x)) for x in (q, k, v)]
        for t in ts:
            t.requires_grad_()
        (bt.attention(*ts, comm=comm, causal=True, layout="zigzag") * torch.from_numpy(sh(do))).sum().backward()
        for name, t, e in zip(("dq", "dk", "dv"), ts, exact or ()):
            wrong += _wrong(f"round {round_no} burstmpi.torch: {name}", full(t.grad.numpy()), e, "float32")
    if "jax" in which:
        import jax
        import jax.numpy as jnp
        import burstmpi.jax as bj
        w = jnp.asarray(sh(do))
        loss = lambda a, b, c: (bj.attention(a, b, c, comm=comm, causal=True, layout="zigzag") * w).sum()
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(sh(x)) for x in (q, k, v)))
        for name, g, e in zip(("dq", "dk", "dv"), grads, exact or ()):
            wrong += _wrong(f"round {round_no} burstmpi.jax: {name}", full(g), e, "float32")
    return wrong


def _communicators_left(most=4096):
    """How many more communicators MPI can make now (collective): every rank duplicates
    ``COMM_WORLD`` until MPI refuses (an error every rank gets alike: MPICH agrees on the
    context id), up to ``most``, then frees them. MPI's own count, not burstmpi's."""
    made = []
    try:
        with watchdog.guard("burstmpi-soak: counting the communicators MPI can still make", settings().timeout):
            while len(made) < most:
                made.append(MPI.COMM_WORLD.Dup())
    except MPI.Exception:
        pass
    with watchdog.guard("burstmpi-soak: freeing the counted communicators", settings().timeout):
        for c in made:
            c.Free()
    return len(made)


def _measure(world):
    """(resident bytes, mapped shared bytes: the largest rank's; /dev/shm files; what
    burstmpi holds, summed over ranks; the plan cache's counts, summed)."""
    left = _communicators_left()
    live = lifetime.live()
    mine = (rss_bytes(), segments.mapped_bytes(), _shm_files(), tuple(live.values()), tuple(cache_stats()))
    every = world.allgather(mine)
    return dict(left=left, rss=max(e[0] for e in every), shm=max(e[1] for e in every), files=max(e[2] for e in every),
                held=dict(zip(live, (sum(e[3][i] for e in every) for i in range(len(live))))),
                cache=[sum(e[4][i] for e in every) for i in range(len(mine[4]))])


def _line(rnd, elapsed, m, err_rounds):
    held = " ".join(f"{k} {v}" for k, v in m["held"].items())
    plans, hits, misses, evictions, buf, kept = m["cache"]
    return (f"round {rnd:7d}  {elapsed / 60:7.1f} min  rss {m['rss'] / 2**20:7.1f} MB  shm {m['shm'] / 2**20:6.1f} MB "
            f"({m['files']} files)  MPI comms left {m['left']}  held: {held}  cache: {plans} plans {hits} hits {misses} misses {evictions} "
            f"evictions {(buf + kept) / 2**20:.1f} MB  checked {err_rounds}")


def _growth(base, m, rss_growth):
    """Why ``m`` grew past ``base`` (a list of reasons; empty when it did not)."""
    why = []
    if m["left"] < base["left"]:
        why.append(f"MPI can make {base['left'] - m['left']} fewer communicators than at the baseline "
                   f"({m['left']} of {base['left']}): communicators leak")
    if m["held"] != base["held"]:
        why.append(f"burstmpi holds {m['held']} between rounds, {base['held']} at the baseline")
    if m["rss"] - base["rss"] > rss_growth * 2**20:
        why.append(f"resident memory grew {(m['rss'] - base['rss']) / 2**20:.1f} MB (more than {rss_growth} MB)")
    if m["shm"] > base["shm"]:
        why.append(f"the job maps {(m['shm'] - base['shm']) / 2**20:.1f} MB more of /dev/shm")
    if m["cache"][0] > MAX_PLANS * MPI.COMM_WORLD.Get_size():
        why.append(f"the plan cache holds {m['cache'][0]} plans (at most {MAX_PLANS} per communicator)")
    return why


def soak(seconds, *, warmup, check_every, report_s, rss_growth, adapters, out=print):
    """Run rounds for ``seconds`` (after ``warmup`` rounds); return the exit status. Rank
    0's clock decides when to measure and when to stop, and every round ends with one
    allgather that tells every rank (the measurements are collective)."""
    timeout = settings().timeout
    world = watchdog.guarded(MPI.COMM_WORLD, timeout, "burstmpi-soak")
    rank0 = world.Get_rank() == 0
    say = out if rank0 else (lambda *a, **k: None)
    start = time.monotonic()
    base, rnd, last, checked, warm = None, 0, 0.0, 0, 0.0
    while True:
        rnd += 1
        check = rnd % check_every == 0 or rnd <= len(OPTION_SETS)
        # The functional API on the world (a cache that lives as long as the job, with more
        # option sets than it keeps) and, every third round, on the round's communicator.
        wrong = _functional(world, rnd, check)
        with watchdog.guard("burstmpi-soak: making the round's communicator", timeout):
            comm = MPI.COMM_WORLD.Dup() if rnd % 2 else MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank() % 2)
        try:
            if rnd % 3 == 0:
                wrong += _functional(comm, rnd + 1, check)
            wrong += _objects(comm, rnd, check) + _adapters(comm, rnd, check, adapters)
            if rnd % 5 == 0:  # what a program that keeps its communicator calls now and then
                burstmpi.release_cached(comm)
        finally:
            with watchdog.guard("burstmpi-soak: freeing the round's communicator (and what burstmpi kept for it)",
                                timeout):
                comm.Free()
        checked += check
        now = time.monotonic()
        every = world.allgather((wrong, now - start))
        wrong, elapsed = [w for ws, _ in every for w in ws], every[0][1] - warm
        if wrong:
            say(f"burstmpi-soak: FAILED at round {rnd}: wrong values: " + "; ".join(dict.fromkeys(wrong)))
            return EXIT_WRONG
        done = base is not None and elapsed >= seconds
        if rnd == warmup or done or (base is not None and elapsed - last >= report_s):
            m = _measure(world)
            if base is None:
                base, warm, elapsed = m, elapsed, 0.0  # the run's time starts here
                say(f"# the baseline, after the warm-up ({warm / 60:.1f} min):")
            last = elapsed
            say(_line(rnd, elapsed, m, checked))
            why = _growth(base, m, rss_growth)
            if why:
                say(f"burstmpi-soak: FAILED at round {rnd}: " + "; ".join(why))
                return EXIT_GROWTH
        if done:
            say(f"burstmpi-soak: passed: {rnd} rounds ({rnd - warmup} in {elapsed / 60:.1f} min after the warm-up), "
                f"{checked} checked against "
                f"float64; nothing grew past the baseline (resident memory within {rss_growth} MB)")
            return 0


def _installed(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


@click.command(context_settings=dict(help_option_names=["-h", "--help"]))
@click.option("--minutes", type=float, default=None, help="Run this long after the warm-up.")
@click.option("--hours", type=float, default=None, help="Run this long after the warm-up.")
@click.option("--warmup", default=2 * len(OPTION_SETS), show_default=True, type=click.IntRange(1),
              help="Rounds before the baseline (every option set at least once).")
@click.option("--check-every", default=10, show_default=True, help="Check against float64 every this many rounds.")
@click.option("--report", "report_s", default=60.0, show_default=True, help="Seconds between report lines.")
@click.option("--rss-growth", default=64.0, show_default=True,
              help="MB of resident memory growth past the baseline that fails the run.")
@click.option("--adapters", default="auto", show_default=True,
              help="torch,jax: the adapters' training steps too; auto: those installed; none.")
@click.option("--timeout", type=float, default=None, help="The watchdog's deadline (BURSTMPI_TIMEOUT).")
def main(minutes, hours, warmup, check_every, report_s, rss_growth, adapters, timeout):
    """Run burstmpi as a long job does, and fail on growth (see the module's docstring)."""
    if timeout is not None:
        os.environ["BURSTMPI_TIMEOUT"] = str(timeout)
    seconds = 60.0 * (minutes or 0) + 3600.0 * (hours or 0) or 60.0
    which = ({n for n in ("torch", "jax") if _installed(n)} if adapters == "auto"
             else set() if adapters == "none" else set(adapters.split(",")))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"# burstmpi-soak: burstmpi {burstmpi.__version__}, {library_version()}, "
              f"{MPI.COMM_WORLD.Get_size()} ranks, thread level {MPI.Query_thread()}; {seconds / 60:.1f} min after "
              f"{warmup} warm-up rounds; adapters: {', '.join(sorted(which)) or 'none'}", flush=True)
    sys.exit(soak(seconds, warmup=warmup, check_every=check_every, report_s=report_s, rss_growth=rss_growth,
                  adapters=which, out=lambda text: print(text, flush=True)))


if __name__ == "__main__":
    main()
