"""Long-sequence attention in plain NumPy: each rank makes and holds only its part.

    mpiexec -n 2 python -m mpi4py examples/numpy_attention.py [N]      # N: global tokens, default 8192

Any rank count and any N >= 1 work (N need not divide by the ranks). Each rank asks
``burstmpi.shard_indices`` which global positions it holds under the zigzag layout (the
one that balances causal work) and makes q, k, v and the upstream gradient for those
positions only, as a data loader that reads its own slice of a long sequence would: the
global arrays never exist on any rank during the attention. ``burstmpi.attention`` runs the
causal forward over the ring, ``burstmpi.attention_backward`` the backward.

The check then gathers K, V, q and dout with ``burstmpi.unshard`` (the float64 reference
needs every key) and compares 64 of this rank's query rows (out, dq) and 64 of its key rows
(dk, dv) with ``burstmpi.reference``, which computes them in float64 on the global
sequence. Prints, on rank 0, the times, the largest error against float64 of each quantity
relative to max(1, its largest value) (float32 rounding: about 1e-7 to 1e-6), and whether
the global result that ``unshard`` gives each rank has the same bits on every rank; exits
non-zero when an error is above 1e-4 (float32 rounding is far below) or the bits differ.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import burstmpi
from burstmpi import reference

comm = MPI.COMM_WORLD
rank0 = comm.Get_rank() == 0
N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
B, H, HKV, D = 1, 8, 2, 64          # grouped-query attention: 8 query heads share 2 K/V heads
LAYOUT, BLOCK = "zigzag", 1024


def make(name, positions, heads):
    """Rows ``positions`` of a global (B, N, heads, D) float32 array, generated in
    1024-token blocks seeded by (name, block): any rank can make any rows without the rest."""
    out = np.empty((B, len(positions), heads, D), dtype=np.float32)
    blocks = positions // BLOCK
    for b in np.unique(blocks):
        rng = np.random.default_rng([sum(map(ord, name)), int(b)])
        block = rng.standard_normal((B, BLOCK, heads, D), dtype=np.float32)
        mine = blocks == b
        out[:, mine] = block[:, positions[mine] % BLOCK]
    return out


pos = burstmpi.shard_indices(N, layout=LAYOUT)          # this rank's global positions
ql, kl, vl, dol = make("q", pos, H), make("k", pos, HKV), make("v", pos, HKV), make("dout", pos, H)

comm.Barrier()
t0 = time.perf_counter()
out, lse = burstmpi.attention(ql, kl, vl, causal=True, layout=LAYOUT, return_lse=True)
t1 = time.perf_counter()
dq, dk, dv = burstmpi.attention_backward(dol, ql, kl, vl, out, lse, causal=True, layout=LAYOUT)
t2 = time.perf_counter()
fwd, bwd = comm.allreduce(t1 - t0, op=MPI.MAX), comm.allreduce(t2 - t1, op=MPI.MAX)

# The check: float64 on the global sequence, for 64 query rows and 64 key rows of this rank.
q, k, v, dout = (burstmpi.unshard(x, layout=LAYOUT) for x in (ql, kl, vl, dol))
some = np.unique(np.linspace(0, pos.size - 1, min(64, pos.size)).astype(int))
o64, _, dq64 = reference.rows(ql[:, some], k, v, dol[:, some], pos[some], causal=True)
# dk, dv of key rows need every query's lse and delta = rowsum(dout * out): the backward's
# inputs, taken from our forward (checked just above).
lse_all = burstmpi.unshard(lse, layout=LAYOUT, axis=2)                      # (B, H, N)
out_all = burstmpi.unshard(out, layout=LAYOUT)
delta = (dout.astype(np.float64) * out_all).sum(-1).transpose(0, 2, 1)       # (B, H, N)
if some.size:  # (a rank holds no token when N is below the number of ranks)
    dk64, dv64 = reference.key_rows(q, kl[:, some], vl[:, some], dout, lse_all, delta, pos[some], causal=True)
else:
    dk64, dv64 = dk[:, some], dv[:, some]


def rel(ours, exact, name):
    """Largest error over every rank, relative to the largest value over every rank (absolute
    where that is below 1: a gradient that is exactly 0, as with a single token, stays 0)."""
    err = comm.allreduce(float(np.abs(ours - exact).max(initial=0)), op=MPI.MAX)  # a rank may hold no token
    return name, err / max(1.0, comm.allreduce(float(np.abs(exact).max(initial=0)), op=MPI.MAX))


errs = [rel(out[:, some], o64, "out"), rel(dq[:, some], dq64, "dq"),
        rel(dk[:, some], dk64, "dk"), rel(dv[:, some], dv64, "dv")]
worst = max(e for _, e in errs)
same = len(set(comm.allgather(out_all.tobytes()))) == 1
if rank0:
    print(f"numpy attention: {comm.Get_size()} ranks, {N} tokens causal {LAYOUT}, {H}/{HKV} heads, head dim {D}, "
          f"float32; forward {fwd:.2f} s (a first call:\n"
          f"  it includes loading the compiled CPU kernels), backward {bwd:.2f} s, slowest rank")
    print("  " + ", ".join(f"{n} {e:.1e}" for n, e in errs))
    print(f"numpy attention: out, dq, dk, dv, largest error against float64 {worst:.1e} (relative to "
          f"max(1, largest value)); the same bits on every rank: {same}")
if worst > 1e-4 or not same:  # float32: far above rounding (the same verdict on every rank)
    sys.exit(f"numpy attention: FAILED (error {worst:.1e}, the same bits: {same})" if rank0 else 1)
