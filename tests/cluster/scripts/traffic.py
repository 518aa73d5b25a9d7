"""MB megabytes each way between two ranks of one host and between two ranks of different
hosts: ``traffic.py MB DIR``. With two ranks per host, ranks 0 and 1 share host0, ranks 2
and 4 sit on host1 and host2. Ranks 0 and 2 write ``DIR/pair<a>-<b>.json``: the pair, the
seconds, the rate (MiB/s). The harness reads the bridge ports' byte counters around it.

The pairs run one after the other, and the ranks not in the pair wait asleep: 8 ranks share
the machine's 2 cores, and MPICH's blocking calls spin, so 6 spinning ranks starved the
pair inside host0 (a CI run measured it at 191 MiB/s, below twice the link's 113).
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, mb = comm.Get_rank(), int(sys.argv[1])


def barrier_asleep():
    """A barrier that leaves the cores to the pair being measured."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


buf = np.ones(mb << 18, np.float32)  # mb MiB
for a, b in [(0, 1), (2, 4)]:
    if rank == a:
        t = time.perf_counter()
        comm.Send(buf, b, 7)
        comm.Recv(buf, b, 8)
        secs = time.perf_counter() - t
        result = {"pair": [a, b], "seconds": secs, "mb_per_s": 2 * mb / secs}
        (Path(sys.argv[2]) / f"pair{a}-{b}.json").write_text(json.dumps(result))
    elif rank == b:
        comm.Recv(buf, a, 7)
        comm.Send(buf, a, 8)
    barrier_asleep()
