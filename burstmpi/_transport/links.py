"""How fast this job's links are, for ``topology="auto"``: inside a node and between nodes.

``BURSTMPI_LINK_GBPS=INTRA,INTER`` gives them (GB/s one way, per rank). Otherwise they are
measured once per plan, collectively: every rank sends ``nbytes`` to the next rank of its
node while it receives from the previous one (the inner ring's pattern, all links busy at
once), then the same with the rank of its local index on the next node (the outer
ring's), ``reps`` times each; a speed is ``nbytes`` over the slowest rank's best time.
For host arrays the figures are MPI's on host buffers; for GPU arrays they are the plan's
own transport's on device buffers (``transport=``: NCCL, or MPI staged through the host),
timed until the host has seen the transfers end (NCCL's ``finish``).
``BURSTMPI_INTERNODE_GBPS`` (the simulation aid of ``slowlinks``) caps the inter-node
figure, as it caps those transfers.
"""

import numpy as np
from mpi4py import MPI

from .. import _config as config
from .mpi import MPITransport
from .watchdog import DEFAULT_TIMEOUT, allgather

__all__ = ["link_speeds"]


def _ring_seconds(comm, transport, dest, source, send, recv, reps):
    """The slowest rank's best time to send ``send`` to ``dest`` while receiving from
    ``source`` over ``transport`` (on ``comm``): one group of the send and the receive,
    waited for and finished, so an asynchronous transport's time is the host's."""
    best = float("inf")
    for _ in range(reps):
        transport.complete([comm.Ibarrier()], "the barrier before timing a link")
        t0 = MPI.Wtime()
        with transport.group():
            reqs = [transport.isend(send, dest, 17), transport.irecv(recv, source, 17)]
        transport.wait(reqs, [("send a link's timing message to", dest), ("receive one from", source)])
        transport.finish()
        best = min(best, MPI.Wtime() - t0)
    return max(allgather(comm, best, transport.timeout, "the allgather of the links' timings"))


def link_speeds(comm, nodes, nbytes=4 << 20, reps=3, transport=None, alloc=None, timeout=DEFAULT_TIMEOUT,
                settings=None):
    """(intra, inter) GB/s of ``comm``'s ranks on ``nodes`` (equal nodes of 2+ ranks, two or
    more of them): configured, or measured (collective): by MPI on host buffers, or by
    ``transport`` (over ``comm``) on buffers ``alloc(nbytes)`` makes (the GPU's); every
    wait has ``transport``'s deadline, or ``timeout`` on host buffers. ``settings``: the
    caller's ``config.Settings`` (its ``link_gbps`` and ``internode_gbps``), default the
    environment's."""
    cfg = config.settings() if settings is None else settings
    if cfg.link_gbps:
        intra, inter = cfg.link_gbps
    else:
        if transport is None:  # host buffers through MPI
            transport, alloc = MPITransport(comm), lambda n: np.ones(n, np.uint8)
            transport.timeout = timeout
        send, recv = alloc(nbytes), alloc(nbytes)
        node, i = nodes.node, nodes.local_rank
        mine, N = nodes.members[node], nodes.count
        inner = (mine[(i + 1) % len(mine)], mine[(i - 1) % len(mine)])
        outer = (nodes.members[(node + 1) % N][i], nodes.members[(node - 1) % N][i])
        intra, inter = (nbytes / _ring_seconds(comm, transport, *peers, send, recv, reps) / 1e9
                        for peers in (inner, outer))
    if cfg.internode_gbps:
        inter = min(inter, cfg.internode_gbps)
    return float(intra), float(inter)
