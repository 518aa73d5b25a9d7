"""An ordered fake transport: MPI made to match messages the way NCCL does.

NCCL has no tags. A send from rank a to rank b on a communicator meets b's next receive
from a on it, strictly in the order each side issued them, whatever either side meant
the message to be. MPI matches by tag as well, so a schedule whose ranks post the same
transfers in different orders (an inner-ring packet on one side, an outer-ring packet or
a gradient partial on the other) works over MPI and then pairs the wrong buffers, or
waits forever, over NCCL: the bug MindSpeed's double ring had.

``FifoTransport`` sends every message with one MPI tag, so MPI's non-overtaking rule
makes matching first-in first-out per (source, communicator), exactly NCCL's, and puts
the tag and size the sender meant in a header. A receive whose message was meant as
another (a different tag or size) raises ``MisPaired`` on the receiving rank instead of
delivering it: a test over this transport fails where a schedule would mis-pair over
NCCL. It sends every message eagerly (Isend of a private copy), which NCCL does not
promise: it checks the order of matching, not the group discipline (``Channel.post``)
that keeps NCCL's sends from blocking each other.
"""

import numpy as np
from mpi4py import MPI

from burstmpi.transport.comm import MPITransport

__all__ = ["FifoTransport", "MisPaired"]

ONE_TAG = 7  # every message travels with this MPI tag
_HEADER = 2  # int64 words: the tag the sender meant, the payload's bytes


class MisPaired(AssertionError):
    """A receive met a message meant as another: the ranks' orders disagree."""


class _Recv:
    def __init__(self, request, staging, into, source, tag, comm):
        self.request, self.staging, self.into = request, staging, into
        self.source, self.tag, self.comm = source, tag, comm
        self.checked = False

    def finish(self):
        """Check the arrived header against what this receive expected; deliver the payload."""
        if self.checked:
            return
        self.checked = True
        tag, nbytes = (int(x) for x in self.staging[:8 * _HEADER].view(np.int64))
        if (tag, nbytes) != (self.tag, self.into.nbytes):
            raise MisPaired(f"rank {self.comm.Get_rank()}: a receive from rank {self.source} expecting tag "
                            f"{self.tag} ({self.into.nbytes} bytes) met the message sent as tag {tag} "
                            f"({nbytes} bytes): the two ranks post their transfers in different orders")
        self.into.reshape(-1).view(np.uint8)[...] = self.staging[8 * _HEADER:8 * _HEADER + nbytes]


class _Send:
    def __init__(self, request, staging):
        self.request, self.staging = request, staging  # the copy stays alive until completion

    def finish(self):
        pass


class FifoTransport(MPITransport):
    """``MPITransport`` with NCCL's matching: first in, first out per peer, tags only
    checked (``MisPaired``), never used to match."""

    name = "mpi (fifo: NCCL's matching)"
    eager = False  # no packet goes on before its step's wait, as on NCCL

    def __init__(self, comm):
        super().__init__(comm)
        self.messages = 0

    def isend(self, buf, dest, tag):
        payload = np.asarray(buf).reshape(-1).view(np.uint8)
        staging = np.empty(8 * _HEADER + payload.size, np.uint8)
        staging[:8 * _HEADER].view(np.int64)[...] = (tag, payload.size)
        staging[8 * _HEADER:] = payload
        self.messages += 1
        return _Send(self.comm.Isend([staging, MPI.BYTE], dest=dest, tag=ONE_TAG), staging)

    def irecv(self, buf, source, tag):
        into = np.asarray(buf)
        # Room for the header and twice the message expected: a larger one than expected is
        # a mis-pairing, reported from the header (past twice, by MPI's truncation error).
        staging = np.empty(8 * _HEADER + 2 * into.nbytes + 4096, np.uint8)
        return _Recv(self.comm.Irecv([staging, MPI.BYTE], source=source, tag=ONE_TAG), staging, into,
                     source, tag, self.comm)

    def wait(self, requests):
        MPI.Request.Waitall([r.request for r in requests])
        for r in requests:
            r.finish()

    def progress(self, requests):
        done = MPI.Request.Testall([r.request for r in requests])
        if done:
            for r in requests:
                r.finish()
        return done
