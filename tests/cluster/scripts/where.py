"""Where each rank runs and what burstmpi makes of it: ``where.py DIR`` writes one JSON
file per rank, ``DIR/rank<r>.json`` (lines on stdout from several ranks can interleave).

Run under mpiexec on the emulated hosts (``tests/cluster/test_cluster.py``): the hostname,
the nodes burstmpi sees (``burstmpi._transport.nodes``, from MPI's shared-memory split), the
transport ``transport="auto"`` picks for host arrays, and what ``transport="shm"`` does
(the transport, or the error it raises when the ranks span several nodes).
"""

import json
import socket
import sys
from pathlib import Path

from mpi4py import MPI

import burstmpi
from burstmpi import reference as ref
from burstmpi._transport.nodes import nodes

comm = MPI.COMM_WORLD
q, k, v, _ = (burstmpi.shard(x, layout="contiguous")
              for x in ref.random_problem(1, 32 * comm.Get_size(), 2, 2, 16, seed=0))
found = {"rank": comm.Get_rank(), "host": socket.gethostname(), "nodes": nodes(comm).describe(),
         "shared_split": comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()}
for transport in ("auto", "shm"):
    plan = burstmpi.BurstAttention(transport=transport, layout="contiguous")
    try:
        plan.forward(q, k, v)
        found[transport] = type(plan.transport).__name__
    except ValueError as e:  # raised on every rank alike
        found[transport] = f"ValueError: {e}"
(Path(sys.argv[1]) / f"rank{comm.Get_rank()}.json").write_text(json.dumps(found))
