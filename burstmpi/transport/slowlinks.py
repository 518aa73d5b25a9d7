"""A simulation aid: MPI with the links between nodes slowed to a given bandwidth.

``BURSTMPI_INTERNODE_GBPS=X`` (``burstmpi-bench --internode-gbps X``) makes one machine
behave, for the ring's transfers, like a cluster whose nodes (``transport.nodes``, faked
with ``BURSTMPI_RANKS_PER_NODE``) talk over a network of X GB/s per rank (gigabytes, as
the performance model's figures): a message from another node is not complete before
its bytes could have crossed such a link. Each rank's inbound link carries one message at
a time (a message waits for the ones posted before it), so a rank receiving from several
nodes pays for all of them, as a NIC would. Transfers inside a node run at the machine's
own speed. The link is the rank's: the transfers of every plan and communicator of a
process (the two-level ring's outer ring and its partials going home) queue on it. Host
buffers over MPI only: the shared-memory transport reads packets in place and is not used
while the setting is on.

It models the bandwidth, not the latency, of the network, and it only delays: where the
machine's own transfers are slower than X, they stay as slow.
"""

import time

from mpi4py import MPI

from .comm import MPITransport, complete

__all__ = ["SlowLinksTransport"]

# When this process's inbound network link has carried what it was given: one link per
# rank (a process), shared by every transport of every plan and communicator of it.
_link_free = [0.0]


class _Due:
    """An MPI request that also may not complete before ``due`` (``time.perf_counter``)."""

    def __init__(self, request, due):
        self.request, self.due = request, due


class SlowLinksTransport(MPITransport):
    """``MPITransport`` whose receives from other nodes take at least bytes / ``gbps``."""

    name = "mpi (inter-node links slowed)"

    def __init__(self, comm, nodes, gbps):
        super().__init__(comm)
        self.nodes, self.rate = nodes, float(gbps) * 1e9

    def irecv(self, buf, source, tag):
        request = super().irecv(buf, source, tag)
        if not self.nodes.remote(self.comm.Get_rank(), source):
            return request
        start = max(time.perf_counter(), _link_free[0])
        _link_free[0] = start + buf.nbytes / self.rate
        return _Due(request, _link_free[0])

    @staticmethod
    def _split(requests):
        reqs = [r.request if isinstance(r, _Due) else r for r in requests]
        due = max((r.due for r in requests if isinstance(r, _Due)), default=0.0)
        return reqs, due

    def wait(self, requests):
        reqs, due = self._split(requests)
        complete(reqs, self.idle)
        left = due - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def progress(self, requests):
        reqs, due = self._split(requests)
        return MPI.Request.Testall(reqs) and time.perf_counter() >= due
