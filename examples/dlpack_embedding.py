"""burstmpi inside numerics code that is not PyTorch: NumPy arrays on CPUs, CuPy arrays on GPUs.

    mpiexec -n 2 python -m mpi4py examples/dlpack_embedding.py [N]          # NumPy; then CuPy where every rank has a GPU
    mpiexec -n 2 python -m mpi4py examples/dlpack_embedding.py [N] --cupy   # the same, but no GPU is an error, not a skip
    mpiexec -n 2 python -m mpi4py examples/dlpack_embedding.py [N] --numpy  # the NumPy path only

An attention layer written once against an array namespace ``xp`` (NumPy or CuPy), as a
solver or simulation code would write it: its own projections, and burstmpi's ring as the
one distributed step, through a ``BurstAttention`` plan it keeps (forward, then backward).
burstmpi takes the caller's arrays as they are, any DLPack producer: host arrays as NumPy
views, GPU arrays without a copy on the caller's current CUDA stream; and it gives results
back as the same kind (NumPy in, NumPy out; CuPy in, CuPy out), so the layer never converts
anything. Nothing here imports PyTorch or JAX.

On a GPU each rank first selects the device burstmpi will use (its index on its node modulo
the visible GPUs), so its arrays are made there. Without a GPU (or without CuPy) on every rank
the CuPy path is skipped with the line "no GPU: ran the NumPy path only" (``--cupy`` makes
that an error saying why).

Each path checks 64 query rows (out, dq) and 64 key rows (dk, dv) of every rank against
``burstmpi.reference`` in float64 on the global sequence and prints, on rank 0, the array
types in and out, the largest error against float64 relative to max(1, the largest value),
and whether every rank holds the same bits of the layer's weight gradient (summed over the
ranks, as data parallelism does); exits non-zero when an error is above 1e-4 (float32
rounding is far below) or the bits differ.
"""

import sys

import numpy as np
from mpi4py import MPI

import burstmpi
from burstmpi import reference

comm = MPI.COMM_WORLD
rank0 = comm.Get_rank() == 0
args = [a for a in sys.argv[1:] if not a.startswith("--")]
N = int(args[0]) if args else 4096
B, E, H, HKV, D = 1, 128, 4, 2, 64   # model width E; 4 query heads share 2 K/V heads of dim 64
LAYOUT = "zigzag"


def layer_forward(xp, plan, x, w_qkv, w_o):
    """y = attention(x w_q, x w_k, x w_v) w_o on this rank's tokens x (B, C, E), in ``xp``."""
    C = x.shape[1]
    qkv = x @ w_qkv                                          # (B, C, (H + 2 HKV) D)
    q = qkv[..., :H * D].reshape(B, C, H, D)
    k = qkv[..., H * D:(H + HKV) * D].reshape(B, C, HKV, D)
    v = qkv[..., (H + HKV) * D:].reshape(B, C, HKV, D)
    out, lse = plan.forward(q, k, v)                         # collective: the ring over every rank
    return out.reshape(B, C, H * D) @ w_o, (x, q, k, v, out, lse)


def layer_backward(xp, plan, dy, saved, w_qkv, w_o):
    """Gradients (dx, dw_qkv, dw_o, and the attention's dout, dq, dk, dv) of ``layer_forward``."""
    x, q, k, v, out, lse = saved
    C = x.shape[1]
    dw_o = out.reshape(B * C, H * D).T @ dy.reshape(B * C, E)
    dout = (dy @ w_o.T).reshape(B, C, H, D)
    dq, dk, dv = plan.backward(dout, q, k, v, out, lse)      # collective
    dqkv = xp.concatenate([g.reshape(B, C, -1) for g in (dq, dk, dv)], axis=-1)
    return dqkv @ w_qkv.T, x.reshape(B * C, E).T @ dqkv.reshape(B * C, -1), dw_o, (dout, dq, dk, dv)


