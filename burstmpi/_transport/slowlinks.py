"""A simulation aid: MPI with the links between nodes slowed to a given bandwidth.

``BURSTMPI_INTERNODE_GBPS=X`` (``burstmpi-bench --internode-gbps X``) makes one machine
behave, for the ring's transfers, like a cluster whose nodes (``transport.nodes``, faked
with ``BURSTMPI_RANKS_PER_NODE``) talk over a network of X GB/s per rank (gigabytes, as
the performance model's figures): a message from another node is not complete before
its bytes could have crossed such a link, counted from when MPI has it here (both sides
posted: what the ring's polling observes) or when the link has delivered the message
before it. Each rank's inbound link carries one message at a time, so a rank receiving
from several nodes pays for all of them, as a NIC would. Transfers inside a node run at the machine's
own speed. The link is the rank's: the transfers of every plan and communicator of a
process (the two-level ring's outer ring and its partials going home) queue on it. Host
buffers over MPI only: the shared-memory transport reads packets in place and is not used
while the setting is on.

It models the bandwidth, not the latency, of the network, and it only delays: where the
machine's own transfers are slower than X, they stay as slow.
"""

import time

from mpi4py import MPI

from .._config import settings
from .mpi import MPITransport

__all__ = ["SlowLinksTransport", "refuse_device_arrays"]

# When this process's inbound network link has carried what it was given: one link per
# rank (a process), shared by every transport of every plan and communicator of it.
_link_free = [0.0]


def refuse_device_arrays(where, nodes, gbps=None):
    """Raise ValueError (its message starting with ``where``) when the setting is on across
    nodes for GPU arrays: their transfers (NCCL, a CUDA-aware or staged MPI) never pass
    through these slowed links, so a run would look like a cluster's while it is not.
    ``gbps``: the caller's setting, default the environment's."""
    gbps = settings().internode_gbps if gbps is None else gbps
    if gbps and nodes.count > 1:
        raise ValueError(f"{where}: BURSTMPI_INTERNODE_GBPS (--internode-gbps) slows host transfers between "
                         f"fake nodes, a simulation aid for host arrays; got GPU arrays with it set to {gbps:g}")


class _Due:
    """A receive from another node: its MPI request, its bytes, and once MPI has completed
    it, when the slowed link would have delivered it (``due``)."""

    def __init__(self, request, nbytes):
        self.request, self.nbytes, self.due = request, nbytes, None


class SlowLinksTransport(MPITransport):
    """``MPITransport`` whose receives from other nodes take at least bytes / ``gbps``,
    counted from when the message could first move: MPI's completion of the receive (both
    sides posted, the data here), or the end of the link's previous message."""

    name = "mpi (inter-node links slowed)"

    def __init__(self, comm, nodes, gbps):
        super().__init__(comm)
        self.nodes, self.rate = nodes, float(gbps) * 1e9

    def on(self, comm):
        """Plain MPI over another communicator: the two-level ring slows its outer ring
        itself, whose ranks are numbered by node."""
        return self._like(MPITransport(comm))

    def irecv(self, buf, source, tag):
        request = super().irecv(buf, source, tag)
        if not self.nodes.remote(self.comm.Get_rank(), source):
            return request
        return _Due(request, buf.nbytes)

    def _arrived(self, r):
        """``r``'s MPI receive has just been seen complete: book the link."""
        start = max(time.perf_counter(), _link_free[0])
        r.due = _link_free[0] = start + r.nbytes / self.rate

    def wait(self, requests, peers=()):
        peers = list(peers) + [None] * (len(requests) - len(peers))
        plain = [(r, p) for r, p in zip(requests, peers) if not isinstance(r, _Due)]
        super().wait([r for r, _ in plain], [p for _, p in plain])
        for r, p in zip(requests, peers):
            if isinstance(r, _Due) and r.due is None:
                super().wait([r.request], [p])
                self._arrived(r)
        left = max((r.due for r in requests if isinstance(r, _Due)), default=0.0) - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def progress(self, requests):
        done = MPI.Request.Testall([r for r in requests if not isinstance(r, _Due)])
        now = time.perf_counter()
        for r in requests:
            if isinstance(r, _Due):
                if r.due is None and r.request.Test():
                    self._arrived(r)
                done = done and r.due is not None and now >= r.due
        return done
