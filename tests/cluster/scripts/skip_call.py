"""One rank skips a call: ``skip_call.py RANK [first|later]``. Every rank but RANK calls
``burstmpi.attention``; RANK goes straight on to the job's next step, a barrier. With
``later`` (the default) every rank makes one call first, so the skipped one is a later
call; with ``first`` the skipped call is the job's first (the plan's set-up is collective
too). The others must not wait forever: their watchdog names the rank that did not call.
"""

import sys

from mpi4py import MPI

import burstmpi
from burstmpi import reference as ref

comm = MPI.COMM_WORLD
skip = int(sys.argv[1]) if len(sys.argv) > 1 else 3
which = sys.argv[2] if len(sys.argv) > 2 else "later"
q, k, v, _ = (burstmpi.shard(x, layout="zigzag") for x in ref.random_problem(1, 256 * comm.Get_size(), 2, 2, 16))
if which == "later":
    burstmpi.attention(q, k, v, causal=True, layout="zigzag")
comm.Barrier()
if comm.Get_rank() == 0:
    print(f"calling burstmpi.attention on every rank but {skip}", flush=True)
if comm.Get_rank() != skip:
    burstmpi.attention(q, k, v, causal=True, layout="zigzag")
comm.Barrier()
print(f"rank {comm.Get_rank()}: past the barrier (the skipped call was not noticed)", flush=True)
