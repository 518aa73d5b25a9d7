"""A long job's communicators: make one, use it, free it, round after round.

    mpiexec -n 2 python -m mpi4py examples/make_use_free.py [ROUNDS] [REPORTS]   # default 1100 rounds

Each round duplicates ``MPI.COMM_WORLD``, runs ``burstmpi.attention`` on the duplicate
(causal, zigzag) and frees it, as a training loop or a numerics code that makes its own
communicators does. Everything burstmpi made for the duplicate (its own duplicate of it,
the ranks' shared window, the cached plan) goes with it, so the loop runs past the
communicators MPI has (MPICH: 2,048; before burstmpi freed its own with the caller's, this
loop died at round 1,023 at 2 and 3 ranks).

At round 100 and at the rounds in REPORTS (commas; default: the last) rank 0 prints the
largest rank's resident memory, the shared memory (``/dev/shm``) this job maps, and how
many more communicators MPI can still make (every rank duplicates ``COMM_WORLD`` until MPI
refuses, up to 4,096, then frees them all). The round's result is checked against float64
(``burstmpi.reference``) at each report. Prints, on rank 0, the largest error against
float64 and whether the ranks got the same bits; exits non-zero when the communicators MPI
can make went down, the error is above 1e-4, or the bits differ.
"""

import sys

import numpy as np
from mpi4py import MPI

import burstmpi
from burstmpi import reference

world = MPI.COMM_WORLD
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1100
reports = sorted({100, rounds} | {int(r) for r in sys.argv[2].split(",")} if len(sys.argv) > 2 else {100, rounds})
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 64 * world.Get_size() + 3, 2, 16), dtype=np.float32) for _ in range(3))
exact, _ = reference.forward(q, k, v, causal=True)


def resident_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def shm_bytes():
    """Bytes of /dev/shm files this process maps (deleted ones too), each file once."""
    seen = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                seen[parts[4]] = seen.get(parts[4], 0) + hi - lo
    return sum(seen.values())


def communicators_left(most=4096):
    made = []
    try:
        while len(made) < most:
            made.append(world.Dup())
    except MPI.Exception:  # MPI ran out (an error every rank gets: the context id is agreed)
        pass
    for c in made:
        c.Free()
    return len(made)


left, err, same = [], 0.0, True
for i in range(1, rounds + 1):
    comm = world.Dup()
    ql, kl, vl = (burstmpi.shard(x, comm=comm, layout="zigzag") for x in (q, k, v))
    out = burstmpi.attention(ql, kl, vl, comm=comm, causal=True, layout="zigzag")
    if i in reports:
        full = burstmpi.unshard(out, comm=comm, layout="zigzag")
        err = max(err, float(abs(full - exact).max()))
        same &= len(set(world.allgather(full.tobytes()))) == 1
    comm.Free()
    if i in reports:
        left.append(communicators_left())
        rss, shm = (max(world.allgather(x)) for x in (resident_bytes(), shm_bytes()))
        if world.Get_rank() == 0:
            print(f"round {i}: resident memory {rss / 2**20:.1f} MB, /dev/shm mapped {shm / 2**20:.1f} MB, "
                  f"communicators MPI can still make {left[-1]}", flush=True)
if world.Get_rank() == 0:
    print(f"{rounds} communicators made, used and freed: largest error against float64 {err:.1e}; "
          f"the same bits on every rank: {same}")
sys.exit(0 if left[-1] >= left[0] and err < 1e-4 and same else 1)
