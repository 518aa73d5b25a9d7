"""What the framework adapters cost over the plain API, on the same call, in one run.

    mpiexec -n 4 python -m mpi4py examples/adapter_overhead.py [N] [heads] [head_dim] [iters]
    python examples/adapter_overhead.py 256 4 64 200     # the fixed cost per call, precisely

Times, interleaved on the same inputs (this rank's part of a global sequence of N tokens,
float32, causal, zigzag): forward, and forward + backward, through a plain
``BurstAttention`` plan (NumPy arrays), through ``burstmpi.torch.attention`` (CPU tensors
that require grad, ``out.backward(dout)``) and through ``burstmpi.jax.attention`` under
``jax.jit`` (``jax.vjp``): on XLA's buffers and, where this JAX has buffer callbacks, also
on the ``io_callback`` fallback ("jax-io"); in a rotating order. Prints the fastest of the
iterations of each, slowest rank, and each adapter's overhead over the plain call; skips a
framework that is not installed.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import burstmpi

comm = MPI.COMM_WORLD
N, H, D, ITERS = (int(a) for a in (sys.argv[1:] + ["16384", "4", "64", "3"][len(sys.argv) - 1:])[:4])
opts = dict(causal=True, layout="zigzag")
rng = np.random.default_rng(comm.Get_rank())
C = burstmpi.shard_indices(N, layout="zigzag").size
q, k, v, do = (rng.standard_normal((1, C, H, D), dtype=np.float32) for _ in range(4))

plan = burstmpi.BurstAttention(**opts)
ways = {}


def plain_fwd():
    plan.forward(q, k, v)


def plain_fb():
    out, lse = plan.forward(q, k, v)
    plan.backward(do, q, k, v, out, lse)


ways["plain"] = (plain_fwd, plain_fb)
try:
    import torch

    import burstmpi.torch as bt

    torch.set_num_threads(1)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tdo = torch.from_numpy(do)

    def torch_fwd():
        bt.attention(tq, tk, tv, **opts)

    def torch_fb():
        bt.attention(tq, tk, tv, **opts).backward(tdo)

    ways["torch"] = (torch_fwd, torch_fb)
except ImportError:
    pass
try:
    import jax

    import burstmpi.jax as bj

    jq, jk, jv, jdo = (jax.numpy.asarray(x) for x in (q, k, v, do))

    def jax_way(buffers):
        """Forward and f+b under jit, on XLA's buffers or (``buffers`` False) on the
        io_callback fallback that a JAX without buffer_callback takes (the flag is read when
        a function is traced: its first call)."""
        f = lambda q, k, v: bj.attention(q, k, v, **opts)
        jf = jax.jit(f)
        jfb = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))

        def run(fn, *args):
            kept = bj._BUFFERS
            bj._BUFFERS = kept and buffers
            try:
                jax.block_until_ready(fn(*args))
            finally:
                bj._BUFFERS = kept

        return (lambda: run(jf, jq, jk, jv)), (lambda: run(jfb, jq, jk, jv, jdo))

    ways["jax"] = jax_way(True)
    if bj._BUFFERS:  # this JAX has buffer callbacks: time the fallback beside them
        ways["jax-io"] = jax_way(False)
except ImportError:
    pass

best = {(w, p): float("inf") for w in ways for p in ("fwd", "f+b")}
names = list(ways)
for it in range(ITERS + 1):  # the first round warms up (plans, jit compilation)
    for w in names[it % len(names):] + names[:it % len(names)]:  # each way goes first once
        fwd, fb = ways[w]
        for phase, fn in (("fwd", fwd), ("f+b", fb)):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if it:
                best[w, phase] = min(best[w, phase], t)
if comm.Get_rank() == 0:
    print(f"# adapter overhead: {comm.Get_size()} ranks, N {N}, heads {H}, head dim {D}, float32, causal zigzag; "
          f"fastest of {ITERS}, slowest rank")
    for phase in ("fwd", "f+b"):
        base = best["plain", phase]
        cells = [f"{w} {1e3 * best[w, phase]:.2f} ms" + ("" if w == "plain" else
                 f" ({1e3 * (best[w, phase] - base):+.2f} ms, {100 * (best[w, phase] / base - 1):+.1f} %)")
                 for w in ways]
        print(f"{phase:4s}: " + ", ".join(cells))