def run(xp, host):
    """The layer on ``xp`` arrays; ``host(a)`` gives a NumPy copy of an ``xp`` array."""
    rng = np.random.default_rng(0)                           # the same weights and text on every rank
    w_qkv = rng.standard_normal((E, (H + 2 * HKV) * D), dtype=np.float32) / np.float32(np.sqrt(E))
    w_o = rng.standard_normal((H * D, E), dtype=np.float32) / np.float32(np.sqrt(H * D))
    x_all = rng.standard_normal((B, N, E), dtype=np.float32)
    dy_all = rng.standard_normal((B, N, E), dtype=np.float32)
    pos = burstmpi.shard_indices(N, layout=LAYOUT)           # this rank's global positions
    x, dy = xp.asarray(x_all[:, pos]), xp.asarray(dy_all[:, pos])
    w_qkv, w_o = xp.asarray(w_qkv), xp.asarray(w_o)

    plan = burstmpi.BurstAttention(causal=True, layout=LAYOUT)
    y, saved = layer_forward(xp, plan, x, w_qkv, w_o)
    dx, dw_qkv, dw_o, (dout, dq, dk, dv) = layer_backward(xp, plan, dy, saved, w_qkv, w_o)
    _, q, k, v, out, lse = saved
    kinds = {type(a).__module__.split(".")[0] + "." + type(a).__name__ for a in (out, lse, dq, dk, dv, y, dx)}
    assert kinds == {type(x).__module__.split(".")[0] + "." + type(x).__name__}, kinds   # same kind out
    assert {str(a.dtype) for a in (out, dq, dk, dv, y, dx)} == {"float32"}

    # Data parallelism: the weight gradient summed over the ranks (on the host, for MPI).
    dw = host(dw_qkv)
    comm.Allreduce(MPI.IN_PLACE, dw, op=MPI.SUM)
    same = len(set(comm.allgather(dw.tobytes()))) == 1

    # The check, on the host: the global q, k, v, dout (the float64 reference needs them all).
    q, k, v, dout, out, lse, dq, dk, dv = (host(a) for a in (q, k, v, dout, out, lse, dq, dk, dv))
    qg, kg, vg, dog, og = (burstmpi.unshard(a, layout=LAYOUT) for a in (q, k, v, dout, out))
    lse_g = burstmpi.unshard(lse, layout=LAYOUT, axis=2)
    some = np.unique(np.linspace(0, pos.size - 1, min(64, pos.size)).astype(int))
    o64, _, dq64 = reference.rows(q[:, some], kg, vg, dout[:, some], pos[some], causal=True)
    delta = (dog.astype(np.float64) * og).sum(-1).transpose(0, 2, 1)       # rowsum(dout * out): (B, H, N)
    dk64, dv64 = (reference.key_rows(qg, k[:, some], v[:, some], dog, lse_g, delta, pos[some], causal=True)
                  if some.size else (dk[:, some], dv[:, some]))
    worst = 0.0
    for ours, exact in ((out[:, some], o64), (dq[:, some], dq64), (dk[:, some], dk64), (dv[:, some], dv64)):
        err = comm.allreduce(float(np.abs(ours - exact).max(initial=0)), op=MPI.MAX)
        worst = max(worst, err / max(1.0, comm.allreduce(float(np.abs(exact).max(initial=0)), op=MPI.MAX)))
    return type(x), type(y), worst, same, plan.last_stats


def gpu_count():
    """Visible GPUs, 0 without CuPy or a driver; with ``--cupy`` such a failure is an error."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        if "--cupy" in sys.argv:
            raise
        return 0


count = 0 if "--numpy" in sys.argv else gpu_count()
paths = ["numpy"]
if comm.allreduce(count > 0, op=MPI.LAND):                   # every rank has a GPU
    import cupy

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    cupy.cuda.Device(node.Get_rank() % count).use()          # the GPU burstmpi picks for this rank
    node.Free()
    paths.append("cupy")
elif "--cupy" in sys.argv:
    raise SystemExit(f"--cupy: this rank sees {count} GPUs, and every rank needs one")
for name in paths:
    xp, host = (np, np.array) if name == "numpy" else (cupy, cupy.asnumpy)
    t_in, t_out, err, same, stats = run(xp, host)
    if rank0:
        print(f"dlpack embedding: {name}, {comm.Get_size()} ranks, {N} tokens causal {LAYOUT}, on burstmpi's "
              f"{stats.backend} backend over {stats.transport}: {t_in.__module__}.{t_in.__name__} in, "
              f"{t_out.__module__}.{t_out.__name__} out (the same type: {t_in is t_out})")
        print(f"dlpack embedding ({name}): out, dq, dk, dv, largest error against float64 {err:.1e} (relative "
              f"to max(1, largest value)); the same bits on every rank: {same}")
    if err > 1e-4 or not same:  # far above float32 rounding; the same verdict on every rank
        sys.exit(f"dlpack embedding ({name}): FAILED" if rank0 else 1)
if "cupy" not in paths and rank0:
    print("no GPU: ran the NumPy path only" + (" (--numpy)" if "--numpy" in sys.argv else ""))
