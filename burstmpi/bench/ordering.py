"""``burstmpi-gpucheck``'s stream-ordering check on silicon: the NCCL ring run again with
its comm stream held back, then with the compute stream held back, must give the same bits.

A missing or misplaced wait between the compute and comm streams is a data race that a
GPU may or may not show on a given run. Holding one stream back at every group and
allgather (``NCCLTransport.delay``: cuda/probe.cu's ``stream_delay``) makes the race lose:
with the comm stream late, a kernel that reads a packet before its transfer arrived reads
the old one, and a buffer refilled before its send left is sent refilled; with the compute
stream late, a send that does not wait for the kernels sends what was there before. Each
changes the result's bits; the undelayed run's bits are the reference. The CPU tests prove
the same waits on an asynchronous fake device with a stream sanitizer
(tests/gpu/test_stream_order.py); this is the check that the fake matches a GPU.
"""

import zlib

import numpy as np

from .. import reference as ref
from .._api import shard
from .._decode.cache import KVCache
from .._plan import BurstAttention

__all__ = ["DELAYS", "delayed_runs_differ"]

# Long against a ring step of the check's small problems (tens of microseconds).
DELAYS = (("comm", 200_000), ("compute", 200_000))


def _digest(xp, arrays):
    xp.cuda.get_current_stream().synchronize()
    return zlib.crc32(b"".join(np.ascontiguousarray(xp.asnumpy(a)).tobytes() for a in arrays))


def _ring(xp, comm, layout, causal, mode, n, dtype, d, transport):
    q, k, v, do = ref.random_problem(1, n, 4, 2, d, dtype=dtype, seed=comm.Get_size())
    plan = BurstAttention(comm, causal=causal, layout=layout, bwd_comm=mode, backend="cuda", transport=transport)
    loc = [xp.asarray(shard(x, comm=comm, layout=layout)) for x in (q, k, v, do)]
    out, lse = plan.forward(*loc[:3])
    grads = plan.backward(loc[3], *loc[:3], out, lse)
    return _digest(xp, (out, lse) + tuple(grads))


def _decode(xp, comm, n, dtype, d, transport):
    T = 3
    q, k, v, _ = ref.random_problem(1, n + 2 * T, 8, 2, d, dtype=dtype, seed=comm.Get_size())
    cache = KVCache(comm, capacity=n + 2 * T, batch=1, kv_heads=2, head_dim=d, dtype=dtype, backend="cuda",
                    transport=transport)
    cache.prefill(*(xp.asarray(shard(x[:, :n], comm=comm)) for x in (q, k, v)), layout="contiguous")
    outs = [cache.decode(*(xp.asarray(x[:, s:s + T]) for x in (q, k, v))) for s in (n, n + T)]
    return _digest(xp, outs)


def delayed_runs_differ(xp, comm, n, dtype=np.float32, d=64, transport="nccl"):
    """Lines naming each run whose bits differ from the undelayed run's, for the ring (three
    backward modes) and the decode, ``n`` tokens of head dim ``d`` (``xp``: CuPy, or a
    stand-in); [] when every held-back stream gives the same bits."""
    from .._transport.nccl import NCCLTransport

    runs = {f"ring zigzag causal {m}": (lambda m=m: _ring(xp, comm, "zigzag", True, m, n, dtype, d, transport))
            for m in ("burst", "ring")}
    runs["ring contiguous two-way"] = lambda: _ring(xp, comm, "contiguous", False, "two-way", n, dtype, d, transport)
    runs["decode"] = lambda: _decode(xp, comm, n, dtype, d, transport)
    bad = []
    for what, run in runs.items():
        base = run()
        for delay in DELAYS:
            NCCLTransport.delay = delay
            try:
                got = run()
            finally:
                NCCLTransport.delay = None
            if got != base:
                bad.append(f"r{comm.Get_rank()} {what}: the {delay[0]} stream held back {delay[1] / 1e3:.0f} us "
                           "changed the bits (a missing wait between the streams)")
    return bad
