"""The adapters at the MPI thread level in force: run under mpiexec with it chosen, e.g.

    MPI4PY_RC_THREAD_LEVEL=funneled mpiexec -n 2 python -m mpi4py tests/adapters/threads_check.py

Prints one JSON line per case on rank 0: {"case", "level": the level MPI gave, "refused": the
message or None, "when": "trace" where JAX refused while tracing, "err": the largest error
of the gradients (and out) against float64 burstmpi.reference, or None}.
test_adapter_threads.py reads them.
"""

import json
import threading

import numpy as np
from mpi4py import MPI

import burstmpi
from burstmpi import reference

COMM = MPI.COMM_WORLD
LEVEL = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
         MPI.THREAD_MULTIPLE: "multiple"}[MPI.Query_thread()]
LAYOUT = "zigzag"
rng = np.random.default_rng(0)
N = 8 * COMM.Get_size()
q64, k64, v64, w64 = (rng.standard_normal((1, N, 2, 8)) for _ in range(4))
o64, _ = reference.forward(q64, k64, v64, causal=True)
grads64 = reference.backward(w64, q64, k64, v64, causal=True)
q, k, v, w = (burstmpi.shard(x, layout=LAYOUT) for x in (q64, k64, v64, w64))


def error(got, want):
    err = max(np.abs(burstmpi.unshard(np.asarray(g), layout=LAYOUT) - x).max() for g, x in zip(got, want))
    return COMM.allreduce(float(err), op=MPI.MAX)


def report(case, refused=None, when=None, err=None):
    if COMM.Get_rank() == 0:
        print(json.dumps(dict(case=case, level=LEVEL, refused=refused, when=when, err=err)), flush=True)


def in_thread(fn):
    """``fn()`` on a new Python thread: its result, or the exception it raised."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except Exception as e:  # what the case gives is the point
            box["error"] = e

    t = threading.Thread(target=run, name="worker")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def jax_case():
    import jax

    jax.config.update("jax_enable_x64", True)
    import burstmpi.jax as bj

    step = jax.jit(jax.grad(lambda q, k, v: (bj.attention(q, k, v, causal=True, layout=LAYOUT) * w).sum(),
                            argnums=(0, 1, 2)))
    try:
        jax.make_jaxpr(step)(q, k, v)  # the trace only: nothing runs
    except RuntimeError as e:
        return report("jax jit grad", refused=str(e), when="trace")
    try:
        grads = step(q, k, v)
    except Exception as e:  # an error from inside XLA: recorded, and the test fails on it
        return report("jax jit grad", refused=f"{type(e).__name__}: {e}", when="run")
    report("jax jit grad", err=error(grads, grads64))


def torch_cases():
    import torch

    import burstmpi.torch as bt

    def leaves():
        return [torch.tensor(x, requires_grad=True) for x in (q, k, v)]

    def forward(ts):
        return bt.attention(*ts, causal=True, layout=LAYOUT)

    def backward(out):
        (out * torch.from_numpy(w)).sum().backward()

    def check(case, ts, out):
        report(case, err=max(error([out.detach()], [o64]), error([t.grad for t in ts], grads64)))

    ts = leaves()
    out = forward(ts)
    backward(out)
    check("torch forward and backward", ts, out)

    ts = leaves()
    out = forward(ts)
    try:
        in_thread(lambda: backward(out))
    except RuntimeError as e:
        report("torch backward on another thread", refused=str(e))
    else:
        check("torch backward on another thread", ts, out)

    ts = leaves()
    try:
        out = in_thread(lambda: forward(ts))
    except RuntimeError as e:
        report("torch forward on another thread", refused=str(e))
    else:
        backward(out)
        check("torch forward on another thread", ts, out)


jax_case()
torch_cases()
